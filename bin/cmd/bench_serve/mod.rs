//! `dppo bench serve`: a load and soak test of the OpenAI-compatible server. Starts
//! `dppo serve` as a child process on loopback (or loads one already running there), warms
//! it up, then runs N concurrent clients for a given time mixing completions and chat,
//! streamed and whole answers, `n > 1`, seeds and clients that hang up mid-way. Reports
//! requests/s, latency and time-to-first-token percentiles, errors by kind, KV blocks in
//! use at the end and the server's RSS after warm-up and at the end; fails unless only 429s
//! went wrong, every block came back and RSS stayed within the tolerance.

mod http;
mod report;
mod server;
mod workload;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use report::{Report, Tally};
use workload::{Outcome, Spec, Target};

/// Arguments of `dppo bench serve`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Model for the `dppo serve` child process (any `--model` of `dppo serve`).
    #[arg(long, default_value = "builtin:tiny")]
    model: String,
    /// Load a server already listening at this loopback address instead of starting one
    /// (requests then name --served-model-name).
    #[arg(long)]
    target: Option<SocketAddr>,
    /// Model id the requests name (default: --model).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Concurrent clients (1 to 1024).
    #[arg(long, default_value_t = 256)]
    clients: usize,
    /// Seconds of measured load (1 to 86400); requests under way then finish.
    #[arg(long, default_value_t = 300)]
    seconds: u64,
    /// Seconds of the same load before the measurement (RSS is read after it).
    #[arg(long, default_value_t = 30)]
    warmup_seconds: u64,
    /// `--max-pending` of the child server (fewer than --clients exercises 429s).
    #[arg(long, default_value_t = 256)]
    max_pending: usize,
    /// Largest `max_tokens` a request asks for (each draws 1 to this).
    #[arg(long, default_value_t = 48)]
    max_tokens: usize,
    /// Seed of the request mix.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Seconds one request may take before it counts as a timeout.
    #[arg(long, default_value_t = 600)]
    request_timeout: u64,
    /// Allowed growth of the server's RSS from after warm-up to the end, in MiB.
    #[arg(long, default_value_t = 64)]
    rss_tolerance_mib: u64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// How long the server gets to free every block and place once the clients are done.
const IDLE_TIMEOUT: Duration = Duration::from_secs(120);

/// Runs the load, prints the report, and fails when a check does.
pub fn run(args: Args) -> anyhow::Result<()> {
    ensure!(
        (1..=1024).contains(&args.clients),
        "--clients must be 1 to 1024"
    );
    ensure!(
        (1..=86_400).contains(&args.seconds),
        "--seconds must be 1 to 86400"
    );
    ensure!(
        (1..=4096).contains(&args.max_tokens),
        "--max-tokens must be 1 to 4096"
    );
    let api_key = std::env::var("DPPO_API_KEY").ok().filter(|k| !k.is_empty());
    let model = args
        .served_model_name
        .clone()
        .unwrap_or_else(|| args.model.clone());
    let child = match args.target {
        Some(addr) => {
            ensure!(
                addr.ip().is_loopback(),
                "--target must be a loopback address"
            );
            None
        }
        None => Some(server::Child::start(&args.model, &model, args.max_pending)?),
    };
    let target = Target {
        addr: args
            .target
            .or(child.as_ref().map(server::Child::addr))
            .context("no server address")?,
        model,
        api_key,
        timeout: Duration::from_secs(args.request_timeout),
    };
    if !args.json {
        eprintln!(
            "{} clients against {} at {}: {} s warm-up, then {} s measured",
            args.clients, target.model, target.addr, args.warmup_seconds, args.seconds
        );
    }
    let warmup = load(&target, &args, args.warmup_seconds, args.seed ^ 0x5eed);
    let before = wait_idle(&target)?;
    let measured = load(&target, &args, args.seconds, args.seed);
    let after = wait_idle(&target)?;
    if let Some(child) = child {
        child.stop()?;
    }
    let report = Report::new(&args, &warmup, &measured, &before, &after);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report.json())?);
    } else {
        println!("{}", report.table());
    }
    let failures = report.failures();
    if !failures.is_empty() {
        bail!("the soak failed: {}", failures.join("; "));
    }
    Ok(())
}

/// `clients` threads sending the mix for `seconds` (requests under way then finish).
fn load(target: &Target, args: &Args, seconds: u64, seed: u64) -> Tally {
    let start = Instant::now();
    let end = start + Duration::from_secs(seconds);
    let mut total = std::thread::scope(|scope| {
        let clients: Vec<_> = (0..args.clients as u64)
            .map(|c| {
                std::thread::Builder::new()
                    .name(format!("client-{c}"))
                    .stack_size(512 << 10)
                    .spawn_scoped(scope, move || client(target, args, seed, c, end))
                    .expect("spawn a client thread")
            })
            .collect();
        let mut total = Tally::default();
        for c in clients {
            total.merge(c.join().expect("a client thread panicked"));
        }
        total
    });
    total.elapsed = start.elapsed();
    total
}

/// One client: requests one after the other until `end`, backing off a little after a 429.
fn client(target: &Target, args: &Args, seed: u64, index: u64, end: Instant) -> Tally {
    let mut rng = StdRng::seed_from_u64(seed.wrapping_mul(1_000_003).wrapping_add(index));
    let mut tally = Tally::default();
    while Instant::now() < end {
        let spec = Spec::random(&mut rng, args.max_tokens);
        let outcome = workload::run_one(target, &spec);
        if matches!(outcome, Outcome::Rejected) {
            std::thread::sleep(Duration::from_millis(rng.random_range(20..200)));
        }
        tally.add(outcome);
    }
    tally
}

/// The server's `/metrics` gauges and counters (unlabelled ones), by name.
pub type Metrics = BTreeMap<String, f64>;

fn metrics(target: &Target) -> anyhow::Result<Metrics> {
    let stream = http::send(
        target.addr,
        "GET",
        "/metrics",
        "",
        target.api_key.as_deref(),
        Duration::from_secs(30),
    )
    .context("GET /metrics")?;
    let response = http::Response::read_head(stream).context("GET /metrics")?;
    ensure!(response.status == 200, "GET /metrics: {}", response.status);
    let text = response.text().context("GET /metrics")?;
    Ok(text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.contains('{'))
        .filter_map(|l| {
            let (name, value) = l.split_once(' ')?;
            Some((name.to_string(), value.trim().parse().ok()?))
        })
        .collect())
}

/// Waits until the server holds no KV block, no request and no sequence (or
/// [`IDLE_TIMEOUT`] passed), and returns its metrics then.
fn wait_idle(target: &Target) -> anyhow::Result<Metrics> {
    let start = Instant::now();
    loop {
        let m = metrics(target)?;
        let busy = [
            "dppo_kv_blocks_used",
            "dppo_requests_pending",
            "dppo_sequences_running",
            "dppo_queue_depth",
        ]
        .iter()
        .any(|k| m.get(*k).copied().unwrap_or(0.0) != 0.0);
        if !busy || start.elapsed() > IDLE_TIMEOUT {
            return Ok(m);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}
