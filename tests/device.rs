//! `--device` and the `device` key through the binary: a CUDA device on a build without the
//! `cuda` feature, or on a machine without a usable GPU, fails at once with exit status 2 and
//! a message saying which.

/// Runs dppo; returns its exit code and stderr.
fn dppo(args: &[&str]) -> (Option<i32>, String) {
    let (code, _, stderr) = crate::util::run_dppo(args);
    (code, stderr)
}

/// Every command that takes `--device`, asking for `device`.
fn every_command(device: &str, out: &str) -> Vec<Vec<String>> {
    let cmds: [&[&str]; 9] = [
        &["generate", "--prompt", "hi", "--device", device],
        &[
            "eval",
            "--model",
            "builtin:tiny",
            "--data",
            "builtin:arithmetic",
            "--device",
            device,
        ],
        &[
            "serve",
            "--model",
            "builtin:tiny",
            "--addr",
            "127.0.0.1:0",
            "--device",
            device,
        ],
        &["bench", "rollout", "--skip-naive", "--device", device],
        &["bench", "train", "--device", device],
        &["bench", "sample", "--device", device],
        &["run", "--out", out, "--device", device],
        &["run", "--out", out, "--set", &format!("device={device}")],
        // The flag wins over the key.
        &[
            "run",
            "--out",
            out,
            "--set",
            "device=cpu",
            "--device",
            device,
        ],
    ];
    cmds.iter()
        .map(|c| c.iter().map(|s| s.to_string()).collect())
        .collect()
}

#[cfg(not(feature = "cuda"))]
#[test]
fn a_cpu_build_asked_for_cuda_fails_at_once_naming_the_feature() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    for device in ["cuda", "cuda:1"] {
        for args in every_command(device, out.to_str().unwrap()) {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let (code, stderr) = dppo(&args);
            assert_eq!(code, Some(2), "{args:?}: {stderr}");
            assert!(
                stderr.contains(&format!(
                    "device {device}: this dppo was built without the `cuda` cargo feature"
                )) && stderr.contains("cargo build --release --features cuda"),
                "{args:?}: {stderr}"
            );
        }
    }
    // Before anything is written.
    assert!(!out.exists(), "the run directory was created");
}

#[cfg(feature = "cuda")]
#[test]
fn a_cuda_build_without_a_usable_gpu_says_so() {
    if candle_core::Device::new_cuda(0).is_ok() {
        eprintln!("skipped: a GPU is present, so `--device cuda` opens");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    for args in every_command("cuda", out.to_str().unwrap()) {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, stderr) = dppo(&args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains("device cuda: no usable CUDA GPU"),
            "{args:?}: {stderr}"
        );
    }
    assert!(!out.exists(), "the run directory was created");
}

#[test]
fn a_device_that_is_no_device_is_rejected_naming_the_forms() {
    let (code, stderr) = dppo(&["generate", "--prompt", "hi", "--device", "gpu"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("expected cpu, cuda or cuda:N"), "{stderr}");
    let (code, stderr) = dppo(&["run", "--set", "device=cuda:x"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("allowed: cpu | cuda | cuda:N"), "{stderr}");
}

#[test]
fn device_cpu_generates_and_a_config_may_name_cuda() {
    let (code, stderr) = dppo(&[
        "generate",
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
        "--device",
        "cpu",
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    let (code, stderr) = dppo(&["config", "--set", "device=cuda:1"]);
    assert_eq!(code, Some(0), "{stderr}");
}
