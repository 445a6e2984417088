//! `dppo doctor` on the CPU build, and `dppo bench train --compute-dtype`.

use serde_json::Value;

/// Runs `dppo`; returns its exit code, stdout and stderr.
fn dppo(args: &[&str]) -> (Option<i32>, String, String) {
    crate::util::run_dppo(args)
}

/// The CPU build checks the CPU against itself (equal results expected), says it has no
/// CUDA and passes.
#[cfg(not(feature = "cuda"))]
#[test]
fn doctor_on_the_cpu_build_says_it_has_no_cuda_and_passes() {
    let (code, stdout, stderr) = dppo(&["doctor"]);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("this build has no CUDA (build with --features cuda)"),
        "{stdout}"
    );
    for line in [
        "greedy f32",
        "greedy bf16",
        "learner f32",
        "learner bf16",
        "kv freed",
        "rollout",
    ] {
        assert!(stdout.contains(line), "{line} missing:\n{stdout}");
    }
    assert!(!stdout.contains("FAIL"), "{stdout}");
    let last = stdout.lines().last().unwrap();
    assert!(last.starts_with("doctor: OK ("), "{last}");
}

/// `--full` adds the GPU tests' checks (tests/gpu.rs runs them on a GPU): preemption with
/// small blocks, every gradient, AdamW's state; on the CPU each is exact and passes.
#[test]
fn doctor_full_adds_the_gpu_tests_checks_and_passes_on_the_cpu() {
    let (code, stdout, stderr) = dppo(&["doctor", "--full"]);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    for line in [
        "preemption f32: block size 4",
        "gradients f32",
        "adamw f32",
        "adamw bf16",
        "hand-offs",
    ] {
        assert!(
            stdout.contains(&format!("device  ok   {line}")),
            "{line}:\n{stdout}"
        );
    }
    assert!(!stdout.contains(" 0 preemptions"), "{stdout}");
}

/// A GPU asked of the CPU build fails, naming the device and the build command.
#[cfg(not(feature = "cuda"))]
#[test]
fn doctor_on_cuda_fails_clearly_in_the_cpu_build() {
    let (code, stdout, stderr) = dppo(&["doctor", "--device", "cuda"]);
    assert_ne!(code, Some(0), "{stdout}");
    let last = stdout.lines().last().unwrap();
    assert!(
        last.starts_with("doctor: FAILED: device open cuda"),
        "{last}"
    );
    assert!(last.contains("--features cuda"), "{last}");
    assert!(stderr.contains("doctor: FAILED"), "{stderr}");
}

/// `--json` is one object with every section, a verdict and a flag.
#[test]
fn doctor_json_has_every_section_and_the_verdict() {
    let (code, stdout, stderr) = dppo(&["doctor", "--device", "cpu", "--json"]);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    let report: Value = serde_json::from_str(stdout.trim()).unwrap();
    let names: Vec<&str> = report["sections"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["build", "cuda", "device"]);
    assert_eq!(report["passed"], true);
    assert!(report["verdict"]
        .as_str()
        .unwrap()
        .starts_with("doctor: OK"));
    let device = &report["sections"][2]["checks"];
    let greedy = device
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "greedy f32")
        .unwrap();
    assert_eq!(greedy["status"], "ok");
    assert!(
        greedy["detail"].as_str().unwrap().contains("(equal)"),
        "{greedy}"
    );
}

/// `bench train` computes in the dtype asked for (f32 by default on the CPU).
#[test]
fn bench_train_takes_a_compute_dtype() {
    let args = [
        "bench",
        "train",
        "--seqs",
        "2",
        "--prompt-len",
        "4",
        "--completion-len",
        "4",
    ];
    for (extra, want) in [(None, "f32"), (Some("bf16"), "bf16"), (Some("f32"), "f32")] {
        let mut args = args.to_vec();
        if let Some(dtype) = extra {
            args.extend(["--compute-dtype", dtype]);
        }
        args.extend(["--steps", "1", "--json"]);
        let (code, stdout, stderr) = dppo(&args);
        assert_eq!(code, Some(0), "{stderr}");
        let report: Value = serde_json::from_str(stdout.trim()).unwrap();
        assert_eq!(report["compute_dtype"], want);
        assert!(report["train_tokens_per_s"].as_f64().unwrap() > 0.0);
    }
    let (code, _, stderr) = dppo(&["bench", "train", "--compute-dtype", "f16"]);
    assert_ne!(code, Some(0));
    assert!(stderr.contains("expected f32 or bf16"), "{stderr}");
}
