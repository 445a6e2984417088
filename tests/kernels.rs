//! The suites whose results rest on the CPU projection kernel, re-run under every kernel
//! this CPU has: this test binary runs itself once per other kernel with `DPPO_CPU_KERNEL`
//! set (the kernel is fixed per process). A kernel the CPU lacks is reported as not tested.

use std::process::Command;

use dppo_model::cpu_kernel::KERNEL_ENV;
use dppo_model::CpuKernel;

/// Test-name filters of the suites that depend on the kernel: the paged engine against the
/// contiguous reference and batch invariance, the learner equal to the engine bit for bit,
/// the model against the HF fixtures, and the bit-exact resume and isolation from served
/// traffic of `dppo run`.
const KERNEL_SUITES: [&str; 7] = [
    "engine::",
    "batch_invariance::",
    "exact_learner::",
    "model_parity::",
    "cli::resume::one_step_off_policy_resumes",
    "cli::resume::resumed_run_ends",
    "cli::serve::serving_during_training",
];

/// How many tests a libtest run passed, from its `test result:` line.
fn passed(stdout: &str) -> usize {
    stdout
        .lines()
        .filter_map(|l| l.strip_prefix("test result: ok. "))
        .filter_map(|rest| rest.split(' ').next()?.parse::<usize>().ok())
        .sum()
}

/// Whether a test whose name starts with `filter` passed, from libtest's `test NAME ... ok`.
fn passed_under(stdout: &str, filter: &str) -> bool {
    stdout.lines().any(|l| {
        l.strip_prefix("test ")
            .is_some_and(|rest| rest.starts_with(filter) && rest.ends_with(" ... ok"))
    })
}

#[test]
fn kernel_dependent_suites_pass_under_every_kernel() {
    let this_run = dppo_model::cpu_kernel().expect("the process's kernel");
    for kernel in CpuKernel::ALL {
        if kernel == this_run {
            eprintln!("kernel {kernel}: tested by this run");
            continue;
        }
        if !kernel.is_available() {
            eprintln!("kernel {kernel}: this CPU lacks it, not tested");
            continue;
        }
        let out = Command::new(std::env::current_exe().expect("test binary"))
            .args(KERNEL_SUITES)
            .env(KERNEL_ENV, kernel.name())
            .output()
            .expect("re-running the test binary");
        let stdout = String::from_utf8_lossy(&out.stdout);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            out.status.success(),
            "under kernel {kernel}:\n{stdout}\n{stderr}"
        );
        let count = passed(&stdout);
        assert!(
            count >= 10,
            "under kernel {kernel} only {count} tests ran:\n{stdout}"
        );
        for suite in KERNEL_SUITES {
            assert!(
                passed_under(&stdout, suite),
                "under kernel {kernel} no test named {suite}* passed (renamed?):\n{stdout}"
            );
        }
        eprintln!("kernel {kernel}: {count} tests passed");
    }
}

#[test]
fn a_kernel_the_variable_names_wrongly_fails_every_command_at_once() {
    let out = Command::new(env!("CARGO_BIN_EXE_dppo"))
        .args(["generate", "--model", "builtin:tiny", "--prompt", "1+1"])
        .env(KERNEL_ENV, "sse9")
        .output()
        .expect("running dppo");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("DPPO_CPU_KERNEL") && stderr.contains("unknown kernel \"sse9\""),
        "{stderr}"
    );
}
