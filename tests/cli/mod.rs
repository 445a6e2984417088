//! The `dppo` binary end to end: its JSON outputs and its error messages.

use serde_json::Value;

mod resume;
mod serve;

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

/// `bench sample` on the CPU times the kernel's host reference: a row for each spread and
/// kernel (the exact noise, lazy noise, split draws), their tokens the exact noise's.
#[test]
fn bench_sample_json_reports_each_spread_and_kernel() {
    let (ok, stdout, stderr) = dppo(&[
        "bench", "sample", "--device", "cpu", "--rows", "4", "--vocab", "3000", "--std", "0.3,12",
        "--iters", "1", "--json",
    ]);
    assert!(ok, "{stderr}");
    let report: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(report["on_device"], false, "{report}");
    let results = report["results"].as_array().unwrap();
    let settings: Vec<(f64, &str, bool)> = results
        .iter()
        .map(|r| {
            let noise = r["noise"].as_str().unwrap();
            (r["std"].as_f64().unwrap(), noise, r["split"] == true)
        })
        .collect();
    assert_eq!(
        settings,
        [
            (0.3, "exact", false),
            (0.3, "lazy", false),
            (0.3, "lazy", true),
            (12.0, "exact", false),
            (12.0, "lazy", false),
            (12.0, "lazy", true)
        ]
    );
    // (On the CPU every kernel draws through the host reference, so their tokens are the
    // same by construction; a GPU compares the kernel's.)
    for r in results {
        assert!(r["us_per_call"].as_f64().unwrap() > 0.0, "{r}");
    }
    let (ok, _, stderr) = dppo(&["bench", "sample", "--device", "cpu", "--std", "0"]);
    assert!(!ok && stderr.contains("--std"), "{stderr}");
    // Truncated draws: every draw takes the top-p and top-k asked.
    let (ok, stdout, stderr) = dppo(&[
        "bench", "sample", "--device", "cpu", "--rows", "2", "--vocab", "3000", "--std", "3",
        "--iters", "1", "--top-p", "0.9", "--top-k", "20", "--json",
    ]);
    assert!(ok, "{stderr}");
    let report: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(
        (report["top_p"].as_f64(), report["top_k"].as_u64()),
        (Some(0.9f32 as f64), Some(20))
    );
    let (ok, _, stderr) = dppo(&["bench", "sample", "--device", "cpu", "--top-p", "0"]);
    assert!(!ok && stderr.contains("--top-p"), "{stderr}");
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
    // Both prompts prefill in the first iteration; every later one decodes all 4 samples.
    let floor = &report["memory_floor"];
    assert_eq!(floor["batch"], 4.0, "{report}");
    assert_eq!(report["decode_step"]["seqs"], 4.0, "{report}");
    for key in [
        "bandwidth_gb_per_s",
        "weight_mib",
        "kv_mib",
        "floor_ms",
        "step_ms",
    ] {
        assert!(floor[key].as_f64().unwrap() > 0.0, "{key} in {report}");
    }
    let ratio = floor["step_ms"].as_f64().unwrap() / floor["floor_ms"].as_f64().unwrap();
    let times = floor["times_floor"].as_f64().unwrap();
    assert!((times / ratio - 1.0).abs() < 1e-9, "{report}");
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
    // Without --extract: the mode of the data set the rows name, as `dppo eval` chose it
    // (`Answer: N` for the built-in task, which strict reads as no answer).
    let builtin = dir.path().join("builtin.jsonl");
    let row = serde_json::json!({"answer": "95", "data_source": "builtin:arithmetic",
        "samples": [sample("Answer: 95", 1.0, false)]});
    std::fs::write(&builtin, format!("{row}\n")).unwrap();
    let (ok, stdout, stderr) = dppo(&["score", "--data", builtin.to_str().unwrap()]);
    assert!(ok, "{stderr}");
    let got: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(
        (&got["extract"], &got["accuracy"]),
        (&Value::from("answer"), &Value::from(1.0)),
        "{got}"
    );
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
    // builtin:tiny's context is 512 tokens: found before the warm-up, naming the key.
    let sets = [
        "--set",
        "rollout.max_response_len=1000",
        "--set",
        "pack.tokens=2048",
    ];
    let (ok, _, stderr) = dppo(&[&["run", "--out", &out][..], &sets].concat());
    assert!(
        !ok && stderr.contains("rollout.max_response_len = 1000 with the longest prompt")
            && stderr.contains("over the model's context of 512; set rollout.max_response_len <="),
        "{stderr}"
    );
    assert!(!stderr.contains("warm-up"), "{stderr}");
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
