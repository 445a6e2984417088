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
    // The server's memory did not grow after the warm-up beyond the stated tolerance.
    let rss = |k: &str| report[k].as_f64().unwrap();
    assert!(
        rss("rss_end_mib") - rss("rss_start_mib") <= rss("rss_tolerance_mib"),
        "{report:#}"
    );
    assert_eq!(report["passed"], true);
}
