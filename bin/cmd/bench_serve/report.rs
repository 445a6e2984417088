//! What the clients saw, added up, and the verdict: throughput, latency percentiles, errors
//! by kind, blocks in use and RSS.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::{json, Value};

use super::workload::Outcome;
use super::{Args, Metrics};

/// The outcomes of a phase of load.
#[derive(Debug, Default)]
pub struct Tally {
    done: usize,
    hung_up: usize,
    rejected: usize,
    /// Failures by kind: how many, and the first one's detail.
    failures: BTreeMap<String, (usize, String)>,
    latencies: Vec<Duration>,
    ttfts: Vec<Duration>,
    /// Wall time of the phase, requests under way at its end included.
    pub elapsed: Duration,
}

impl Tally {
    /// Counts one request.
    pub fn add(&mut self, outcome: Outcome) {
        match outcome {
            Outcome::Done { latency, ttft } => {
                self.done += 1;
                self.latencies.push(latency);
                self.ttfts.extend(ttft);
            }
            Outcome::HungUp => self.hung_up += 1,
            Outcome::Rejected => self.rejected += 1,
            Outcome::Failed(kind, detail) => {
                self.failures.entry(kind).or_insert((0, detail)).0 += 1;
            }
        }
    }

    /// Adds another client's counts.
    pub fn merge(&mut self, other: Tally) {
        self.done += other.done;
        self.hung_up += other.hung_up;
        self.rejected += other.rejected;
        for (kind, (n, detail)) in other.failures {
            self.failures.entry(kind).or_insert((0, detail)).0 += n;
        }
        self.latencies.extend(other.latencies);
        self.ttfts.extend(other.ttfts);
    }

    fn requests(&self) -> usize {
        self.done
            + self.hung_up
            + self.rejected
            + self.failures.values().map(|f| f.0).sum::<usize>()
    }
}

/// The `p`-th percentile in milliseconds (nearest rank), `None` without samples.
fn percentile(samples: &[Duration], p: f64) -> Option<f64> {
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * ms.len() as f64).ceil() as usize;
    ms.get(rank.clamp(1, ms.len().max(1)) - 1).copied()
}

const MIB: f64 = 1024.0 * 1024.0;

/// The numbers of a soak and its checks.
pub struct Report {
    json: Value,
    failures: Vec<String>,
}

impl Report {
    /// Builds the report from the warm-up and measured phases and the server's metrics when
    /// idle after each.
    pub fn new(
        args: &Args,
        warmup: &Tally,
        load: &Tally,
        before: &Metrics,
        after: &Metrics,
    ) -> Report {
        let gauge = |m: &Metrics, k: &str| m.get(k).copied();
        let secs = load.elapsed.as_secs_f64();
        let tokens = gauge(after, "dppo_generation_tokens_total").unwrap_or(0.0)
            - gauge(before, "dppo_generation_tokens_total").unwrap_or(0.0);
        let mut errors = BTreeMap::new();
        for (phase, tally) in [("warm-up", warmup), ("measured", load)] {
            for (kind, (n, detail)) in &tally.failures {
                let e = errors.entry(kind.clone()).or_insert(json!({"count": 0, "phase": phase, "example": detail.chars().take(300).collect::<String>()}));
                e["count"] = json!(e["count"].as_u64().unwrap_or(0) + *n as u64);
            }
        }
        let rss = |m: &Metrics| gauge(m, "process_resident_memory_bytes").map(|b| b / MIB);
        let (rss_start, rss_end) = (rss(before), rss(after));
        let count = |m: &Metrics, k: &str| gauge(m, k).map(|v| v as u64);
        let blocks_end = count(after, "dppo_kv_blocks_used");
        let pending_end = count(after, "dppo_requests_pending");
        let mut failures = Vec::new();
        if !errors.is_empty() {
            failures.push(format!(
                "errors other than 429: {}",
                Value::Object(errors.clone().into_iter().collect())
            ));
        }
        if load.done == 0 {
            failures.push("no request completed".into());
        }
        if blocks_end != Some(0) || pending_end != Some(0) {
            failures.push(format!(
                "at the end {blocks_end:?} KV blocks and {pending_end:?} requests still held"
            ));
        }
        // The KV pool is allocated untouched: blocks used for the first time after the
        // warm-up fault in their pages. That growth is bounded by the pool and not a leak.
        let peak = |m: &Metrics| gauge(m, "dppo_kv_blocks_peak").unwrap_or(0.0);
        let kv_first_touch_mib = (peak(after) - peak(before)).max(0.0)
            * gauge(after, "dppo_kv_block_bytes").unwrap_or(0.0)
            / MIB;
        let rss_growth = rss_start.zip(rss_end).map(|(start, end)| end - start);
        let unexplained = rss_growth.map(|g| g - kv_first_touch_mib);
        match unexplained {
            Some(u) if u > args.rss_tolerance_mib as f64 => failures.push(format!(
                "RSS grew by {:.0} MiB after warm-up, {u:.0} MiB beyond new KV blocks \
                 (tolerance {} MiB)",
                rss_growth.unwrap_or(0.0),
                args.rss_tolerance_mib
            )),
            Some(_) => {}
            None => failures.push("the server reports no process_resident_memory_bytes".into()),
        }
        let json = json!({
            "model": args.served_model_name.as_deref().unwrap_or(&args.model),
            "clients": args.clients,
            "seconds": args.seconds,
            "warmup_seconds": args.warmup_seconds,
            "max_tokens": args.max_tokens,
            "elapsed_s": secs,
            "requests": load.requests(),
            "completed": load.done,
            "cancelled_by_client": load.hung_up,
            "rejected_429": load.rejected,
            "warmup_requests": warmup.requests(),
            "errors": errors,
            "requests_per_s": load.done as f64 / secs,
            "tokens_per_s": tokens / secs,
            "latency_ms": {"p50": percentile(&load.latencies, 50.0), "p99": percentile(&load.latencies, 99.0)},
            "ttft_ms": {"p50": percentile(&load.ttfts, 50.0), "p99": percentile(&load.ttfts, 99.0)},
            "kv_blocks_used_end": blocks_end,
            "kv_blocks_total": count(after, "dppo_kv_blocks_total"),
            "requests_pending_end": pending_end,
            "rss_start_mib": rss_start,
            "rss_end_mib": rss_end,
            "rss_kv_first_touch_mib": kv_first_touch_mib,
            "rss_growth_beyond_kv_mib": unexplained,
            "kv_blocks_peak": {"after_warmup": count(before, "dppo_kv_blocks_peak"), "end": count(after, "dppo_kv_blocks_peak")},
            "rss_tolerance_mib": args.rss_tolerance_mib,
            "passed": failures.is_empty(),
        });
        Report { json, failures }
    }

    /// The report as one JSON object.
    pub fn json(&self) -> &Value {
        &self.json
    }

    /// What failed (empty when the soak passed).
    pub fn failures(&self) -> &[String] {
        &self.failures
    }

    /// The report as aligned lines for a terminal.
    pub fn table(&self) -> String {
        let j = &self.json;
        let ms = |v: &Value| v.as_f64().map_or("-".into(), |x| format!("{x:.0} ms"));
        let mib = |v: &Value| v.as_f64().map_or("-".into(), |x| format!("{x:.0} MiB"));
        let lines = [
            (
                "model",
                format!(
                    "{} ({} clients, {} s after {} s warm-up, max_tokens <= {})",
                    j["model"].as_str().unwrap_or(""),
                    j["clients"],
                    j["seconds"],
                    j["warmup_seconds"],
                    j["max_tokens"]
                ),
            ),
            (
                "requests",
                format!(
                    "{} in {:.1} s: {} completed, {} cancelled by the client, {} answered 429",
                    j["requests"],
                    j["elapsed_s"].as_f64().unwrap_or(0.0),
                    j["completed"],
                    j["cancelled_by_client"],
                    j["rejected_429"]
                ),
            ),
            (
                "throughput",
                format!(
                    "{:.2} requests/s, {:.1} generated tokens/s",
                    j["requests_per_s"].as_f64().unwrap_or(0.0),
                    j["tokens_per_s"].as_f64().unwrap_or(0.0)
                ),
            ),
            (
                "latency",
                format!(
                    "p50 {}, p99 {}",
                    ms(&j["latency_ms"]["p50"]),
                    ms(&j["latency_ms"]["p99"])
                ),
            ),
            (
                "first token",
                format!(
                    "p50 {}, p99 {} (streams)",
                    ms(&j["ttft_ms"]["p50"]),
                    ms(&j["ttft_ms"]["p99"])
                ),
            ),
            (
                "errors",
                if self.json["errors"]
                    .as_object()
                    .is_some_and(|e| e.is_empty())
                {
                    "none but 429".into()
                } else {
                    j["errors"].to_string()
                },
            ),
            (
                "KV blocks",
                format!(
                    "{} of {} in use at the end",
                    j["kv_blocks_used_end"], j["kv_blocks_total"]
                ),
            ),
            (
                "server RSS",
                format!(
                    "{} after warm-up, {} at the end: {} of it KV blocks used for the first \
                     time (peak {} -> {}), {} beyond (tolerance {} MiB)",
                    mib(&j["rss_start_mib"]),
                    mib(&j["rss_end_mib"]),
                    mib(&j["rss_kv_first_touch_mib"]),
                    j["kv_blocks_peak"]["after_warmup"],
                    j["kv_blocks_peak"]["end"],
                    mib(&j["rss_growth_beyond_kv_mib"]),
                    j["rss_tolerance_mib"]
                ),
            ),
            (
                "verdict",
                if self.failures.is_empty() {
                    "passed".into()
                } else {
                    format!("FAILED: {}", self.failures.join("; "))
                },
            ),
        ];
        lines
            .iter()
            .map(|(k, v)| format!("{k:<12} {v}"))
            .collect::<Vec<_>>()
            .join("\n")
    }
}
