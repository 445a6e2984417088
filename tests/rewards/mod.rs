//! External rewards: the example reward server and reward script score runs and held-out
//! sets, their `extra_logs` become metrics, failures are retried, named or forgiven as
//! configured, requests overlap, and a reward process that dies stops the run after a
//! checkpoint from which `--resume latest` continues.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use dppo_trainer::config::RunConfig;
use dppo_trainer::reward::{OnError, RewardItem, RewardSettings, Scorer};
use serde_json::{json, Value};

use crate::util::{metrics_lines, repo_root, run_dppo_env, run_with_sets};

mod processes;

/// A child process killed when dropped.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `examples/reward_server.py` on a free port, requiring the token in `token_env` when
/// given; returns it with its `reward.url`.
fn example_server(token_env: Option<(&str, &str)>) -> (Killed, String) {
    let mut cmd = Command::new("python3");
    cmd.arg(repo_root().join("examples/reward_server.py"))
        .args(["--port", "0"])
        .stdout(Stdio::piped());
    if let Some((name, value)) = token_env {
        cmd.args(["--token-env", name]).env(name, value);
    }
    let mut child = cmd.spawn().expect("python3 runs the example server");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let port = line.trim().strip_prefix("listening on ").expect("its port");
    (Killed(child), format!("http://127.0.0.1:{port}/get_reward"))
}

/// A short run of the built-in task: a brief warm-up, 50 held-out problems.
const SHORT: [&str; 4] = [
    "warmup.steps=30",
    "data.num_eval=50",
    "steps=4",
    "eval.every=2",
];

#[test]
fn the_example_server_scores_a_run_with_a_token_that_is_never_written() {
    let token = "s3cret-token-never-logged";
    let (_server, url) = example_server(Some(("DPPO_TEST_REWARD_TOKEN", token)));
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut args = vec!["run", "--out", out.to_str().unwrap()];
    let url_set = format!("reward.url={url}");
    let sets = [
        url_set.as_str(),
        "reward.api_key_env=DPPO_TEST_REWARD_TOKEN",
    ];
    for set in SHORT.iter().chain(&sets) {
        args.extend(["--set", set]);
    }
    let (code, stdout, stderr) = run_dppo_env(
        &args,
        &[("DPPO_TEST_REWARD_TOKEN", token), ("RUST_LOG", "info")],
    );
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    let lines = metrics_lines(&out);
    let steps: Vec<&Value> = lines.iter().filter(|l| l.get("step").is_some()).collect();
    assert_eq!(steps.len(), 4);
    for line in &steps {
        let (exact, format) = (
            line["reward/exact/mean"].as_f64().unwrap(),
            line["reward/format/mean"].as_f64().unwrap(),
        );
        // The server's reward is exact + 0.1 * format, item by item.
        let mean = line["reward/mean"].as_f64().unwrap();
        assert!((mean - (exact + 0.1 * format)).abs() < 1e-9, "{line}");
        assert_eq!(line["reward/errors"], json!(0));
        assert!(line.get("acc/mean").is_none(), "no verdicts: {line}");
    }
    assert!(
        steps[1].get("eval/acc").is_some(),
        "held-out score every 2 steps"
    );
    let config = std::fs::read_to_string(out.join("config.toml")).unwrap();
    assert!(
        config.contains("api_key_env = \"DPPO_TEST_REWARD_TOKEN\""),
        "{config}"
    );
    for (name, text) in [
        ("config.toml", &config),
        ("stdout", &stdout),
        ("stderr", &stderr),
    ] {
        assert!(!text.contains(token), "the token reached {name}");
    }

    // A wrong token: HTTP 401 is not retried and names the prompt; on_error = "zero"
    // scores such groups 0 and counts them.
    let refused = dir.path().join("refused");
    let mut args = vec!["run", "--out", refused.to_str().unwrap()];
    for set in SHORT.iter().chain(&sets) {
        args.extend(["--set", set]);
    }
    let (code, _, stderr) = run_dppo_env(&args, &[("DPPO_TEST_REWARD_TOKEN", "wrong")]);
    assert_ne!(code, Some(0));
    assert!(
        stderr.contains(&format!("reward {url}: held-out prompt"))
            && stderr.contains("HTTP 401")
            && stderr.contains("(after 1 attempt)"),
        "{stderr}"
    );
    let forgiven = dir.path().join("forgiven");
    args[2] = forgiven.to_str().unwrap();
    args.extend(["--set", "reward.on_error=zero"]);
    let (code, stdout, stderr) = run_dppo_env(&args, &[("DPPO_TEST_REWARD_TOKEN", "wrong")]);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    for line in metrics_lines(&forgiven)
        .iter()
        .filter(|l| l.get("step").is_some())
    {
        assert_eq!(line["reward/mean"], json!(0.0), "{line}");
        assert!(line["reward/errors"].as_u64().unwrap() > 0, "{line}");
    }
}

/// A scripted reward server: answers request `k` (from 0) with `answer(k, body)` as
/// (status, body), each on its own connection; counts the requests in flight at once.
struct Scripted {
    url: String,
    max_in_flight: Arc<AtomicUsize>,
}

fn scripted(answer: impl Fn(usize, &Value) -> (u16, String) + Send + Sync + 'static) -> Scripted {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/score", listener.local_addr().unwrap());
    let answer = Arc::new(answer);
    let (count, in_flight, max_in_flight) = (
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
        Arc::new(AtomicUsize::new(0)),
    );
    let max = max_in_flight.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { return };
            let (answer, count, in_flight, max) = (
                answer.clone(),
                count.clone(),
                in_flight.clone(),
                max.clone(),
            );
            std::thread::spawn(move || {
                let now = in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                max.fetch_max(now, Ordering::SeqCst);
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut length = 0;
                loop {
                    let mut line = String::new();
                    reader.read_line(&mut line).unwrap();
                    let lower = line.to_ascii_lowercase();
                    if let Some(v) = lower.strip_prefix("content-length:") {
                        length = v.trim().parse().unwrap();
                    }
                    if line == "\r\n" {
                        break;
                    }
                }
                let mut body = vec![0; length];
                reader.read_exact(&mut body).unwrap();
                let body: Value = serde_json::from_slice(&body).unwrap();
                let k = count.fetch_add(1, Ordering::SeqCst);
                let (status, text) = answer(k, &body);
                // Slow enough that requests sent together are in flight together.
                std::thread::sleep(Duration::from_millis(30));
                in_flight.fetch_sub(1, Ordering::SeqCst);
                let _ = write!(
                    stream,
                    "HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: \
                     {}\r\nConnection: close\r\n\r\n{text}",
                    text.len()
                );
            });
        }
    });
    Scripted { url, max_in_flight }
}

fn items(n: usize) -> Vec<RewardItem> {
    (0..n)
        .map(|i| RewardItem {
            prompt: "What is 2+2? ".into(),
            completion: format!("Answer: {i}"),
            label: json!("4"),
            data_source: "math".into(),
            extra_info: Value::Null,
            num_tokens: 3,
            is_truncated: false,
        })
        .collect()
}

fn scorer(settings: RewardSettings) -> Result<Scorer, String> {
    let spec = dppo_trainer::reward::spec(&RunConfig::default_with(&[]).unwrap());
    Scorer::new(&settings, spec).map_err(|e| e.to_string())
}

fn settings(url: &str) -> RewardSettings {
    RewardSettings {
        url: Some(url.to_string()),
        timeout_s: 5.0,
        ..RewardSettings::default()
    }
}

#[test]
fn server_failures_are_retried_named_or_forgiven() {
    let good = |body: &Value| {
        let n = body["completions"].as_array().unwrap().len();
        json!({"rewards": vec![1.0; n], "extra_logs": {"len": vec![2.0; n]}}).to_string()
    };
    // Two 503s, then an answer: retried with backoff, then scored.
    let server = scripted(move |k, body| match k {
        0 | 1 => (503, "busy".into()),
        _ => (200, good(body)),
    });
    let scored = scorer(settings(&server.url))
        .unwrap()
        .score(&items(3), None, "prompt 7 (math)", true)
        .unwrap();
    assert_eq!(scored.rewards, vec![1.0; 3]);
    assert_eq!(scored.tally.logs["len"], (6.0, 3));
    assert_eq!((scored.tally.num_external, scored.tally.errors), (3, 0));

    // Answers that cannot be used: each named, with the prompt; never retried.
    let cases = [
        (
            r#"{"rewards": [1.0]}"#,
            "rewards has 1 values for 3 completions",
        ),
        (r#"{"rewards": [1.0, NaN, 0.0]}"#, "not JSON"),
        (r#"{"rewards": [1.0, null, 0.0]}"#, "rewards[1] is null"),
        ("<html>oops</html>", "not JSON"),
    ];
    for (text, want) in cases {
        let server = scripted(move |_, _| (200, text.to_string()));
        let err = scorer(settings(&server.url))
            .unwrap()
            .score(&items(3), None, "prompt 7 (math)", true)
            .unwrap_err()
            .to_string();
        let head = format!("reward {}: prompt 7 (math): ", server.url);
        assert!(err.starts_with(&head) && err.contains(want), "{err}");
        let forgiving = RewardSettings {
            on_error: OnError::Zero,
            ..settings(&server.url)
        };
        let scored = scorer(forgiving)
            .unwrap()
            .score(&items(3), None, "prompt 7 (math)", true)
            .unwrap();
        assert_eq!(scored.rewards, vec![0.0; 3]);
        assert_eq!(scored.tally.errors, 3);
    }
    // Retries are bounded: a server that is always busy fails after 1 + max_retries tries.
    let server = scripted(|_, _| (500, "down".into()));
    let bounded = RewardSettings {
        max_retries: 1,
        ..settings(&server.url)
    };
    let err = scorer(bounded)
        .unwrap()
        .score(&items(2), None, "prompt 1 (math)", true)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("HTTP 500") && err.contains("(after 2 attempts)"),
        "{err}"
    );
    // Settings that cannot work fail at start, naming the key.
    let https = scorer(settings("https://example.com/score")).err().unwrap();
    assert!(https.starts_with("reward.url: https://example.com/score: https is not supported"));
    let no_token = scorer(RewardSettings {
        api_key_env: Some("DPPO_TEST_UNSET_VARIABLE".into()),
        ..settings(&server.url)
    })
    .err()
    .unwrap();
    assert!(
        no_token.contains("DPPO_TEST_UNSET_VARIABLE, which is not set"),
        "{no_token}"
    );
}

/// Reward settings that cannot start fail when the run starts, naming the key at fault.
#[test]
fn reward_settings_that_cannot_start_name_their_key() {
    let cmd = |argv: &[&str]| Some(argv.iter().map(|a| a.to_string()).collect::<Vec<_>>());
    let cases = [
        (
            RewardSettings {
                command: cmd(&[]),
                ..RewardSettings::default()
            },
            "reward.command: the command is empty",
        ),
        (
            RewardSettings {
                command: cmd(&["/nonexistent/dppo-reward"]),
                ..RewardSettings::default()
            },
            "reward.command: cannot start `/nonexistent/dppo-reward`",
        ),
        (
            RewardSettings {
                command: cmd(&["true"]),
                ..settings("http://127.0.0.1:9/score")
            },
            "reward.url and reward.command are both set",
        ),
        (
            settings("ftp://127.0.0.1/score"),
            "reward.url: ftp://127.0.0.1/score: not an http:// address",
        ),
        (
            RewardSettings {
                combine: Some([("judge".to_string(), 1.0)].into_iter().collect()),
                ..RewardSettings::default()
            },
            "reward.combine or reward.routes weighs a reward named \"judge\"",
        ),
    ];
    for (settings, want) in cases {
        let err = scorer(settings).err().unwrap();
        assert!(err.starts_with(want), "{err}");
    }
}

/// Groups go to the server as they finish, `reward.concurrency` at once, while the rest
/// of the rollout generates.
#[test]
fn a_run_sends_reward_requests_concurrently() {
    let server = scripted(|_, body| {
        let n = body["completions"].as_array().unwrap().len();
        (200, json!({"rewards": vec![0.5; n]}).to_string())
    });
    let dir = tempfile::tempdir().unwrap();
    let url = format!("reward.url={}", server.url);
    let sets = [
        url.as_str(),
        "reward.concurrency=4",
        "warmup.steps=0",
        "data.num_eval=8",
        "steps=2",
    ];
    let (code, stdout, stderr) = run_with_sets(&sets, &dir.path().join("run"));
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    let max = server.max_in_flight.load(Ordering::SeqCst);
    assert!((2..=4).contains(&max), "{max} requests in flight at most");
    for line in metrics_lines(&dir.path().join("run")) {
        if line.get("step").is_some() {
            assert_eq!(line["reward/mean"], json!(0.5), "{line}");
        }
    }
}
