//! The launcher: `dppo run --devices cpu,cpu` as processes, and ranks started by hand with
//! torchrun's variables.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::Device;
use dppo_model::Policy;
use serde_json::{Map, Value};

use super::{values, worst_relative};
use crate::util::assert_same_checkpoint;

const RUN: [&str; 14] = [
    "--set",
    "warmup.steps=3",
    "--set",
    "data.num_train=16",
    "--set",
    "data.num_eval=8",
    "--set",
    "rollout.prompts_per_step=8",
    "--set",
    "checkpoint.every=2",
    "--set",
    "checkpoint.keep=5",
    "--set",
    "eval.every=2",
];

/// `dppo run` into `out` with `RUN`, `extra` arguments and environment `env`.
fn dppo_run(out: &Path, extra: &[&str], env: &[(&str, String)]) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dppo"));
    cmd.args(["run", "--out", out.to_str().unwrap()])
        .args(RUN)
        .args(extra)
        .env("RUST_LOG", "warn");
    for var in [
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_USE_AGENT_STORE",
        "DPPO_MASTER_PORT",
    ] {
        cmd.env_remove(var);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd
}

/// Runs `cmd` to its end (at most `secs`); returns success, stdout and stderr.
fn finish(mut cmd: Command, secs: u64) -> (bool, String, String) {
    let child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start dppo");
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(child.wait_with_output()));
    let out = match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
            panic!("dppo run (pid {pid}) did not finish within {secs} s");
        }
    };
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn metrics(out: &Path) -> Vec<Map<String, Value>> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn checkpoint_weights(out: &Path, step: u64) -> BTreeMap<String, Vec<f32>> {
    let dir = out.join(format!("checkpoints/step-{step:06}"));
    values(
        &Policy::load(dir.to_str().unwrap(), &Device::Cpu)
            .unwrap()
            .weights,
    )
}

/// The non-timing metrics of a run, every value exact.
fn trained(lines: &[Map<String, Value>]) -> Vec<BTreeMap<String, Value>> {
    lines
        .iter()
        .map(|l| {
            l.iter()
                .filter(|(k, _)| {
                    !["timing_s/", "perf/", "actor/", "pack/"]
                        .iter()
                        .any(|p| k.starts_with(p))
                })
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect()
        })
        .collect()
}

/// `--devices cpu,cpu` runs two processes (rank 1 started by rank 0) and trains what one
/// rank with the same global batch trains: the same rollouts, pruning, evaluations and,
/// within 1e-5, weights; rank 0 alone writes the run directory. A resumed 2-rank run ends
/// bit for bit where the uninterrupted one does.
#[test]
fn two_cpu_ranks_match_one_rank_and_resume_bit_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (one, two, resumed) = (
        dir.path().join("one"),
        dir.path().join("two"),
        dir.path().join("resumed"),
    );
    let steps = ["--set", "steps=4"];
    let (ok, _, err) = finish(dppo_run(&one, &steps, &[]), 300);
    assert!(ok, "{err}");
    let devices = ["--devices", "cpu,cpu", "--set", "steps=4"];
    let (ok, stdout, err) = finish(dppo_run(&two, &devices, &[]), 300);
    assert!(ok, "{err}");
    assert_eq!(
        stdout.matches("run directory").count(),
        1,
        "rank 0 alone prints: {stdout}"
    );
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(two.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["ranks"], 2);
    let one_summary: Value =
        serde_json::from_str(&std::fs::read_to_string(one.join("summary.json")).unwrap()).unwrap();
    for key in ["eval_before", "eval_after", "steps", "policy_version"] {
        assert_eq!(summary[key], one_summary[key], "{key}");
    }
    assert_eq!(trained(&metrics(&one)), trained(&metrics(&two)));
    let worst = worst_relative(&checkpoint_weights(&two, 4), &checkpoint_weights(&one, 4));
    assert!(worst <= 1e-5, "2 ranks vs 1: weights differ by {worst:e}");
    // Stopped after step 2 (its checkpoint), then resumed to step 4 on 2 ranks.
    let (ok, _, err) = finish(
        dppo_run(&resumed, &["--devices", "cpu,cpu", "--set", "steps=2"], &[]),
        300,
    );
    assert!(ok, "{err}");
    let (ok, _, err) = finish(
        dppo_run(
            &resumed,
            &[
                "--devices",
                "cpu,cpu",
                "--resume",
                "latest",
                "--set",
                "steps=4",
            ],
            &[],
        ),
        300,
    );
    assert!(ok, "{err}");
    assert_same_checkpoint(
        &two,
        &resumed,
        4,
        "the resumed 2-rank run against the uninterrupted one",
    );
    assert_eq!(metrics(&resumed).len(), 4);
    assert_eq!(trained(&metrics(&two)), trained(&metrics(&resumed)));
    // A one-rank checkpoint (with its rollout made ahead of step 3) resumed on two ranks:
    // each takes its share of that rollout, and the run goes on as the one-rank run does.
    let cross = dir.path().join("cross");
    assert!(Command::new("cp")
        .args(["-r", one.to_str().unwrap(), cross.to_str().unwrap()])
        .status()
        .unwrap()
        .success());
    let from = cross.join("checkpoints/step-000002");
    let (ok, _, err) = finish(
        dppo_run(
            &cross,
            &[
                "--devices",
                "cpu,cpu",
                "--resume",
                from.to_str().unwrap(),
                "--set",
                "steps=4",
            ],
            &[],
        ),
        300,
    );
    assert!(ok, "{err}");
    assert_eq!(trained(&metrics(&one)), trained(&metrics(&cross)));
    let worst = worst_relative(&checkpoint_weights(&cross, 4), &checkpoint_weights(&one, 4));
    assert!(
        worst <= 1e-5,
        "1 rank resumed on 2: weights differ by {worst:e}"
    );
}

/// Ctrl-C (SIGINT) to rank 0 reaches every rank: without `--serve` the run ends at once as
/// a signalled process would (status 130) and rank 1 with it; with `--serve` (rank 0
/// serves) every rank stops after the same step, with that step's checkpoint and a summary.
#[test]
fn ctrl_c_reaches_every_rank() {
    for serve in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("run");
        let mut extra = vec!["--devices", "cpu,cpu", "--set", "steps=100000"];
        if serve {
            extra.extend(["--serve", "127.0.0.1:0"]);
        }
        let mut child = dppo_run(&out, &extra, &[])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let start = Instant::now();
        let rank1 = rank1_once_training(&out, child.id());
        assert!(Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status()
            .unwrap()
            .success());
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            assert!(
                start.elapsed() < Duration::from_secs(180),
                "serve={serve}: no stop"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        std::thread::sleep(Duration::from_millis(200));
        assert!(!alive(rank1[0]), "serve={serve}: rank 1 outlived the run");
        if !serve {
            assert_eq!(status.code(), Some(130), "{status}");
            continue;
        }
        assert!(status.success(), "{status}");
        let summary: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap())
                .unwrap();
        let steps = summary["steps"].as_u64().unwrap();
        assert!((2..100000).contains(&steps), "{summary}");
        assert_eq!(metrics(&out).len() as u64, steps);
        let ckpt = out.join(format!("checkpoints/step-{steps:06}/manifest.json"));
        assert!(ckpt.exists(), "no checkpoint of the last step");
    }
}

/// A rank that dies (SIGKILL) fails the whole run within seconds with an error naming it;
/// a rank that stops answering (SIGSTOP) fails it after `rank_timeout_s`.
#[test]
fn a_killed_or_hung_rank_fails_the_run_naming_it() {
    for (sig, want) in [
        ("-KILL", "rank 1 (pid"),
        ("-STOP", "rank 1 did not answer rank 0 within 5 s"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("run");
        let mut cmd = dppo_run(
            &out,
            &[
                "--devices",
                "cpu,cpu",
                "--set",
                "steps=100000",
                "--set",
                "rank_timeout_s=5",
            ],
            &[],
        );
        let mut child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut { stderr }, &mut s).unwrap();
            s
        });
        let rank1 = rank1_once_training(&out, child.id());
        let killed_at = Instant::now();
        assert!(Command::new("kill")
            .args([sig, &rank1[0].to_string()])
            .status()
            .unwrap()
            .success());
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if killed_at.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                let _ = Command::new("kill")
                    .args(["-9", &rank1[0].to_string()])
                    .status();
                panic!("{sig}: the run did not stop within 60 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let err = reader.join().unwrap();
        assert!(!status.success(), "{sig}");
        assert!(err.contains(want), "{sig}: {err}");
        // No rank is left behind.
        std::thread::sleep(Duration::from_millis(200));
        assert!(!alive(rank1[0]), "{sig}: rank 1 outlived the run");
    }
}

/// Waits until rank 0 (process `rank0`) has written two metrics lines to `out`, then
/// returns the one rank it started (as a one-element list of pids).
fn rank1_once_training(out: &std::path::Path, rank0: u32) -> Vec<u32> {
    let start = Instant::now();
    while std::fs::read_to_string(out.join("metrics.jsonl")).map_or(0, |m| m.lines().count()) < 2 {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "training did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let rank1 = children_of(rank0);
    assert_eq!(rank1.len(), 1, "rank 0 started one rank: {rank1:?}");
    rank1
}

/// The process ids of `pid`'s children (from /proc).
fn children_of(pid: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for task in std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .flatten()
    {
        if let Ok(list) = std::fs::read_to_string(task.path().join("children")) {
            out.extend(list.split_whitespace().map(|p| p.parse::<u32>().unwrap()));
        }
    }
    out
}

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit_once(") ")
            .is_some_and(|(_, rest)| !rest.starts_with('Z'))
    })
}

/// Ranks started by hand with torchrun's variables (as torchrun or Slurm start them) run
/// the same training as the launcher's; a rank started with another configuration is
/// refused naming the difference.
#[test]
fn ranks_started_with_torchrun_variables_train_like_the_launcher() {
    let dir = tempfile::tempdir().unwrap();
    let (launched, manual) = (dir.path().join("launched"), dir.path().join("manual"));
    let steps = ["--set", "steps=2"];
    let (ok, _, err) = finish(
        dppo_run(
            &launched,
            &["--devices", "cpu,cpu", "--set", "steps=2"],
            &[],
        ),
        300,
    );
    assert!(ok, "{err}");
    let env = torchrun_env(true);
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let cmd = dppo_run(&manual, &steps, &env(rank));
            std::thread::spawn(move || finish(cmd, 300))
        })
        .collect();
    for (rank, r) in ranks.into_iter().enumerate() {
        let (ok, _, err) = r.join().unwrap();
        assert!(ok, "rank {rank}: {err}");
    }
    assert_same_checkpoint(
        &launched,
        &manual,
        2,
        "torchrun-style ranks against the launcher's",
    );
    // Rank 1 with another learning rate: refused, naming the key.
    // Without LOCAL_RANK, as a launcher that sets only RANK starts ranks.
    let env = torchrun_env(false);
    let other = dir.path().join("other");
    let ranks: Vec<_> = (0..2)
        .map(|rank| {
            let lr = if rank == 0 {
                "actor.lr=0.001"
            } else {
                "actor.lr=0.002"
            };
            let cmd = dppo_run(
                &other,
                &["--set", lr, "--set", "rank_timeout_s=30"],
                &env(rank),
            );
            std::thread::spawn(move || finish(cmd, 120))
        })
        .collect();
    let results: Vec<_> = ranks.into_iter().map(|r| r.join().unwrap()).collect();
    assert!(results.iter().all(|(ok, _, _)| !ok));
    let err = &results[0].2;
    assert!(
        err.contains("rank 1 runs another configuration") && err.contains("lr"),
        "{err}"
    );
}

/// torchrun's variables for each rank of a two-rank run meeting on a free loopback port,
/// `LOCAL_RANK` among them when `local_rank`.
fn torchrun_env(local_rank: bool) -> impl Fn(usize) -> Vec<(&'static str, String)> {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    move |rank| {
        let mut env = vec![
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", "2".to_string()),
            ("MASTER_ADDR", "127.0.0.1".to_string()),
            ("MASTER_PORT", port.to_string()),
        ];
        if local_rank {
            env.push(("LOCAL_RANK", rank.to_string()));
        }
        env
    }
}
