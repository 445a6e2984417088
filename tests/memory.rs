//! `dppo memory` through the binary: a GPU memory budget without a GPU, and the errors of
//! one that does not fit or of a size that does not parse.

/// Runs `dppo <command>`; returns its exit code, stdout and stderr.
fn run(command: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let args: Vec<&str> = std::iter::once(command)
        .chain(args.iter().copied())
        .collect();
    crate::util::run_dppo(&args)
}

/// Runs `dppo memory`; returns its exit code, stdout and stderr.
fn memory(args: &[&str]) -> (Option<i32>, String, String) {
    run("memory", args)
}

#[test]
fn memory_prints_every_part_and_the_kv_cache_for_the_config() {
    let (code, stdout, stderr) = memory(&[
        "--gpu-memory",
        "80GiB",
        "--set",
        "engine.gpu_memory_utilization=0.25",
        "--set",
        "rollout.max_response_len=100",
        "--prompt-len",
        "28",
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    for want in [
        "builtin:tiny: 100032 parameters on a 80.00 GiB GPU",
        "gpu_memory_utilization 0.25",
        "budget                  20.00 GiB",
        "f32 master weights      390.75 KiB",
        "AdamW moments (f32)     781.50 KiB",
        "activation budget",
        "blocks of 16 tokens",
        "of 128 tokens (prompt + response)",
    ] {
        assert!(stdout.contains(want), "{want:?} not in\n{stdout}");
    }
    // The dtypes come from the config unless a flag names them (`auto`: bf16 on a GPU).
    let engine_in = |sets: &[&str]| {
        let mut args = vec!["--gpu-memory", "80GiB"];
        args.extend(sets.iter().flat_map(|s| ["--set", s]));
        let (code, stdout, stderr) = memory(&args);
        assert_eq!(code, Some(0), "{stderr}");
        stdout
    };
    assert!(engine_in(&[]).contains("engine in bf16, learner in bf16"));
    let configured = engine_in(&["engine.dtype=f32", "train.compute_dtype=f32"]);
    assert!(
        configured.contains("engine in f32, learner in f32"),
        "{configured}"
    );
    let (code, stdout, stderr) = memory(&[
        "--gpu-memory",
        "80GiB",
        "--set",
        "engine.dtype=f32",
        "--engine-dtype",
        "f16",
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("engine in f16"), "{stdout}");
    let (code, stdout, stderr) = memory(&["--gpu-memory", "24GB", "--serve"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stdout.contains("no learner (serving); gpu_memory_utilization 0.9"),
        "{stdout}"
    );
    assert!(!stdout.contains("master weights"), "{stdout}");
}

/// A `random:` shape is budgeted from its config alone: no 6 GB of weights drawn.
#[test]
fn memory_budgets_a_random_weight_shape_without_drawing_it() {
    let (code, stdout, stderr) =
        memory(&["--gpu-memory", "80GiB", "--model", "random:qwen2.5-1.5b"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        stdout.contains("random:qwen2.5-1.5b: 1543714304 parameters on a 80.00 GiB GPU"),
        "{stdout}"
    );
}

#[test]
fn memory_says_what_does_not_fit_and_rejects_bad_sizes() {
    let (code, _, stderr) = memory(&["--gpu-memory", "1MB"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("does not fit: engine weights")
            && stderr.contains("AdamW moments (f32)")
            && stderr.contains("leaving nothing for the KV cache"),
        "{stderr}"
    );
    let (code, _, stderr) = memory(&["--gpu-memory", "80G"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("e.g. 80GiB, 24GB, 1e9"), "{stderr}");
    let (code, _, stderr) = memory(&["--gpu-memory", "80GiB", "--free-memory", "10GiB"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("but only 10.00 GiB of the GPU is free"),
        "{stderr}"
    );
}

/// `dppo plan` is an alias of `dppo memory`, so that existing scripts keep working.
#[test]
fn plan_is_an_alias_of_memory() {
    let args = ["--gpu-memory", "24GB", "--serve"];
    let (code, stdout, stderr) = run("plan", &args);
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(stdout, memory(&args).1);
}
