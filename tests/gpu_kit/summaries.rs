//! `scripts/gpu_check.py`'s summaries of a GPU run's outputs: the profile's kernels by group,
//! the benches' table cells, the fastest attention variant.

use serde_json::Value;

use crate::util::repo_root;

/// Runs `scripts/gpu_check.py ARGS`; returns whether it succeeded, its stdout and its stderr.
fn gpu_check_py<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> (bool, String, String) {
    let out = std::process::Command::new("python3")
        .arg(repo_root().join("scripts/gpu_check.py"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `gpu_check.brief(gpu_check.key_numbers(STEP, OUT, '.'))`: a step's cell in the table.
fn brief(step: &str, out: &str) -> String {
    let code = format!(
        "import sys; sys.path.insert(0, 'scripts'); import gpu_check as g; \
         print(g.brief(g.key_numbers({step:?}, {out:?}, '.')))"
    );
    let run = std::process::Command::new("python3")
        .current_dir(repo_root())
        .args(["-c", &code])
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    String::from_utf8_lossy(&run.stdout).trim().to_string()
}

/// `gpu_check.py profile` runs the rollout under Nsight Compute (here a stand-in that runs
/// the command and exports a fixed launch list in ncu's raw-page CSV, units row included) and
/// averages the iterations between the last sampling kernels: per step, device time, launches,
/// groups and kernels, largest first; times scaled by the units row.
#[test]
fn gpu_check_profile_averages_the_last_steps_by_kernel() {
    let dir = tempfile::tempdir().unwrap();
    let csv = dir.path().join("launches.csv");
    let row = |id: usize, name: &str, t: &str| {
        format!("\"{id}\",\"1\",\"dppo\",\"h\",\"{name}\",\"1\",\"7\",\"(128, 1, 1)\",\"(4, 1, 1)\",\"0\",\"9.0\",\"{t}\"\n")
    };
    let mut text = String::from(
        "\"ID\",\"Process ID\",\"Process Name\",\"Host Name\",\"Kernel Name\",\"Context\",\
         \"Stream\",\"Block Size\",\"Grid Size\",\"Device\",\"CC\",\"gpu__time_duration.sum\"\n\
         \"\",\"\",\"\",\"\",\"\",\"\",\"\",\"\",\"\",\"\",\"\",\"usecond\"\n",
    );
    // A prefill iteration, then three decode steps: the last three iterations are averaged.
    let launches = [
        ("ucopy_bf16", "9"),
        ("gumbel_sample_bf16", "1"),
        ("nvjet_tst_128x64", "3"),
        ("paged_attention_bf16", "2"),
        ("gumbel_sample_bf16", "1"),
        ("nvjet_tst_128x64", "5"),
        ("paged_attention_bf16", "4"),
        ("gumbel_sample_bf16", "1"),
        ("nvjet_tst_128x64", "1,000"),
        ("gumbel_sample_bf16", "1"),
    ];
    for (id, (name, t)) in launches.iter().enumerate() {
        text += &row(id, name, t);
    }
    std::fs::write(&csv, text).unwrap();
    let ncu = dir.path().join("ncu");
    std::fs::write(
        &ncu,
        format!(
            "#!/usr/bin/env bash\n\
             if [[ $1 == --import ]]; then cat {}; exit 0; fi\n\
             while [[ $# -gt 0 && $1 != -- ]]; do [[ $1 == -o ]] && out=$2; shift; done\n\
             shift; touch \"$out.ncu-rep\"; exec \"$@\"\n",
            csv.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&ncu, std::fs::Permissions::from_mode(0o755)).unwrap();
    let dppo = env!("CARGO_BIN_EXE_dppo");
    let (ok, stdout, stderr) = gpu_check_py(&[
        "profile",
        ncu.to_str().unwrap(),
        dppo,
        dir.path().to_str().unwrap(),
        "p",
        "--launch-skip",
        "5",
        "--launch-count",
        "100",
        "--",
        "--skip-naive",
        "--prompts",
        "1",
        "--samples",
        "1",
        "--new-tokens",
        "2",
        "--warmup-runs",
        "0",
    ]);
    assert!(ok, "{stderr}");
    // The rollout ran (its JSON goes to stderr, the profile's to stdout).
    assert!(stderr.contains("tokens_per_s"), "{stderr}");
    let got: Value = serde_json::from_str(&stdout).unwrap();
    assert_eq!(got["steps"], 3, "{got}");
    // (3 + 2 + 1) + (5 + 4 + 1) + (1000 + 1) us over three steps.
    let ms = |v: &Value| v.as_f64().unwrap();
    assert!(
        (ms(&got["step_device_ms"]) - 1.017 / 3.0).abs() < 1e-9,
        "{got}"
    );
    assert!(
        (ms(&got["launches_per_step"]) - 8.0 / 3.0).abs() < 1e-9,
        "{got}"
    );
    assert!(
        (ms(&got["groups_ms"]["gemm"]) - 1.008 / 3.0).abs() < 1e-9,
        "{got}"
    );
    assert!(
        (ms(&got["groups_ms"]["paged kernels"]) - 0.006 / 3.0).abs() < 1e-9,
        "{got}"
    );
    let first = &got["kernels"][0];
    assert_eq!(first["name"], "nvjet_tst_128x64", "{got}");
    assert_eq!(first["calls"], 1.0, "{got}");
}

/// A `bench attention` step's cell in the table: the variants that ran, fastest first, each
/// with its time a call and KV read rate; a variant's error is left out.
#[test]
fn gpu_check_summarises_the_attention_bench_fastest_first() {
    let out = r#"{"rows": [{"attention_kernel": "s1_v8", "us_per_call": 900.5, "kv_gb_per_s": 620.0, "fraction_of_bandwidth": 0.148, "splits": 1}, {"attention_kernel": "mma", "us_per_call": 210.0, "kv_gb_per_s": 2650.4, "fraction_of_bandwidth": 0.631, "splits": 1}, {"attention_kernel": "s8_v4_split", "error": "no"}]}"#;
    assert_eq!(
        brief("attention-qwen2.5-0.5b-b1024", out),
        "mma 210 us (2,650 GB/s, 63%); s1_v8 900 us (620 GB/s, 15%)"
    );
}

/// A `bench sample` step's cell: per spread, the exact noise's time a call, lazy noise's and
/// split draws', marked where a kernel drew other tokens than the exact noise.
#[test]
fn gpu_check_summarises_the_sample_bench_by_spread() {
    let out = r#"{"results": [{"std": 0.3, "noise": "exact", "us_per_call": 850.2, "same_tokens": true}, {"std": 0.3, "noise": "lazy", "us_per_call": 480.0, "same_tokens": true}, {"std": 12.0, "noise": "exact", "us_per_call": 300.0, "same_tokens": true}, {"std": 12.0, "noise": "lazy", "us_per_call": 310.0, "same_tokens": false}, {"std": 0.3, "noise": "lazy", "split": true, "us_per_call": 190.0, "same_tokens": true}, {"std": 12.0, "noise": "lazy", "split": true, "us_per_call": 120.0, "same_tokens": true}]}"#;
    assert_eq!(
        brief("sample-b1024", out),
        "std 0.3: exact 850 us, lazy 480 us, split 190 us; \
         std 12: exact 300 us, lazy 310 us DIFFERENT TOKENS, split 120 us"
    );
}

/// `gpu_check.py fastest` names the variant of the highest tokens/s among the rollouts'
/// outputs (of the fewest microseconds among a kernel bench's rows), skipping one that did not
/// finish and, with the doctor's report, every variant but the default that the doctor did
/// not pass (failed, or never checked), and prints nothing when none is left.
#[test]
fn gpu_check_fastest_picks_the_variant_of_the_highest_rate() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, text: &str| {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        path.to_str().unwrap().to_string()
    };
    let rollout = |rate: f64, variant: &str| {
        format!("log line\n{{\"tokens_per_s\": {rate}, \"attention_kernel\": \"{variant}\"}}\n")
    };
    let files = [
        write("default.out", &rollout(70_000.0, "s1_v8")),
        write("a.out", &rollout(91_000.0, "s8_v32")),
        write("b.out", &rollout(80_000.0, "s1_v16")),
        write("cut.out", "killed by its timeout\n"),
        write("mma.out", &rollout(95_000.0, "mma")),
    ];
    let fastest = |files: &[String]| {
        let (ok, stdout, stderr) = gpu_check_py(&[&["fastest".to_string()], files].concat());
        assert!(ok, "{stderr}");
        stdout
    };
    assert_eq!(fastest(&files[..4]), "--attention-kernel s8_v32\n");
    assert_eq!(fastest(&files), "--attention-kernel mma\n");
    assert_eq!(fastest(&files[3..4]), "");
    // With the doctor: a variant whose kernel check failed (mma) or that it never checked
    // (s8_v32) is no candidate, however fast; the default (mma_staged) needs no check of its
    // own, and the scalar kernel's is the plain one.
    let doctor = write(
        "doctor.out",
        concat!(
            r#"{"passed": false, "sections": [{"name": "paged", "checks": ["#,
            r#"{"name": "paged attention kernels", "status": "ok"}, "#,
            r#"{"name": "paged attention kernels, variant mma", "status": "fail"}, "#,
            r#"{"name": "paged attention kernels, variant s1_v16", "status": "ok"}]}]}"#,
            "\n"
        ),
    );
    let vet = |report: &str, files: &[String]| {
        let mut args = vec!["--doctor".to_string(), report.to_string()];
        args.extend(["--default".to_string(), "mma_staged".to_string()]);
        args.extend(files.iter().cloned());
        fastest(&args)
    };
    assert_eq!(vet(&doctor, &files), "--attention-kernel s1_v16\n");
    let scalar_only = write(
        "scalar-only.out",
        concat!(
            r#"{"passed": false, "sections": [{"name": "paged", "checks": ["#,
            r#"{"name": "paged attention kernels", "status": "ok"}]}]}"#,
            "\n"
        ),
    );
    assert_eq!(vet(&scalar_only, &files), "--attention-kernel s1_v8\n");
    // A doctor stopped before its variants' checks leaves the default alone.
    let cut_short = write("cut-short.out", "{\"passed\": false, \"sections\": []}\n");
    assert_eq!(vet(&cut_short, &files), "");
    let staged = [
        files.as_slice(),
        &[write("staged.out", &rollout(60_000.0, "mma_staged"))],
    ]
    .concat();
    assert_eq!(vet(&cut_short, &staged), "--attention-kernel mma_staged\n");
    // `bench attention`'s rows: the fewest microseconds a call, of the variants that ran and
    // that the doctor passed.
    let bench = write(
        "bench.out",
        concat!(
            r#"{"shape": "qwen2.5-0.5b", "rows": ["#,
            r#"{"attention_kernel": "s1_v8", "us_per_call": 374.0}, "#,
            r#"{"attention_kernel": "mma", "us_per_call": 60.0}, "#,
            r#"{"attention_kernel": "s8_v32", "error": "no"}, "#,
            r#"{"attention_kernel": "s1_v16", "us_per_call": 300.0}]}"#,
            "\n"
        ),
    );
    assert_eq!(
        fastest(std::slice::from_ref(&bench)),
        "--attention-kernel mma\n"
    );
    assert_eq!(
        vet(&doctor, std::slice::from_ref(&bench)),
        "--attention-kernel s1_v16\n"
    );
    // A rate in tokens and one in calls do not compare.
    assert!(!gpu_check_py(&["fastest", &bench, &files[0]]).0);
}
