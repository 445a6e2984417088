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
    Scorer::new(&settings, spec)
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

#[test]
fn the_example_code_reward_runs_unit_tests_with_a_timeout() {
    let settings = RewardSettings {
        command: Some(vec![
            "python3".into(),
            repo_root()
                .join("examples/code_reward.py")
                .display()
                .to_string(),
        ]),
        timeout_s: 60.0,
        ..RewardSettings::default()
    };
    let scorer = scorer(settings).unwrap();
    let tests = json!(["assert f(1) == 2", "assert f(0) == 1"]);
    let completions = [
        "```python\ndef f(x):\n    return x + 1\n```",
        "def f(x):\n    return 1",
        "def f(x):\n    while True:\n        pass",
        "this is not code",
    ];
    let items: Vec<RewardItem> = completions
        .iter()
        .map(|c| RewardItem {
            completion: c.to_string(),
            label: tests.clone(),
            ..items(1).remove(0)
        })
        .collect();
    let started = Instant::now();
    let scored = scorer.score(&items, None, "prompt 0 (code)", true).unwrap();
    assert_eq!(scored.rewards, vec![1.0, 0.5, 0.0, 0.0]);
    assert_eq!(scored.tally.logs["all_pass"], (1.0, 4));
    // The looping completion was stopped by the script's per-test timeout (5 s each).
    assert!(started.elapsed() < Duration::from_secs(30));
}

/// A reward script (its `reward.command` argv) answering each completion with `value`; with
/// `exit_after`, it exits 3 on the request after that many answers.
fn reward_script(dir: &Path, name: &str, value: f64, exit_after: Option<usize>) -> String {
    let path = dir.join(format!("{name}.py"));
    let exit_at = exit_after.map_or(-1, |k| k as i64);
    std::fs::write(
        &path,
        format!(
            "import json, sys\n\
             for k, line in enumerate(sys.stdin):\n\
             \x20   if k == {exit_at}:\n\
             \x20       sys.exit(3)\n\
             \x20   n = len(json.loads(line)['completions'])\n\
             \x20   print(json.dumps({{'rewards': [{value}] * n}}), flush=True)\n"
        ),
    )
    .unwrap();
    format!("[\"python3\", \"{}\"]", path.display())
}

#[test]
fn a_reward_process_that_dies_stops_the_run_after_a_checkpoint_and_resume_continues() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    // 8 prompts a step (plus over-drawing), 8 held-out problems: it dies in step 3 or so.
    let dies = format!(
        "reward.command={}",
        reward_script(dir.path(), "dies", 0.25, Some(30))
    );
    let base = [
        "warmup.steps=0",
        "data.num_eval=8",
        "rollout.prompts_per_step=8",
        "rollout.one_step_off_policy=false",
        "checkpoint.every=0",
        "steps=6",
    ];
    let mut sets: Vec<&str> = base.to_vec();
    sets.push(&dies);
    let (code, _, stderr) = run_with_sets(&sets, &out);
    assert_ne!(code, Some(0));
    assert!(
        stderr.contains("stopping: the last good state is checkpointed in")
            && stderr.contains("exit status: 3"),
        "{stderr}"
    );
    let done = metrics_lines(&out)
        .iter()
        .filter(|l| l.get("step").is_some())
        .count();
    assert!((1..6).contains(&done), "{done} steps before it died");
    let lives = format!(
        "reward.command={}",
        reward_script(dir.path(), "lives", 0.25, None)
    );
    let out_arg = out.display().to_string();
    let (code, stdout, stderr) = crate::util::run_dppo(&[
        "run", "--out", &out_arg, "--resume", "latest", "--set", &lives,
    ]);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    let steps: Vec<u64> = metrics_lines(&out)
        .iter()
        .filter_map(|l| l.get("step").and_then(Value::as_u64))
        .collect();
    assert_eq!(steps, (1..=6).collect::<Vec<_>>(), "every step once");
}

/// verl's `compute_score` and TRL's reward functions run unchanged through
/// `examples/python_reward.py`.
#[test]
fn verl_and_trl_reward_functions_run_through_the_example_adapter() {
    let dir = tempfile::tempdir().unwrap();
    let module = dir.path().join("user_rewards.py");
    std::fs::write(
        &module,
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n\
         \x20   right = solution_str.strip().endswith(str(ground_truth))\n\
         \x20   return {'score': float(right), 'length': len(solution_str)}\n\
         \n\
         def accuracy(prompts, completions, solution, **kwargs):\n\
         \x20   return [None if c == 'skip' else float(c.endswith(s)) for c, s in zip(completions, solution)]\n",
    )
    .unwrap();
    let adapter = repo_root()
        .join("examples/python_reward.py")
        .display()
        .to_string();
    let function = |f: &str| format!("{}:{f}", module.display());
    let run = |args: &[&str], completions: &[&str]| {
        let mut argv = vec!["python3".to_string(), adapter.clone()];
        argv.extend(args.iter().map(ToString::to_string));
        let scorer = scorer(RewardSettings {
            command: Some(argv),
            ..RewardSettings::default()
        })
        .unwrap();
        let items: Vec<RewardItem> = completions
            .iter()
            .map(|c| RewardItem {
                completion: c.to_string(),
                ..items(1).remove(0)
            })
            .collect();
        scorer.score(&items, None, "prompt 0 (math)", true).unwrap()
    };
    let verl = run(&["--verl", &function("compute_score")], &["Answer: 4", "5"]);
    assert_eq!(verl.rewards, vec![1.0, 0.0]);
    assert_eq!(verl.tally.logs["length"], (10.0, 2));
    let trl = run(
        &["--trl", &function("accuracy"), "--label-key", "solution"],
        &["so 4", "skip", "3"],
    );
    assert_eq!(trl.rewards, vec![1.0, 0.0, 0.0]);
}

/// `reward.combine` weighs named rewards (each part logged), and `reward.routes` gives a
/// data source its own: the dumped rollouts show each source scored by its route.
#[test]
fn rewards_combine_by_weight_and_route_by_data_source() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("sums.jsonl");
    crate::datasets::verl_file(&data, 48, 0);
    let (quarter, half) = (
        reward_script(dir.path(), "quarter", 0.25, None),
        reward_script(dir.path(), "half", 0.5, None),
    );
    let functions = format!(
        "reward.functions={{ quarter = {{ command = {quarter} }}, half = {{ command = {half} }} }}"
    );
    let (train, eval) = (
        format!("data.train={}", data.display()),
        format!("data.eval={}", data.display()),
    );
    let run = |extra: &[&str], out: &str| {
        let dump = dir.path().join(out).join("dump");
        let dump_set = format!("rollout.dump_dir={}", dump.display());
        let mut sets = vec![
            train.as_str(),
            eval.as_str(),
            functions.as_str(),
            dump_set.as_str(),
            "data.question_field=prompt",
            "data.answer_field=reward_model.ground_truth",
            "data.num_eval=4",
            "warmup.steps=0",
            "rollout.prompts_per_step=8",
            "steps=2",
        ];
        sets.extend_from_slice(extra);
        let (code, stdout, stderr) = run_with_sets(&sets, &dir.path().join(out));
        assert_eq!(code, Some(0), "{stdout}\n{stderr}");
        let mut rows = Vec::new();
        for entry in std::fs::read_dir(&dump).unwrap() {
            let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            rows.extend(
                text.lines()
                    .map(|l| serde_json::from_str::<Value>(l).unwrap()),
            );
        }
        (metrics_lines(&dir.path().join(out)), rows)
    };
    // verifier + 2 x quarter: every completion's reward is its verdict + 0.5.
    let (lines, rows) = run(
        &["reward.combine={ verifier = 1, quarter = 2 }"],
        "combined",
    );
    for row in &rows {
        let reward = row["reward"].as_f64().unwrap();
        assert!(reward == 0.5 || reward == 1.5, "{row}");
    }
    for line in lines.iter().filter(|l| l.get("step").is_some()) {
        let part = |name: &str| line[format!("reward/{name}/mean")].as_f64().unwrap();
        assert_eq!(part("quarter"), 0.25);
        let mean = line["reward/mean"].as_f64().unwrap();
        assert!((mean - (part("verifier") + 0.5)).abs() < 1e-12, "{line}");
        assert_eq!(
            line["acc/mean"].as_f64().unwrap(),
            part("verifier"),
            "{line}"
        );
    }
    // Odd sums get half, even ones the verifier.
    let routes = "reward.routes={ \"sums/odd\" = { half = 1 } }";
    let (_, rows) = run(&[routes], "routed");
    for row in &rows {
        let reward = row["reward"].as_f64().unwrap();
        match row["data_source"].as_str().unwrap() {
            "sums/odd" => assert_eq!(reward, 0.5, "{row}"),
            _ => assert!(reward == 0.0 || reward == 1.0, "{row}"),
        }
    }
    // Names that are not defined, or taken, are named.
    for (set, want) in [
        ("reward.combine={ verifier = 1, nope = 1 }", "reward.combine: names \"nope\", which is not defined (defined: verifier, half, quarter)"),
        ("reward.functions={ url = { extract = \"boxed\" } }", "\"url\" is a built-in name"),
    ] {
        let (code, _, stderr) = run_with_sets(&[train.as_str(), eval.as_str(), functions.as_str(), set], &dir.path().join("bad"));
        assert_eq!(code, Some(2), "{stderr}");
        assert!(stderr.contains(want), "{stderr}");
    }
}

/// `dppo eval` and `dppo score` take the run's reward: samples scored by a reward process
/// at evaluation re-score to the same rewards, and to others under another reward.
#[test]
fn eval_and_score_use_the_configured_reward() {
    let dir = tempfile::tempdir().unwrap();
    let (quarter, half) = (
        reward_script(dir.path(), "quarter", 0.25, None),
        reward_script(dir.path(), "half", 0.5, None),
    );
    let samples = dir.path().join("samples.jsonl");
    let samples_arg = samples.display().to_string();
    let command = |script: &str| format!("reward.command={script}");
    let (code, stdout, stderr) = crate::util::run_dppo(&[
        "eval",
        "--model",
        "builtin:tiny",
        "--data",
        "builtin:arithmetic",
        "--limit",
        "6",
        "--n",
        "2",
        "--k",
        "2",
        "--max-tokens",
        "8",
        "--temperature",
        "1.0",
        "--samples",
        &samples_arg,
        "--set",
        &command(&quarter),
    ]);
    assert_eq!(code, Some(0), "{stderr}");
    let report: Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(report["avg@2"], json!(0.25), "{report}");
    assert_eq!(report["pass@2"], json!(0.0), "no reward reaches 1");
    let score = |script: &str| {
        let (code, stdout, stderr) =
            crate::util::run_dppo(&["score", "--data", &samples_arg, "--set", &command(script)]);
        assert_eq!(code, Some(0), "{stderr}");
        serde_json::from_str::<Value>(stdout.trim()).unwrap()
    };
    let same = score(&quarter);
    assert_eq!(
        (&same["agreement"], &same["samples"]),
        (&json!(1.0), &json!(12))
    );
    let other = score(&half);
    assert_eq!(
        (&other["disagreements"], &other["mean_reward"]),
        (&json!(12), &json!(0.5))
    );
    assert_eq!(other["saved_mean_reward"], json!(0.25));
}
