//! The GPU kit on the CPU: `scripts/gpu-kit --from` packs the test binary, and
//! `scripts/gpu-check --dry-run` runs every step with it and records each in summary.json.

use serde_json::{json, Value};

use crate::util::repo_root;

mod summaries;

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

/// `scripts/gpu-check ARGS OUTDIR` with the test binary as the kit's (`DPPO_BIN`).
fn gpu_check(args: &[&str], outdir: &std::path::Path) -> (bool, String) {
    let dppo = std::path::Path::new(env!("CARGO_BIN_EXE_dppo"));
    let mut args = args.to_vec();
    args.push(outdir.to_str().unwrap());
    script("gpu-check", &args, &[("DPPO_BIN", dppo)])
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
    for file in [
        "dppo.xz",
        "gpu-check",
        "gpu-env",
        "gpu_check.py",
        "gpu_profile.py",
        "MANIFEST",
    ] {
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
    let steps = summary_steps(&out);
    let names: Vec<&str> = steps.iter().map(|s| s["name"].as_str().unwrap()).collect();
    let expected = [
        "doctor",
        "doctor-plain",
        "rollout-qwen2.5-0.5b",
        "rollout-qwen2.5-0.5b-fused",
        "rollout-qwen2.5-0.5b-cuda-attn",
        "rollout-qwen2.5-0.5b-untracked",
        "rollout-qwen2.5-0.5b-cuda-graphs",
        "rollout-qwen2.5-0.5b-split-draws",
        "rollout-qwen2.5-0.5b-no-rope-kernel",
        "rollout-qwen2.5-0.5b-no-layer-kernels",
        "rollout-qwen2.5-0.5b-rope-writes-kv",
        "rollout-qwen2.5-0.5b-full",
        "rollout-qwen2.5-0.5b-full-cuda-attn",
        "rollout-qwen2.5-0.5b-timed",
        "rollout-qwen2.5-0.5b-full-timed",
        "baseline",
        "agree",
        "train",
        "rollout-smollm2-135m",
        "rollout-smollm2-135m-no-rope-qk-norm",
        "run",
        "run-sync",
        "rollout-qwen2.5-0.5b-full-exact-noise",
        "sample-b1024",
        "sample-b1024-top-p",
        "sample-b1024-top-k",
    ];
    assert_eq!(names, expected, "{text}");
    for step in &steps {
        // The baseline needs torch and transformers, which CI does not install; the CUDA
        // kernels need a GPU.
        let name = step["name"].as_str().unwrap();
        let gpu_only = name.ends_with("cuda-attn") || name.starts_with("sample-");
        let allowed: &[&str] = if name == "baseline" || gpu_only {
            &["ok", "skipped"]
        } else {
            &["ok"]
        };
        assert!(
            allowed.contains(&step["status"].as_str().unwrap()),
            "{step}\n{text}"
        );
    }
    assert!(ok && text.contains("all steps run passed"), "{text}");
    // The timed rows split the step: the attention's device time is counted.
    for timed in &steps[13..15] {
        let ms = timed["numbers"]["decode_step"]["attention_ms"].as_f64();
        assert!(ms.is_some_and(|ms| ms > 0.0), "{timed}\n{text}");
    }
    let agree = &steps[16]["numbers"]["shapes"]["smollm2-135m"];
    assert_eq!(agree["agreed_tokens"], 8, "{text}");
    assert_eq!(agree["max_logprob_diff"], 0.0, "{text}");
}

/// The `steps` of OUTDIR/summary.json.
fn summary_steps(out: &std::path::Path) -> Vec<Value> {
    let text = std::fs::read_to_string(out.join("summary.json")).unwrap();
    let summary: Value = serde_json::from_str(&text).unwrap();
    summary["steps"].as_array().unwrap().clone()
}

/// The targets' protocol, dppo's side on the attention variant `--attention-kernel` names;
/// with `fastest`, each shape's on the fastest variant of its kernels' bench (skipped on the
/// CPU, so the engine's default, and no kernel runs there to name).
#[test]
fn gpu_check_targets_dry_run_measures_each_target() {
    let shape = "smollm2-135m";
    for (kernel, bench, used) in [("mma", false, json!("mma")), ("fastest", true, Value::Null)] {
        let dir = tempfile::tempdir().unwrap();
        let args = ["--dry-run", "--targets", "--attention-kernel", kernel];
        let (ok, text) = gpu_check(&args, dir.path());
        assert!(ok, "{text}");
        let steps = summary_steps(dir.path());
        let names: Vec<&str> = steps.iter().map(|s| s["name"].as_str().unwrap()).collect();
        let mut expected = ["doctor", "sample-b1024", "sample-b256"]
            .map(String::from)
            .to_vec();
        if bench {
            expected.push(format!("attention-{shape}-b1024"));
        }
        // The decode steps first, then the full rollouts; each dppo row again with graphs. The
        // floor on graphs with split draws, not the protocol's, runs between them.
        expected.extend(
            [
                "floor",
                "graphs-floor",
                "graphs-split-draws-floor",
                "rollout",
                "graphs-rollout",
                "hf",
            ]
            .map(|s| format!("target-{s}-{shape}")),
        );
        expected.extend(
            [
                "split-draws",
                "timed",
                "graphs-rope-writes-kv",
                "untracked",
                "exact-noise",
            ]
            .map(|s| format!("target-{s}-{shape}")),
        );
        assert_eq!(names, expected, "{text}");
        let step = |name: &str| {
            let at = names
                .iter()
                .position(|n| *n == format!("target-{name}-{shape}"));
            steps[at.unwrap()].clone()
        };
        let rollout = &step("rollout")["numbers"];
        assert_eq!(rollout["complete"], true, "{text}");
        // Every dppo row runs the kernel chosen, the rows after the protocol included.
        for name in [
            "floor",
            "graphs-floor",
            "rollout",
            "graphs-rollout",
            "graphs-split-draws-floor",
            "split-draws",
            "timed",
            "graphs-rope-writes-kv",
            "untracked",
            "exact-noise",
        ] {
            let row = step(name);
            assert_eq!(row["status"], "ok", "{name}: {text}");
            assert_eq!(row["numbers"]["attention_kernel"], used, "{name}: {text}");
        }
        assert_eq!(
            step("graphs-floor")["numbers"]["cuda_graphs"],
            true,
            "{text}"
        );
        assert_eq!(step("floor")["numbers"]["cuda_graphs"], false, "{text}");
        // The protocol's rows take lazy noise, the default; the exact-noise row does not.
        assert_eq!(rollout["lazy_noise"], true, "{text}");
        assert_eq!(
            step("exact-noise")["numbers"]["lazy_noise"],
            false,
            "{text}"
        );
        // The targets are the protocol's shape's alone (the rows after it name more than a
        // kind and a shape).
        let text_json = std::fs::read_to_string(dir.path().join("summary.json")).unwrap();
        let summary: Value = serde_json::from_str(&text_json).unwrap();
        let shapes: Vec<&String> = summary["targets"]["shapes"]
            .as_object()
            .unwrap()
            .keys()
            .collect();
        assert_eq!(shapes, [shape], "{text}");
        // The floor is measured on the CPU too; the speed over HF only where torch imports.
        for label in ["", " (cuda graphs)"] {
            let line = format!("target {shape}{label}: decode step");
            assert!(text.contains(&line), "{text}");
        }
        let hf = step("hf");
        if hf["status"] == "ok" {
            // HF's prompts carry dppo's mean prompt length.
            let mean = rollout["prompt_tokens_mean"].as_f64().unwrap();
            assert_eq!(hf["numbers"]["prompt_len"], mean.round(), "{text}");
            let line = format!("target {shape}: dppo (attention kernel {used}) ");
            assert!(text.contains(&line), "{text}");
        } else {
            assert_eq!(hf["status"], "skipped", "{text}");
        }
    }
}

/// `--profile` runs the doctor, the attention kernels alone, the first shape's full rollout on
/// the defaults and through the attention kernel's other variants; on the CPU the kernels'
/// bench and the Nsight Compute steps are skipped, saying why.
#[test]
fn gpu_check_profile_dry_run_runs_the_rollouts_and_skips_the_profiles() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, text) = gpu_check(&["--dry-run", "--profile"], dir.path());
    assert!(ok, "{text}");
    let steps = summary_steps(dir.path());
    let got: Vec<(&str, &str)> = steps
        .iter()
        .map(|s| (s["name"].as_str().unwrap(), s["status"].as_str().unwrap()))
        .collect();
    // Every variant of the attention but the shapes' default, which the target rows run.
    let variants: Vec<String> = dppo_engine::AttentionKernel::VARIANTS
        .iter()
        .filter(|v| **v != dppo_engine::AttentionKernel::TENSOR_CORE)
        .map(|v| format!("variant-smollm2-135m-{v}"))
        .collect();
    let mut want = vec![
        ("doctor", "ok"),
        ("attention-smollm2-135m-b1024", "skipped"),
        ("attention-smollm2-135m-b256", "skipped"),
        ("target-rollout-smollm2-135m", "ok"),
    ];
    want.extend(variants.iter().map(|v| (v.as_str(), "ok")));
    want.extend([
        ("profile-qwen2.5-0.5b-b1024", "skipped"),
        ("profile-qwen2.5-0.5b-b1024-fastest", "skipped"),
        ("profile-qwen2.5-0.5b-b256", "skipped"),
    ]);
    assert_eq!(got, want, "{text}");
}

/// An attention variant is a setting of the targets' protocol only: elsewhere, without a name
/// or with one that is no variant's, gpu-check refuses it with its usage before running
/// anything.
#[test]
fn gpu_check_takes_an_attention_kernel_with_targets_only() {
    let dir = tempfile::tempdir().unwrap();
    for args in [
        &["--dry-run", "--profile", "--attention-kernel", "mma"][..],
        &["--dry-run", "--attention-kernel", "mma"],
        &["--dry-run", "--targets", "--attention-kernel"],
        &["--dry-run", "--targets", "--attention-kernel", "s2_v8"],
    ] {
        let (ok, text) = gpu_check(args, dir.path());
        assert!(
            !ok && text.contains("usage: scripts/gpu-check"),
            "{args:?}: {text}"
        );
        assert!(!dir.path().join("summary.json").exists(), "{args:?}");
    }
}

#[test]
fn gpu_check_with_its_budget_spent_runs_nothing_and_still_summarises() {
    let dir = tempfile::tempdir().unwrap();
    let (ok, text) = gpu_check(&["--dry-run", "--budget", "1"], dir.path());
    assert!(
        ok && text.contains("21 not run, the budget spent"),
        "{text}"
    );
    let steps = summary_steps(dir.path());
    for step in &steps {
        // The CUDA kernels' steps are skipped on the CPU before the budget is looked at.
        let name = step["name"].as_str().unwrap();
        let expected = match name.ends_with("cuda-attn") || name.starts_with("sample-") {
            true => "skipped",
            false => "no_time",
        };
        assert_eq!(step["status"], expected, "{step}\n{text}");
    }
}

/// On a GPU (here: the GPU mode with the CPU binary, every CUDA step failing at once) the
/// steps' files are packed into one archive, since the device tool returns at most 8 files:
/// OUTDIR keeps the summary, the steps' table, the metadata and the archive, and what was
/// there before.
#[test]
fn gpu_check_on_a_gpu_packs_its_steps_files() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("mine.txt"), "not gpu-check's").unwrap();
    let (ok, text) = gpu_check(&["--budget", "60"], dir.path());
    assert!(!ok, "the CUDA steps fail on a CPU build: {text}");
    let mut names: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        [
            "meta.json",
            "mine.txt",
            "steps.tar.gz",
            "steps.tsv",
            "summary.json"
        ],
        "{text}"
    );
    let listing = std::process::Command::new("tar")
        .arg("tzf")
        .arg(dir.path().join("steps.tar.gz"))
        .output()
        .unwrap();
    let listing = String::from_utf8(listing.stdout).unwrap();
    for file in ["doctor.out", "doctor.log", "rollout-qwen2.5-0.5b-timed.log"] {
        assert!(
            listing.lines().any(|l| l.trim_start_matches("./") == file),
            "{file}: {listing}"
        );
    }
    assert_eq!(summary_steps(dir.path()).len(), 28, "{text}");
}
