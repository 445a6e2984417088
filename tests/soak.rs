//! The 30-second soak of `dppo serve` (the long one is `scripts/soak`): `dppo bench serve`
//! sends a mix of completions and chat, streamed and whole, `n > 1`, seeded, with clients
//! that hang up mid-way, from more clients than the server has places.

use std::process::Command;

use serde_json::{json, Value};

#[test]
fn thirty_seconds_of_mixed_load_leave_no_error_no_block_and_no_leak() {
    let out = Command::new(env!("CARGO_BIN_EXE_dppo"))
        .args(["bench", "serve", "--model", "builtin:tiny", "--json"])
        .args([
            "--clients",
            "24",
            "--max-pending",
            "16",
            "--max-tokens",
            "32",
        ])
        .args(["--seconds", "30", "--warmup-seconds", "5", "--seed", "3"])
        .env_remove("DPPO_API_KEY")
        .output()
        .expect("run dppo bench serve");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let report: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    // Only 429s may go wrong; every stream ended with [DONE] or was hung up by its client.
    assert_eq!(report["errors"], json!({}), "{report:#}");
    assert!(report["completed"].as_u64().unwrap() > 0, "{report:#}");
    assert!(
        report["cancelled_by_client"].as_u64().unwrap() > 0,
        "no client hung up: {report:#}"
    );
    let counted = ["completed", "cancelled_by_client", "rejected_429"]
        .iter()
        .map(|k| report[k].as_u64().unwrap())
        .sum::<u64>();
    assert_eq!(counted, report["requests"].as_u64().unwrap(), "{report:#}");
    // Every KV block and queue place came back.
    assert_eq!(report["kv_blocks_used_end"], 0, "{report:#}");
    assert_eq!(report["requests_pending_end"], 0, "{report:#}");
    // The server's memory did not grow after the warm-up beyond the stated tolerance (but
    // for pages of KV blocks used for the first time, bounded by the pool).
    let mib = |k: &str| report[k].as_f64().unwrap();
    let growth = mib("rss_end_mib") - mib("rss_start_mib");
    assert!(
        growth - mib("rss_kv_first_touch_mib") <= mib("rss_tolerance_mib"),
        "{report:#}"
    );
    assert_eq!(report["passed"], true);
}

#[test]
fn a_soak_whose_requests_fail_reports_them_by_kind_and_fails() {
    let server =
        crate::server::Child::start(&["serve", "--model", "builtin:tiny", "--addr", "127.0.0.1:0"]);
    let out = Command::new(env!("CARGO_BIN_EXE_dppo"))
        .args([
            "bench",
            "serve",
            "--json",
            "--target",
            &server.addr.to_string(),
        ])
        .args(["--served-model-name", "no-such-model", "--clients", "2"])
        .args(["--seconds", "2", "--warmup-seconds", "0"])
        .env_remove("DPPO_API_KEY")
        .output()
        .expect("run dppo bench serve");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stdout}");
    assert!(
        stderr.contains("the soak failed: errors other than 429"),
        "{stderr}"
    );
    let report: Value = serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    let errors = report["errors"].as_object().unwrap();
    assert_eq!(
        errors.keys().collect::<Vec<_>>(),
        ["HTTP 404"],
        "{report:#}"
    );
    assert!(errors["HTTP 404"]["example"]
        .as_str()
        .unwrap()
        .contains("does not exist"));
    assert_eq!(report["completed"], 0);
    assert_eq!(report["passed"], false);
    server.interrupt(20);
}
