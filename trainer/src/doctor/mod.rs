//! `dppo doctor`: checks that this build runs correctly on this machine, as a typed report.
//!
//! Three sections: the build (version, features, CPU kernel, threads), CUDA (driver,
//! libraries, embedded PTX, the GPU, NCCL; skipped in a CPU build) and the device check
//! (a small random-weight model on the device against the CPU in the same process: greedy
//! tokens and logprobs in f32 and bf16, one learner step, KV blocks freed, one timed
//! rollout). `full` makes the device check's model and workload larger.

mod agree;
mod compare;
mod full;
mod handoff;
mod paged;
pub mod probe;
mod sampling;
mod workload;

use std::fmt;

use dppo_model::DeviceSpec;
use serde::Serialize;

/// Seed of the checks' random weights: the CPU and the device hold the same ones.
const SEED: u64 = 7;
/// Standard deviation of the random weights: large enough that greedy choices are clear.
const WEIGHT_STD: f32 = 0.3;

/// What to check.
#[derive(Debug, Clone)]
pub struct Options {
    /// The device checked against the CPU.
    pub device: DeviceSpec,
    /// A larger model and more prompts in the device check.
    pub full: bool,
    /// The binary's version.
    pub version: String,
    /// The git commit the binary was built from, when the build recorded it.
    pub commit: Option<String>,
}

/// The outcome of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Ok,
    Fail,
    Skip,
}

/// One line of the report.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    pub name: String,
    pub status: Status,
    /// What was found (values, versions, paths, or why it failed or was skipped).
    pub detail: String,
    /// The likely fix of a failure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
    /// A check of a feature that is off by default until a GPU has passed it: reported, its
    /// failure named in the verdict, but not failing the doctor (the defaults do not use it).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub experiment: bool,
}

impl Check {
    /// A passed check.
    pub fn ok(name: impl Into<String>, detail: impl Into<String>) -> Self {
        Self::new(name, Status::Ok, detail, None)
    }

    /// A skipped check, `detail` saying why.
    pub fn skip(name: impl Into<String>, detail: impl Into<String>) -> Self {
        Self::new(name, Status::Skip, detail, None)
    }

    /// A failed check with its likely fix.
    pub fn fail(
        name: impl Into<String>,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        Self::new(name, Status::Fail, detail, Some(fix.into()))
    }

    /// Ok when `passed`, else failed with `fix`.
    pub fn expect(
        passed: bool,
        name: impl Into<String>,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) -> Self {
        if passed {
            Self::ok(name, detail)
        } else {
            Self::fail(name, detail, fix)
        }
    }

    fn new(
        name: impl Into<String>,
        status: Status,
        detail: impl Into<String>,
        fix: Option<String>,
    ) -> Self {
        Self {
            name: name.into(),
            status,
            detail: detail.into(),
            fix,
            experiment: false,
        }
    }

    /// This check marked as an experiment's ([`Check::experiment`]).
    pub fn of_experiment(self) -> Self {
        Self {
            experiment: true,
            ..self
        }
    }
}

/// A titled group of checks.
#[derive(Debug, Clone, Serialize)]
pub struct Section {
    pub name: &'static str,
    pub checks: Vec<Check>,
}

/// Every section, in the order printed.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub sections: Vec<Section>,
}

impl Report {
    /// The failed checks with their sections, experiments' aside.
    pub fn failures(&self) -> impl Iterator<Item = (&'static str, &Check)> {
        self.failed(false)
    }

    /// The failed checks (`experiments`' alone, or the others) with their sections.
    fn failed(&self, experiments: bool) -> impl Iterator<Item = (&'static str, &Check)> {
        self.sections.iter().flat_map(move |s| {
            s.checks
                .iter()
                .filter(move |c| c.status == Status::Fail && c.experiment == experiments)
                .map(move |c| (s.name, c))
        })
    }

    /// Whether every check but the experiments' passed or was skipped.
    pub fn passed(&self) -> bool {
        self.failures().next().is_none()
    }

    /// One line: OK and the checks passed (and any experiment that failed), or the first
    /// failure, how many more, and its fix.
    pub fn verdict(&self) -> String {
        match self.failures().next() {
            None => {
                let n = self.sections.iter().flat_map(|s| &s.checks);
                let passed = n.filter(|c| c.status == Status::Ok).count();
                let experiments: Vec<&str> =
                    self.failed(true).map(|(_, c)| c.name.as_str()).collect();
                match experiments.is_empty() {
                    true => format!("doctor: OK ({passed} checks)"),
                    false => format!(
                        "doctor: OK ({passed} checks; failed, of features off by default: {})",
                        experiments.join(", ")
                    ),
                }
            }
            Some((section, check)) => {
                let more = self.failures().count() - 1;
                let more = if more > 0 {
                    format!(" (and {more} more)")
                } else {
                    String::new()
                };
                format!(
                    "doctor: FAILED: {section} {}: {}{more} — {}",
                    check.name,
                    check.detail,
                    check.fix.as_deref().unwrap_or("see the lines above")
                )
            }
        }
    }

    /// The report as one JSON object, the verdict included.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "sections": self.sections,
            "passed": self.passed(),
            "verdict": self.verdict(),
        })
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for section in &self.sections {
            for check in &section.checks {
                let status = match check.status {
                    Status::Ok => "ok",
                    Status::Fail => "FAIL",
                    Status::Skip => "skip",
                };
                let off = if check.experiment {
                    " (off by default)"
                } else {
                    ""
                };
                writeln!(
                    f,
                    "{:<7} {status:<4} {}{off}: {}",
                    section.name, check.name, check.detail
                )?;
            }
        }
        write!(f, "{}", self.verdict())
    }
}

/// Runs every check. The CUDA section is probed last, once the device check has loaded
/// every library it uses, and printed second.
pub fn run(opts: &Options) -> Report {
    let build = Section {
        name: "build",
        checks: probe::build_checks(opts),
    };
    let (device, device_checks) = match opts.device.open() {
        Ok(device) => {
            let checks = agree::device_checks(&device, opts.full);
            (Some(device), checks)
        }
        Err(e) => (None, vec![open_failure(opts.device, &e)]),
    };
    let cuda = Section {
        name: "cuda",
        checks: probe::cuda_checks(device.as_ref()),
    };
    Report {
        sections: vec![
            build,
            cuda,
            Section {
                name: "device",
                checks: device_checks,
            },
        ],
    }
}

fn open_failure(spec: DeviceSpec, e: &dppo_model::DeviceError) -> Check {
    let fix = if cfg!(feature = "cuda") {
        "check `nvidia-smi` lists the GPU, that libcuda.so.1 and NVIDIA's libraries are on \
         the loader path (LD_LIBRARY_PATH), and the device index"
    } else {
        "use --device cpu, or build with `cargo build --release --features cuda`"
    };
    Check::fail(format!("open {spec}"), e.to_string(), fix)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(checks: Vec<Check>) -> Report {
        Report {
            sections: vec![Section {
                name: "device",
                checks,
            }],
        }
    }

    #[test]
    fn the_verdict_counts_passed_checks_or_names_the_first_failure_and_its_fix() {
        let good = report(vec![Check::ok("a", "fine"), Check::skip("b", "n/a")]);
        assert!(good.passed());
        assert_eq!(good.verdict(), "doctor: OK (1 checks)");
        let bad = report(vec![
            Check::ok("a", "fine"),
            Check::fail("greedy f32", "3 tokens differ", "report it"),
            Check::fail("kv", "2 blocks held", "report it"),
        ]);
        assert!(!bad.passed());
        assert_eq!(
            bad.verdict(),
            "doctor: FAILED: device greedy f32: 3 tokens differ (and 1 more) — report it"
        );
        let json = bad.to_json();
        // An experiment's failure is named, and fails nothing.
        let trying = report(vec![
            Check::ok("a", "fine"),
            Check::fail("rope K/V writes bf16", "2 tokens differ", "report it").of_experiment(),
        ]);
        assert!(trying.passed());
        assert_eq!(
            trying.verdict(),
            "doctor: OK (1 checks; failed, of features off by default: rope K/V writes bf16)"
        );
        assert_eq!(
            trying.to_json()["sections"][0]["checks"][1]["experiment"],
            true
        );
        assert!(trying.to_json()["sections"][0]["checks"][0]
            .get("experiment")
            .is_none());
        assert!(trying
            .to_string()
            .contains("rope K/V writes bf16 (off by default): 2 tokens"));
        assert_eq!(json["passed"], false);
        assert_eq!(json["sections"][0]["checks"][1]["status"], "fail");
        assert!(json["sections"][0]["checks"][0].get("fix").is_none());
    }
}
