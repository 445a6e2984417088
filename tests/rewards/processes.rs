//! Reward processes: the example code reward, reward scripts (and one that dies mid-run),
//! verl's and TRL's functions through the adapter, combined and routed rewards, and the
//! configured reward in `dppo eval` and `dppo score`.

use super::*;

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
