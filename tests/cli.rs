//! The `dppo` binary end to end: its JSON outputs and its error messages.

use std::process::Command;

use serde_json::Value;

fn dppo(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_dppo"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("run dppo");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
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
