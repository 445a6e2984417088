//! The binary's resume and crash safety: resumed, SIGKILLed and out-of-disk runs end with
//! the uninterrupted run's weights, or stop with their last checkpoint and metrics whole.

use std::process::Command;

use serde_json::Value;

use super::{dppo, SMALL};
use crate::util::assert_same_checkpoint;

/// Runs four RL steps straight (into `dir/a`) and as two steps resumed to four (into
/// `dir/b`), both with `extra` settings, and asserts that the resumed run ends with exactly
/// the uninterrupted run's weights and optimizer moments. Returns the two run directories.
fn interrupted_and_uninterrupted(
    dir: &std::path::Path,
    extra: &[&str],
) -> (std::path::PathBuf, std::path::PathBuf) {
    let (a, b) = (dir.join("a"), dir.join("b"));
    let run = |out: &std::path::Path, more: &[&str]| {
        let mut args = vec!["run", "--out", out.to_str().unwrap()];
        args.extend_from_slice(&SMALL);
        args.extend_from_slice(more);
        let (ok, _, stderr) = dppo(&args);
        assert!(ok, "{stderr}");
    };
    // The KL term moves the weights every step, whatever the rewards of this barely trained
    // model (its reference is the policy after warm-up, which two steps leave behind).
    let mut settings = vec!["--set", "actor.beta=0.1"];
    settings.extend_from_slice(extra);
    run(&a, &[&settings[..], &["--set", "steps=4"]].concat());
    // Stopped after step 2, then resumed to step 4.
    run(&b, &[&settings[..], &["--set", "steps=2"]].concat());
    let ckpt = b.join("checkpoints/step-000002");
    run(
        &b,
        &["--resume", ckpt.to_str().unwrap(), "--set", "steps=4"],
    );
    let weights = |run: &std::path::Path, step: &str| {
        std::fs::read(run.join(format!(
            "checkpoints/step-00000{step}/model/model.safetensors"
        )))
        .unwrap()
    };
    assert!(
        weights(&a, "2") != weights(&a, "4"),
        "RL steps must change the weights"
    );
    assert_same_checkpoint(&a, &b, 4, "the resumed run against the uninterrupted one");
    (a, b)
}

#[test]
fn one_step_off_policy_resumes_with_the_rollout_made_ahead_of_its_step() {
    let dir = tempfile::tempdir().unwrap();
    let (_, b) =
        interrupted_and_uninterrupted(dir.path(), &["--set", "rollout.one_step_off_policy=true"]);
    let state: Value = serde_json::from_str(
        &std::fs::read_to_string(b.join("checkpoints/step-000002/state.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(state["pending"]["step"], 2, "{}", state["pending"]);
    assert_eq!(
        state["pending"]["version"].as_u64().unwrap() + 1,
        state["policy_version"].as_u64().unwrap()
    );
}

#[test]
fn resumed_run_ends_with_the_weights_of_an_uninterrupted_run() {
    let dir = tempfile::tempdir().unwrap();
    let (_, b) = interrupted_and_uninterrupted(dir.path(), &[]);
    let lines = std::fs::read_to_string(b.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .count();
    assert_eq!(lines, 4, "the resumed run appends to metrics.jsonl");
    // The checkpoint loads as a model (its `model/` is an HF directory).
    let (ok, stdout, stderr) = dppo(&[
        "generate",
        "--model",
        b.join("checkpoints/step-000004").to_str().unwrap(),
        "--prompt",
        "What is 12+34?",
        "--chat",
        "--temperature",
        "0",
        "--max-tokens",
        "4",
        "--json",
    ]);
    assert!(ok && stdout.contains("token_ids"), "{stderr}");
    // ... and `dppo eval` scores it on the run's held-out split.
    let model = b.join("checkpoints/step-000004/model");
    let eval = |extra: &[&str]| -> Value {
        let mut args = vec!["eval", "--model", model.to_str().unwrap()];
        args.extend_from_slice(&["--data", "builtin:arithmetic", "--limit", "8"]);
        args.extend_from_slice(&["--max-tokens", "8"]);
        args.extend_from_slice(extra);
        let (ok, stdout, stderr) = dppo(&args);
        assert!(ok, "{stderr}");
        serde_json::from_str(stdout.trim()).unwrap()
    };
    let report = eval(&["--n", "2", "--k", "2", "--temperature", "1"]);
    let (avg, pass) = (
        report["avg@2"].as_f64().unwrap(),
        report["pass@2"].as_f64().unwrap(),
    );
    assert!(
        (0.0..=1.0).contains(&avg) && pass >= avg && pass <= 1.0,
        "{report}"
    );
    // Greedy, it reproduces the run's own final evaluation of its held-out split, and
    // `--samples` writes every scored sample of those problems.
    let samples = dir.path().join("samples.jsonl");
    let report = eval(&["--samples", samples.to_str().unwrap()]);
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(b.join("summary.json")).unwrap()).unwrap();
    assert_eq!(report["avg@1"], summary["eval_after"], "{report} {summary}");
    let (_, held_out) = dppo_trainer::data::builtin_task("arithmetic", 0, 8, 0).unwrap();
    let lines: Vec<Value> = std::fs::read_to_string(&samples)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), held_out.len());
    let mut total = 0.0;
    for (line, problem) in lines.iter().zip(&held_out) {
        assert_eq!(line["question"], problem.question.as_str());
        assert_eq!(line["answer"], problem.answer.as_ref().unwrap().to_string());
        let sample = &line["samples"][0];
        let reward = sample["reward"].as_f64().unwrap();
        let text = sample["text"].as_str().unwrap();
        let truncated = sample["truncated"].as_bool().unwrap();
        let mode = dppo_rewards::ExtractMode::Answer;
        let verdict = dppo_rewards::verify(text, truncated, problem.answer.as_ref().unwrap(), mode);
        assert_eq!(reward, f64::from(u8::from(verdict.is_correct)));
        let rule = dppo_rewards::rule_name(verdict.extracted_by);
        assert_eq!(sample["extracted_by"], rule);
        total += reward;
    }
    assert_eq!(total / 8.0, report["avg@1"].as_f64().unwrap());
    assert_eq!(
        report["extract"], "answer",
        "the built-in task's own format"
    );
    let boxed = eval(&["--extract", "boxed"]);
    assert_eq!(
        (
            &boxed["extract"],
            &boxed["extracted_by"]["none"],
            &boxed["avg@1"]
        ),
        (&Value::from("boxed"), &Value::from(8), &Value::from(0.0)),
        "an arithmetic answer is never boxed: {boxed}"
    );
    // `dppo score` re-scores the file to the same verdicts.
    let path = samples.to_str().unwrap();
    let (ok, stdout, stderr) = dppo(&["score", "--data", path, "--extract", "answer"]);
    assert!(ok, "{stderr}");
    let rescored: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(rescored["agreement"], 1.0, "{rescored}");
    assert_eq!(rescored["accuracy"], report["avg@1"], "{rescored}");
}

/// `dppo run --resume latest`, SIGKILLed at seeded random moments of every step (some during
/// checkpoint writes: it checkpoints every step) and restarted after each kill, ends with the
/// uninterrupted run's weights and optimizer bit for bit and one metrics line per step;
/// after the first checkpoint, no kill leaves the directory without a loadable one.
#[test]
fn sigkilled_runs_resume_to_the_uninterrupted_weights() {
    use rand::{Rng, SeedableRng};
    use std::time::{Duration, Instant};
    const STEPS: u64 = 6;
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let steps = format!("steps={STEPS}");
    let args = |out: &std::path::Path| -> Vec<String> {
        let mut args = vec!["run", "--resume", "latest", "--out", out.to_str().unwrap()];
        args.extend_from_slice(&SMALL);
        args.extend_from_slice(&["--set", "actor.beta=0.1", "--set", "checkpoint.every=1"]);
        args.extend_from_slice(&["--set", "checkpoint.keep=2", "--set", &steps]);
        args.into_iter().map(str::to_string).collect()
    };
    let spawn = |out: &std::path::Path| {
        Command::new(env!("CARGO_BIN_EXE_dppo"))
            .args(args(out))
            .env("RUST_LOG", "error")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start dppo run")
    };
    let start = Instant::now();
    assert!(spawn(&a).wait().unwrap().success());
    let per_step = start.elapsed() / STEPS as u32;
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (mut kills, mut kills_with_checkpoint, mut had_checkpoint) = (0, 0, false);
    let checkpoints = b.join("checkpoints");
    let metrics = b.join("metrics.jsonl");
    let lines_written = || {
        std::fs::read_to_string(&metrics)
            .map(|t| t.lines().count() as u64)
            .unwrap_or(0)
    };
    // Two kills per step, each a seeded moment after the run has written that many metrics
    // lines (so after as many checkpoints): kills follow the run's progress rather than the
    // clock, and land in warm-ups, steps and checkpoint writes however loaded the machine.
    for target in (0..STEPS).flat_map(|s| [s, s]) {
        let mut child = spawn(&b);
        let deadline = Instant::now() + Duration::from_secs(300);
        while lines_written() < target && child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "step {target} never came");
            std::thread::sleep(Duration::from_millis(2));
        }
        std::thread::sleep(per_step.mul_f64(rng.random_range(0.0..1.0)));
        if child.try_wait().unwrap().is_none() {
            child.kill().unwrap();
            kills += 1;
            kills_with_checkpoint += usize::from(had_checkpoint);
        }
        child.wait().unwrap();
        let newest = dppo_trainer::checkpoint::latest(&checkpoints);
        assert!(
            newest.is_some() || !had_checkpoint,
            "kill {kills} left no loadable checkpoint"
        );
        if let Some(ckpt) = newest {
            had_checkpoint = true;
            dppo_model::Policy::load(ckpt.to_str().unwrap(), &candle_core::Device::Cpu).unwrap();
        }
    }
    assert!(
        kills >= 10 && kills_with_checkpoint >= 5,
        "{kills} kills, {kills_with_checkpoint} after the first checkpoint"
    );
    assert!(spawn(&b).wait().unwrap().success());
    assert_same_checkpoint(&a, &b, STEPS, &format!("after {kills} kills"));
    assert_eq!(metric_steps(&b), (1..=STEPS).collect::<Vec<_>>());
}

/// `dppo run` under a file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: writes past it fail
/// as on a full disk); returns (success, stderr).
fn dppo_with_file_limit(args: &[&str], limit: u64) -> (bool, String) {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dppo"));
    cmd.args(args).env("RUST_LOG", "warn");
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
            let lim = libc::rlimit {
                rlim_cur: limit,
                rlim_max: limit,
            };
            if libc::setrlimit(libc::RLIMIT_FSIZE, &lim) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let out = cmd.output().expect("run dppo");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The steps of the metrics lines in `run`, every line whole JSON.
fn metric_steps(run: &std::path::Path) -> Vec<u64> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect()
}

/// A checkpoint that cannot be written stops the run with an error naming the file; the
/// previous checkpoint and the metrics stay whole.
#[test]
fn a_full_disk_during_a_checkpoint_stops_the_run_and_keeps_the_last_one() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut args = vec!["run", "--resume", "latest", "--out", out.to_str().unwrap()];
    args.extend_from_slice(&SMALL);
    let (ok, _, stderr) = dppo(&[&args[..], &["--set", "steps=2"]].concat());
    assert!(ok, "{stderr}");
    let (ok, stderr) = dppo_with_file_limit(&[&args[..], &["--set", "steps=4"]].concat(), 64 << 10);
    assert!(!ok, "the run went on");
    assert!(
        stderr.contains("checkpointing step 4")
            && stderr.contains(".step-000004.tmp/")
            && stderr.contains("File too large"),
        "{stderr}"
    );
    dppo_trainer::checkpoint::verify(&out.join("checkpoints/step-000002")).unwrap();
    assert!(!out.join("checkpoints/step-000004").exists());
    assert_eq!(metric_steps(&out), [1, 2, 3, 4]);
    // Room again: `resume = "auto"` carries on from step 2.
    let mut args = vec!["run", "--out", out.to_str().unwrap()];
    args.extend_from_slice(&SMALL);
    args.extend_from_slice(&["--set", "steps=4", "--set", "resume=auto"]);
    let (ok, _, stderr) = dppo(&args);
    assert!(ok, "{stderr}");
    assert_eq!(metric_steps(&out), [1, 2, 3, 4]);
    dppo_trainer::checkpoint::verify(&out.join("checkpoints/step-000004")).unwrap();
}

/// A file-size limit above the run's config.toml and below its metrics of a few steps.
const METRICS_LIMIT: u64 = 3000;

/// Metrics that cannot be written stop the run with an error naming the file; the lines
/// written before stay whole (no torn line).
#[test]
fn a_full_disk_for_metrics_stops_the_run_and_keeps_the_lines_written() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut args = vec!["run", "--out", out.to_str().unwrap()];
    args.extend_from_slice(&SMALL);
    args.extend_from_slice(&["--set", "checkpoint.every=0", "--set", "steps=50"]);
    let (ok, stderr) = dppo_with_file_limit(&args, METRICS_LIMIT);
    assert!(!ok, "the run went on");
    let metrics = out.join("metrics.jsonl");
    assert!(
        stderr.contains(&format!("writing metrics to {}", metrics.display()))
            && stderr.contains("File too large"),
        "{stderr}"
    );
    let steps = metric_steps(&out);
    assert!(!steps.is_empty() && steps.len() < 50, "{steps:?}");
    assert_eq!(steps, (1..=steps.len() as u64).collect::<Vec<_>>());
}
