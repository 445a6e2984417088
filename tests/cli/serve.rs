//! The binary serving: `dppo run --serve` under load and Ctrl-C, `dppo serve`'s API key.

use std::process::Command;

use serde_json::Value;

use super::{dppo, SMALL};
use crate::util::assert_same_checkpoint;

/// `dppo run --serve`: clients hammering the server while it trains see the policy versions
/// advance, and the trained weights equal those of a run without a server.
#[test]
fn serving_during_training_leaves_the_trained_weights_unchanged() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};

    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a"), dir.path().join("b"));
    let extra = ["--set", "steps=4", "--set", "actor.beta=0.1"];
    let mut args = vec!["run", "--out", a.to_str().unwrap()];
    args.extend_from_slice(&SMALL);
    args.extend_from_slice(&extra);
    let (ok, _, stderr) = dppo(&args);
    assert!(ok, "{stderr}");

    let mut args = vec!["run", "--out", b.to_str().unwrap()];
    args.extend_from_slice(&SMALL);
    args.extend_from_slice(&extra);
    args.extend_from_slice(&["--serve", "127.0.0.1:0", "--served-model-name", "live"]);
    let mut child = crate::server::Child::start(&args);
    let addr = child.addr;
    let stop = Arc::new(AtomicBool::new(false));
    let versions = Arc::new(Mutex::new(std::collections::BTreeSet::new()));
    let clients: Vec<_> = (0..4)
        .map(|i| {
            let (stop, versions) = (stop.clone(), versions.clone());
            std::thread::spawn(move || {
                let mut answered = 0;
                while !stop.load(Ordering::SeqCst) {
                    let body = serde_json::json!({"model": "live", "prompt": "What is 12+34?",
                        "n": 2, "max_tokens": 8, "stream": i % 2 == 0});
                    let Ok(r) = crate::http::try_request(
                        addr,
                        "POST",
                        "/v1/completions",
                        Some(&body.to_string()),
                    ) else {
                        break; // the run ended and took the server with it
                    };
                    if r.status != 200 {
                        // 503 while the server shuts down; anything else is a failure.
                        assert_eq!(r.status, 503, "{}", r.body);
                        break;
                    }
                    let chunks = if i % 2 == 0 {
                        r.sse()
                    } else {
                        vec![r.body.clone()]
                    };
                    for c in chunks.iter().filter(|c| c.starts_with('{')) {
                        // (A stream cut by the shutdown ends with an error object.)
                        let v: Value = serde_json::from_str(c).unwrap();
                        for version in v["policy_versions"].as_array().into_iter().flatten() {
                            versions.lock().unwrap().insert(version.as_u64().unwrap());
                        }
                    }
                    answered += 1;
                }
                answered
            })
        })
        .collect();
    child.wait_success(600);
    stop.store(true, Ordering::SeqCst);
    let answered: usize = clients.into_iter().map(|c| c.join().unwrap()).sum();
    assert!(answered > 0, "no request was answered during training");
    let seen = versions.lock().unwrap().clone();
    assert!(
        seen.len() >= 2,
        "responses should span policy versions, saw {seen:?}"
    );
    assert_same_checkpoint(&a, &b, 4, "serving changed the trained weights");
}

/// Ctrl-C during `dppo run --serve` ends training after the current step, with a
/// checkpoint of that step and a summary, and exits cleanly.
#[test]
fn ctrl_c_stops_a_serving_run_after_the_current_step() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut args = vec!["run", "--out", out.to_str().unwrap()];
    args.extend_from_slice(&SMALL);
    args.extend_from_slice(&["--set", "steps=100000", "--serve", "127.0.0.1:0"]);
    let child = crate::server::Child::start(&args);
    let metrics = out.join("metrics.jsonl");
    let start = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |m| m.lines().count()) < 2 {
        assert!(start.elapsed().as_secs() < 120, "training did not start");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    child.interrupt(120);
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    let steps = summary["steps"].as_u64().unwrap();
    assert!((2..100000).contains(&steps), "{summary}");
    let ckpt = out.join(format!(
        "checkpoints/step-{steps:06}/model/model.safetensors"
    ));
    assert!(
        ckpt.exists(),
        "no checkpoint of the last step at {}",
        ckpt.display()
    );
    let lines = std::fs::read_to_string(&metrics).unwrap().lines().count() as u64;
    assert_eq!(lines, steps, "one metrics line per finished step");
}

/// `dppo serve` reads its API key from `DPPO_API_KEY`, and warns when it listens beyond
/// loopback without one.
#[test]
fn serve_takes_the_api_key_from_the_environment_and_warns_without_one() {
    use std::io::{BufRead, Read};
    let serve = |key: Option<&str>| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dppo"));
        cmd.args(["serve", "--model", "builtin:tiny", "--addr", "0.0.0.0:0"])
            .env("RUST_LOG", "warn")
            .env_remove("DPPO_API_KEY")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
        if let Some(key) = key {
            cmd.env("DPPO_API_KEY", key);
        }
        let mut child = cmd.spawn().expect("start dppo serve");
        let stdout = child.stdout.take().unwrap();
        let mut lines = std::io::BufReader::new(stdout).lines().map(Result::unwrap);
        let line = lines
            .find(|l| l.starts_with("listening on http://"))
            .expect("dppo exited before listening");
        std::thread::spawn(move || lines.for_each(drop));
        let port: u16 = line.rsplit(':').next().unwrap().trim().parse().unwrap();
        let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
        let status = |headers: &[(&str, &str)]| {
            crate::http::request_with(addr, "GET", "/v1/models", None, headers).status
        };
        let statuses = (status(&[]), status(&[("Authorization", "Bearer sk-env")]));
        let pid = child.id().to_string();
        let sent = Command::new("kill").args(["-INT", &pid]).status().unwrap();
        assert!(sent.success());
        assert!(child.wait().unwrap().success());
        let mut stderr = String::new();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr)
            .unwrap();
        (statuses, stderr)
    };
    let (statuses, stderr) = serve(Some("sk-env"));
    assert_eq!(statuses, (401, 200));
    assert!(!stderr.contains("without an API key"), "{stderr}");
    let (statuses, stderr) = serve(None);
    assert_eq!(statuses, (200, 200));
    assert!(stderr.contains("without an API key"), "{stderr}");
}
