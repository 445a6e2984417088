//! The GPU kit on the CPU: `scripts/gpu-kit --from` packs the test binary, and
//! `scripts/gpu-check --dry-run` runs every step with it and records each in summary.json.

use serde_json::Value;

use crate::util::repo_root;

/// Runs a repository script with extra environment variables; returns success and its output.
fn script(name: &str, args: &[&str], envs: &[(&str, &std::path::Path)]) -> (bool, String) {
    let out = std::process::Command::new(repo_root().join("scripts").join(name))
        .args(args)
        .envs(envs.iter().map(|(k, v)| (k, v.as_os_str())))
        .env("RUST_LOG", "warn")
        .output()
        .expect("run script");
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn gpu_kit_packs_and_dry_run_passes_every_cpu_step() {
    let dir = tempfile::tempdir().unwrap();
    let dppo = std::path::Path::new(env!("CARGO_BIN_EXE_dppo"));
    let kit = dir.path().join("kit");
    let (ok, text) = script(
        "gpu-kit",
        &["--from", dppo.to_str().unwrap()],
        &[("DPPO_KIT", &kit)],
    );
    assert!(ok && text.contains("limit 40 MiB"), "{text}");
    for file in ["dppo.xz", "gpu-check", "gpu_check.py", "MANIFEST"] {
        assert!(
            kit.join(file).is_file(),
            "{file} missing from the kit: {text}"
        );
    }

    let out = dir.path().join("out");
    let (ok, text) = script(
        "gpu-check",
        &["--dry-run", out.to_str().unwrap()],
        &[("DPPO_BIN", dppo), ("DPPO_KIT", &kit)],
    );
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let steps = summary["steps"].as_array().unwrap();
    let names: Vec<&str> = steps.iter().map(|s| s["name"].as_str().unwrap()).collect();
    let expected = [
        "doctor",
        "doctor-plain",
        "agree",
        "rollout-qwen2.5-0.5b",
        "rollout-qwen2.5-0.5b-fused",
        "rollout-qwen2.5-0.5b-full",
        "rollout-qwen2.5-0.5b-cuda-attn",
        "rollout-qwen2.5-0.5b-full-cuda-attn",
        "rollout-smollm2-135m",
        "train",
        "baseline",
        "run",
        "run-sync",
    ];
    assert_eq!(names, expected, "{text}");
    for step in steps {
        let status = step["status"].as_str().unwrap();
        // The baseline needs torch and transformers, which CI does not install; the CUDA
        // kernels need a GPU.
        let name = step["name"].as_str().unwrap();
        let allowed: &[&str] = if name == "baseline" || name.ends_with("cuda-attn") {
            &["ok", "skipped"]
        } else {
            &["ok"]
        };
        assert!(allowed.contains(&status), "{step}\n{text}");
    }
    assert!(ok && text.contains("all steps passed"), "{text}");
    let agree = &steps[2]["numbers"]["shapes"]["smollm2-135m"];
    assert_eq!(agree["agreed_tokens"], 8, "{text}");
    assert_eq!(agree["max_logprob_diff"], 0.0, "{text}");
}
