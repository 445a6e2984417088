//! The `dppo` binary end to end: its JSON outputs and its error messages.

use std::process::Command;

use serde_json::Value;

/// Runs `dppo`; returns whether it succeeded, its stdout and its stderr.
fn dppo(args: &[&str]) -> (bool, String, String) {
    let (code, stdout, stderr) = crate::util::run_dppo(args);
    (code == Some(0), stdout, stderr)
}

#[test]
fn generate_json_prints_one_object_per_sample() {
    let (ok, stdout, stderr) = dppo(&[
        "generate",
        "--model",
        "builtin:tiny",
        "--prompt",
        "What is 2+3?",
        "--chat",
        "--n",
        "3",
        "--max-tokens",
        "5",
        "--temperature",
        "0",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let lines: Vec<Value> = stdout
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(line["sample_index"], i);
        let ids = line["token_ids"].as_array().unwrap();
        assert!(!ids.is_empty() && ids.len() <= 5);
        assert_eq!(line["logprobs"].as_array().unwrap().len(), ids.len());
        assert!(line["text"].is_string());
        assert!(["stop", "length"].contains(&line["finish_reason"].as_str().unwrap()));
        assert_eq!(line["policy_version"], 0);
        // Greedy: every sample of the group is the same.
        assert_eq!(line["token_ids"], lines[0]["token_ids"]);
    }
}

#[test]
fn generate_rejects_bad_input_clearly() {
    let (ok, _, stderr) = dppo(&["generate", "--prompt", "hi", "--n", "0"]);
    assert!(!ok && stderr.contains("n must be between 1"), "{stderr}");
    let (ok, _, stderr) = dppo(&["generate", "--prompt", "hi", "--top-p", "1.5"]);
    assert!(!ok && stderr.contains("top_p"), "{stderr}");
    let long = "1".repeat(600);
    let (ok, _, stderr) = dppo(&["generate", "--prompt", &long]);
    assert!(
        !ok && stderr.contains("exceeds the model's context"),
        "{stderr}"
    );
    let (ok, _, stderr) = dppo(&["generate", "--model", "/no/such/model", "--prompt", "hi"]);
    assert!(!ok && stderr.contains("/no/such/model"), "{stderr}");
}

/// A random-weight model of a real shape by spec alone: the same seed generates the same
/// tokens, another seed others; an unknown shape is an error listing the known ones.
#[test]
fn generate_runs_a_random_weight_shape_from_its_spec() {
    let greedy = |spec: &str| {
        let (ok, stdout, stderr) = dppo(&[
            "generate",
            "--model",
            spec,
            "--prompt",
            "What is 2+3?",
            "--chat",
            "--max-tokens",
            "4",
            "--temperature",
            "0",
            "--json",
        ]);
        assert!(ok, "{stderr}");
        let line: Value = serde_json::from_str(stdout.trim()).unwrap();
        assert_eq!(line["token_ids"].as_array().unwrap().len(), 4, "{line}");
        line["token_ids"].clone()
    };
    let seven = greedy("random:smollm2-135m@seed=7");
    assert_eq!(greedy("random:smollm2-135m@seed=7"), seven);
    assert_ne!(greedy("random:smollm2-135m"), seven);
    let (ok, _, stderr) = dppo(&["generate", "--model", "random:llama-7b", "--prompt", "hi"]);
    assert!(
        !ok && stderr.contains("random:llama-7b") && stderr.contains("qwen2.5-0.5b"),
        "{stderr}"
    );
}

#[test]
fn bench_rollout_json_reports_both_engines() {
    let (ok, stdout, stderr) = dppo(&[
        "bench",
        "rollout",
        "--prompts",
        "2",
        "--samples",
        "2",
        "--new-tokens",
        "4",
        "--json",
    ]);
    assert!(ok, "{stderr}");
    let report: Value = serde_json::from_str(stdout.trim()).unwrap();
    for key in [
        "tokens_per_s",
        "naive_tokens_per_s",
        "speedup_vs_naive",
        "fraction_of_compute_limit",
    ] {
        assert!(report[key].as_f64().unwrap() > 0.0, "{key} in {report}");
    }
    assert!(report["peak_kv_mib"].as_f64().unwrap() > 0.0);
}

/// `dppo run` end to end: it prints the accuracy table and writes the run directory.
#[test]
fn run_prints_the_accuracy_table_and_writes_the_run_directory() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut args = vec!["run", "--out", out.to_str().unwrap(), "--set", "steps=2"];
    args.extend_from_slice(&SMALL);
    let (ok, stdout, stderr) = dppo(&args);
    assert!(ok, "{stderr}");
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let percent = |key: &str| format!("{:.1}%", 100.0 * summary[key].as_f64().unwrap());
    let table = format!(
        "\n| held-out accuracy | before RL | after RL |\n|---|---|---|\n| builtin:tiny | {} | {} |\n\
         run directory: {}\n",
        percent("eval_before"),
        percent("eval_after"),
        out.display()
    );
    assert!(stdout.ends_with(&table), "{stdout}");
    assert_eq!(summary["steps"], 2);
    for file in ["metrics.jsonl", "metrics.svg", "config.toml"] {
        assert!(out.join(file).is_file(), "{file} missing");
    }
    dppo_trainer::checkpoint::verify(&out.join("checkpoints/step-000002")).unwrap();
}

/// `dppo score` on a hand-written samples file: agreement with the saved rewards, the
/// rules that extracted the answers, and broken lines named by file and line.
#[test]
fn score_rescores_saved_samples_and_names_broken_lines() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("samples.jsonl");
    let sample = |text: &str, reward: f64, truncated: bool| serde_json::json!({"text": text, "reward": reward, "truncated": truncated});
    let rows = [
        serde_json::json!({"answer": "284", "samples": [
            // Issue 21's false positive: saved as correct, cut off by the token limit.
            sample("So, the final answer is 84.\n```python\n# 284", 1.0, true),
            sample("so \\boxed{284}", 1.0, false),
        ]}),
        serde_json::json!({"answer": "\\frac{1}{2}", "samples": [
            sample("\\boxed{0.5}", 1.0, false),
            sample("#### 1/2\n", 0.0, false),
        ]}),
    ];
    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(&path, text).unwrap();
    let score = |mode: &str, extra: &[&str]| -> Value {
        let mut args = vec!["score", "--data", path.to_str().unwrap(), "--extract", mode];
        args.extend_from_slice(extra);
        let (ok, stdout, stderr) = dppo(&args);
        assert!(ok, "{stderr}");
        serde_json::from_str(stdout.trim()).unwrap()
    };
    let strict = score("strict", &[]);
    assert_eq!(
        (
            &strict["samples"],
            &strict["disagreements"],
            &strict["accuracy"]
        ),
        (&Value::from(4), &Value::from(2), &Value::from(0.75)),
        "{strict}"
    );
    assert_eq!(strict["extracted_by"]["none"], 1, "{strict}");
    assert_eq!(strict["extracted_by"]["hashes"], 1, "{strict}");
    let rescored = dir.path().join("boxed.jsonl");
    let boxed = score("boxed", &["--out", rescored.to_str().unwrap()]);
    assert_eq!(boxed["accuracy"], 0.5, "{boxed}");
    let first: Value = serde_json::from_str(
        std::fs::read_to_string(&rescored)
            .unwrap()
            .lines()
            .next()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(first["samples"][0]["reward"], 0.0);
    assert_eq!(first["samples"][0]["extracted_by"], "none");
    assert_eq!(first["samples"][1]["extracted_by"], "boxed");
    std::fs::write(
        &path,
        "{\"answer\": \"3\", \"samples\": [{\"text\": \"3\", \"reward\": 1}]}\n",
    )
    .unwrap();
    let (ok, _, stderr) = dppo(&["score", "--data", path.to_str().unwrap()]);
    assert!(
        !ok && stderr.contains("samples.jsonl:1: sample 0 lacks \"truncated\""),
        "{stderr}"
    );
    let (ok, _, stderr) = dppo(&["score", "--data", "x.jsonl", "--extract", "loose"]);
    assert!(
        !ok && stderr.contains("unknown extraction mode \"loose\""),
        "{stderr}"
    );
}

#[test]
fn run_rejects_bad_configs_naming_the_key() {
    let (ok, _, stderr) = dppo(&["run", "--set", "dppo.r_o=1"]);
    assert!(!ok && stderr.contains("dppo.r_o"), "{stderr}");
    let (ok, _, stderr) = dppo(&["run", "--set", "rollout.nn=3"]);
    assert!(
        !ok && stderr.contains("--set rollout.nn=3: unknown key rollout.nn"),
        "{stderr}"
    );
    assert!(!stderr.contains("configs/default.toml"), "{stderr}");
    for (devices, want) in [
        ("devices=[\"cuda:1\", \"cuda:1\"]", "lists a GPU twice"),
        ("devices=[\"cpu\", \"cuda:1\"]", "mixes cpu and cuda ranks"),
        (
            "devices=[\"tpu\"]",
            "invalid value for devices: got [\"tpu\"]",
        ),
        ("rank_timeout_s=0", "rank_timeout_s"),
    ] {
        let (ok, _, stderr) = dppo(&["run", "--set", devices]);
        assert!(!ok && stderr.contains(want), "{devices}: {stderr}");
    }
    let (ok, _, stderr) = dppo(&["run", "--device", "cpu", "--devices", "cpu,cpu"]);
    assert!(!ok && stderr.contains("cannot be used with"), "{stderr}");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run").to_str().unwrap().to_string();
    let (ok, _, stderr) = dppo(&["run", "--set", "pack.tokens=16", "--out", &out]);
    assert!(
        !ok && stderr.contains("pack.tokens = 16 is smaller than the longest prompt"),
        "{stderr}"
    );
}

#[test]
fn compare_tables_and_plots_runs_and_names_a_bad_one() {
    let dir = tempfile::tempdir().unwrap();
    let run = |name: &str, algorithm: &str| {
        let out = dir.path().join(name);
        let algorithm = format!("algorithm={algorithm}");
        crate::run::small_run(&out, &[&algorithm, "steps=3", "eval.every=1"]);
        out.to_str().unwrap().to_string()
    };
    let (grpo, dppo_run) = (run("grpo-run", "grpo"), run("dppo-run", "dppo"));
    let svg = dir.path().join("cmp.svg");
    let svg_arg = svg.to_str().unwrap();
    let (ok, stdout, stderr) = dppo(&["compare", &grpo, &dppo_run, "--svg", svg_arg]);
    assert!(ok, "{stderr}");
    assert!(
        stdout.starts_with("Targets: grpo-run's last evaluation"),
        "{stdout}"
    );
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("| ") && !l.starts_with("| run |"))
        .collect();
    assert_eq!(rows.len(), 2, "{stdout}");
    // The baseline's speed-up against itself is 1.
    assert!(rows[0].starts_with("| grpo-run | grpo | "), "{stdout}");
    assert!(rows[0].contains(" | 1.00x | "), "{stdout}");
    assert!(rows[1].starts_with("| dppo-run | dppo | "), "{stdout}");
    let svg = std::fs::read_to_string(&svg).unwrap();
    // Accuracy and reward against RL time and step: four series per run.
    assert_eq!(svg.matches("<polyline").count(), 8);
    assert!(svg.contains(">grpo-run</text>") && svg.contains(">dppo-run</text>"));
    let empty = dir.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    let (ok, _, stderr) = dppo(&["compare", &grpo, empty.to_str().unwrap()]);
    let missing = empty.join("metrics.jsonl");
    assert!(
        !ok && stderr.contains(missing.to_str().unwrap()),
        "{stderr}"
    );
    // The I/O error is said once, not again as the error's source.
    assert_eq!(stderr.matches("No such file").count(), 1, "{stderr}");
}

/// Small, fast run settings for the binary.
const SMALL: [&str; 12] = [
    "--set",
    "warmup.steps=2",
    "--set",
    "data.num_train=64",
    "--set",
    "data.num_eval=8",
    "--set",
    "rollout.prompts_per_step=4",
    "--set",
    "checkpoint.every=2",
    "--set",
    "checkpoint.keep=5",
];

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
    for file in ["model/model.safetensors", "optimizer.safetensors"] {
        let x = std::fs::read(a.join("checkpoints/step-000004").join(file)).unwrap();
        let y = std::fs::read(b.join("checkpoints/step-000004").join(file)).unwrap();
        assert!(
            x == y,
            "{file} differs between the uninterrupted and the resumed run"
        );
    }
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

/// `dppo run --serve`: clients hammering the server while it trains see the policy versions
/// advance, and the trained weights equal those of a run without a server.
#[test]
fn serving_during_training_leaves_the_trained_weights_unchanged() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let extra = ["--set", "steps=4", "--set", "actor.beta=0.1"];
    let mut args = vec!["run", "--out", a.to_str().unwrap()];
    args.extend_from_slice(&SMALL);
    args.extend_from_slice(&extra);
    let (ok, _, stderr) = dppo(&args);
    assert!(ok, "{stderr}");

    let mut args = vec!["run", "--out", b.to_str().unwrap()];
    args.extend_from_slice(&SMALL);
    args.extend_from_slice(&extra);
    args.extend_from_slice(&["--serve", "127.0.0.1:0", "--served-model-name", "live"]);
    let mut child = crate::server::Child::start(&args);
    let addr = child.addr;
    let stop = Arc::new(AtomicBool::new(false));
    let versions = Arc::new(Mutex::new(std::collections::BTreeSet::new()));
    let clients: Vec<_> = (0..4)
        .map(|i| {
            let (stop, versions) = (stop.clone(), versions.clone());
            std::thread::spawn(move || {
                let mut answered = 0;
                while !stop.load(Ordering::SeqCst) {
                    let body = serde_json::json!({"model": "live", "prompt": "What is 12+34?",
                        "n": 2, "max_tokens": 8, "stream": i % 2 == 0});
                    let Ok(r) = crate::http::try_request(
                        addr,
                        "POST",
                        "/v1/completions",
                        Some(&body.to_string()),
                    ) else {
                        break; // the run ended and took the server with it
                    };
                    if r.status != 200 {
                        // 503 while the server shuts down; anything else is a failure.
                        assert_eq!(r.status, 503, "{}", r.body);
                        break;
                    }
                    let chunks = if i % 2 == 0 {
                        r.sse()
                    } else {
                        vec![r.body.clone()]
                    };
                    for c in chunks.iter().filter(|c| c.starts_with('{')) {
                        // (A stream cut by the shutdown ends with an error object.)
                        let v: Value = serde_json::from_str(c).unwrap();
                        for version in v["policy_versions"].as_array().into_iter().flatten() {
                            versions.lock().unwrap().insert(version.as_u64().unwrap());
                        }
                    }
                    answered += 1;
                }
                answered
            })
        })
        .collect();
    child.wait_success(600);
    stop.store(true, Ordering::SeqCst);
    let answered: usize = clients.into_iter().map(|c| c.join().unwrap()).sum();
    assert!(answered > 0, "no request was answered during training");
    let seen = versions.lock().unwrap().clone();
    assert!(
        seen.len() >= 2,
        "responses should span policy versions, saw {seen:?}"
    );
    for file in ["model/model.safetensors", "optimizer.safetensors"] {
        let x = std::fs::read(a.join("checkpoints/step-000004").join(file)).unwrap();
        let y = std::fs::read(b.join("checkpoints/step-000004").join(file)).unwrap();
        assert!(x == y, "{file}: serving changed the trained weights");
    }
}

/// Ctrl-C during `dppo run --serve` ends training after the current step, with a
/// checkpoint of that step and a summary, and exits cleanly.
#[test]
fn ctrl_c_stops_a_serving_run_after_the_current_step() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut args = vec!["run", "--out", out.to_str().unwrap()];
    args.extend_from_slice(&SMALL);
    args.extend_from_slice(&["--set", "steps=100000", "--serve", "127.0.0.1:0"]);
    let child = crate::server::Child::start(&args);
    let metrics = out.join("metrics.jsonl");
    let start = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |m| m.lines().count()) < 2 {
        assert!(start.elapsed().as_secs() < 120, "training did not start");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.interrupt(120);
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let steps = summary["steps"].as_u64().unwrap();
    assert!((2..100000).contains(&steps), "{summary}");
    let ckpt = out.join(format!(
        "checkpoints/step-{steps:06}/model/model.safetensors"
    ));
    assert!(
        ckpt.exists(),
        "no checkpoint of the last step at {}",
        ckpt.display()
    );
    let lines = std::fs::read_to_string(&metrics).unwrap().lines().count() as u64;
    assert_eq!(lines, steps, "one metrics line per finished step");
}

/// `dppo serve` reads its API key from `DPPO_API_KEY`, and warns when it listens beyond
/// loopback without one.
#[test]
fn serve_takes_the_api_key_from_the_environment_and_warns_without_one() {
    use std::io::{BufRead, Read};
    let serve = |key: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dppo"));
        cmd.args(["serve", "--model", "builtin:tiny", "--addr", "0.0.0.0:0"])
            .env("RUST_LOG", "warn")
            .env_remove("DPPO_API_KEY")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        if let Some(key) = key {
            cmd.env("DPPO_API_KEY", key);
        }
        let mut child = cmd.spawn().expect("start dppo serve");
        let stdout = child.stdout.take().unwrap();
        let mut lines = std::io::BufReader::new(stdout).lines().map(Result::unwrap);
        let line = lines
            .find(|l| l.starts_with("listening on http://"))
            .expect("dppo exited before listening");
        std::thread::spawn(move || lines.for_each(drop));
        let port: u16 = line.rsplit(':').next().unwrap().trim().parse().unwrap();
        let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
        let status = |headers: &[(&str, &str)]| {
            crate::http::request_with(addr, "GET", "/v1/models", None, headers).status
        };
        let statuses = (status(&[]), status(&[("Authorization", "Bearer sk-env")]));
        let pid = child.id().to_string();
        let sent = Command::new("kill").args(["-INT", &pid]).status().unwrap();
        assert!(sent.success());
        assert!(child.wait().unwrap().success());
        let mut stderr = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        (statuses, stderr)
    };
    let (statuses, stderr) = serve(Some("sk-env"));
    assert_eq!(statuses, (401, 200));
    assert!(!stderr.contains("without an API key"), "{stderr}");
    let (statuses, stderr) = serve(None);
    assert_eq!(statuses, (200, 200));
    assert!(stderr.contains("without an API key"), "{stderr}");
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
    let last = format!("checkpoints/step-{STEPS:06}");
    for file in ["model/model.safetensors", "optimizer.safetensors"] {
        let x = std::fs::read(a.join(&last).join(file)).unwrap();
        let y = std::fs::read(b.join(&last).join(file)).unwrap();
        assert!(x == y, "{file} differs after {kills} kills");
    }
    let steps: Vec<u64> = std::fs::read_to_string(b.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(steps, (1..=STEPS).collect::<Vec<_>>());
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
