//! Datasets in the formats people have (issue #40): verl's schema as JSONL, read through
//! dotted field paths, trains; data without demonstrations and a warm-up is a clear error.

use serde_json::json;

use crate::util::{metrics_lines, run_with_sets};

/// Writes `n` verl rows of two-digit sums (system and user messages, the answer nested in
/// `reward_model`; two data sources, by parity) to `path`.
pub(crate) fn verl_file(path: &std::path::Path, n: usize, first: usize) {
    let rows: Vec<String> = (first..first + n)
        .map(|i| {
            let (a, b) = (10 + i % 80, 11 + (i * 7) % 80);
            json!({
                "data_source": if i % 2 == 0 { "sums/even" } else { "sums/odd" },
                "prompt": [
                    {"role": "system", "content": "Answer with the number."},
                    {"role": "user", "content": format!("What is {a}+{b}?")}
                ],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": a + b},
                "extra_info": {"index": i}
            })
            .to_string()
        })
        .collect();
    std::fs::write(path, rows.join("\n") + "\n").unwrap();
}

#[test]
fn a_verl_jsonl_file_trains_and_a_warm_up_without_demonstrations_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (train, eval) = (
        dir.path().join("train.jsonl"),
        dir.path().join("test.jsonl"),
    );
    verl_file(&train, 48, 0);
    verl_file(&eval, 16, 1000);
    let (train_set, eval_set) = (
        format!("data.train={}", train.display()),
        format!("data.eval={}", eval.display()),
    );
    let run = |extra: &[&str], out: &str| {
        let mut sets = vec![
            train_set.as_str(),
            eval_set.as_str(),
            "data.question_field=prompt",
            "data.answer_field=reward_model.ground_truth",
            "data.num_eval=16",
            "steps=2",
        ];
        sets.extend_from_slice(extra);
        run_with_sets(&sets, &dir.path().join(out))
    };
    let (code, stdout, stderr) = run(&["warmup.steps=0", "eval.every=2"], "ok");
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    let steps = metrics_lines(&dir.path().join("ok"));
    assert_eq!(steps.iter().filter(|l| l.get("step").is_some()).count(), 2);
    // The held-out score of each data source (8 problems each), and over both.
    let last = steps.iter().rfind(|l| l.get("step").is_some()).unwrap();
    let score = |key: &str| {
        last[key]
            .as_f64()
            .unwrap_or_else(|| panic!("{key}: {last}"))
    };
    let (even, odd) = (score("eval/sums/even/acc"), score("eval/sums/odd/acc"));
    assert!(
        (score("eval/acc") - (even + odd) / 2.0).abs() < 1e-12,
        "{last}"
    );
    let (code, _, stderr) = run(&[], "refused");
    assert_ne!(code, Some(0));
    assert!(
        stderr.contains("warmup.steps = 1000 trains on demonstrations")
            && stderr.contains("train.jsonl has none")
            && stderr.contains("set warmup.steps = 0"),
        "{stderr}"
    );
}

/// `rollout.dump_dir` writes every step's completions with their rewards, advantages and
/// pruning decisions, agreeing with the step's metrics.
#[test]
fn each_steps_rollout_is_dumped_as_the_metrics_describe_it() {
    let dir = tempfile::tempdir().unwrap();
    let dump = dir.path().join("rollouts");
    let dump_set = format!("rollout.dump_dir={}", dump.display());
    let sets = [
        dump_set.as_str(),
        "warmup.steps=100",
        "data.num_eval=8",
        "rollout.prompts_per_step=8",
        "steps=3",
    ];
    let (code, stdout, stderr) = run_with_sets(&sets, &dir.path().join("run"));
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    for line in metrics_lines(&dir.path().join("run")) {
        let Some(step) = line.get("step").and_then(|s| s.as_u64()) else {
            continue;
        };
        let text = std::fs::read_to_string(dump.join(format!("step-{step:06}.jsonl"))).unwrap();
        let rows: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        let rewards: Vec<f64> = rows.iter().map(|r| r["reward"].as_f64().unwrap()).collect();
        let mean = rewards.iter().sum::<f64>() / rewards.len() as f64;
        assert_eq!(line["reward/mean"].as_f64().unwrap(), mean, "step {step}");
        let kept: Vec<&serde_json::Value> = rows.iter().filter(|r| r["kept"] == true).collect();
        let kept_frac = kept.len() as f64 / rows.len() as f64;
        assert_eq!(line["prune/completions_kept"].as_f64().unwrap(), kept_frac);
        assert_eq!(rows.len() % 8, 0, "whole groups of G = 8");
        for row in &rows {
            assert_eq!(row["step"], step);
            assert_eq!(row["data_source"], "builtin:arithmetic");
            assert!(row["prompt"].as_str().unwrap().contains("What is"), "{row}");
            let weight = row["weight"].as_f64().unwrap();
            match row["kept"].as_bool().unwrap() {
                true => assert!(weight >= 1.0, "{row}"),
                false => assert_eq!(weight, 0.0),
            }
        }
    }
}

/// verl's parquet files read as their JSONL twins do: the same problems, prompt ids
/// included; a file that is not parquet is named.
#[test]
fn verl_parquet_reads_as_its_jsonl_twin_and_trains() {
    use dppo_trainer::data::{load_file, Fields};
    let dir = tempfile::tempdir().unwrap();
    let twin = dir.path().join("verl.jsonl");
    verl_file(&twin, 24, 0);
    let parquet = crate::util::fixture("parquet/verl.parquet");
    let fields = Fields {
        question: "prompt".into(),
        answer: "reward_model.ground_truth".into(),
        verify: true,
    };
    let from_parquet = load_file(&parquet, &fields).unwrap();
    assert_eq!(from_parquet.len(), 24);
    assert_eq!(from_parquet, load_file(&twin, &fields).unwrap());
    let not_parquet = dir.path().join("fake.parquet");
    std::fs::write(&not_parquet, "{\"a\": 1}\n").unwrap();
    let err = load_file(&not_parquet, &fields).unwrap_err().to_string();
    assert!(err.starts_with(&format!(
        "{}: not a readable parquet file",
        not_parquet.display()
    )));
    let (train_set, eval_set) = (
        format!("data.train={}", parquet.display()),
        format!("data.eval={}", twin.display()),
    );
    let sets = [
        train_set.as_str(),
        eval_set.as_str(),
        "data.question_field=prompt",
        "data.answer_field=reward_model.ground_truth",
        "data.num_eval=8",
        "warmup.steps=0",
        "steps=2",
    ];
    let (code, stdout, stderr) = run_with_sets(&sets, &dir.path().join("run"));
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
}

/// Several training files: one set without weights (b.jsonl holds a quarter of the
/// problems), mixed by `data.train_weights` with them. GRPO rolls out every drawn prompt,
/// so the dumped rollouts count the draws. A weight count that does not match is named.
#[test]
fn several_files_are_drawn_as_one_set_or_by_weight() {
    let dir = tempfile::tempdir().unwrap();
    let (a, b) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"));
    verl_file(&a, 36, 0);
    verl_file(&b, 12, 40);
    let b_rows = std::fs::read_to_string(&b)
        .unwrap()
        .replace("sums/even", "other")
        .replace("sums/odd", "other");
    std::fs::write(&b, b_rows).unwrap();
    let train = format!("data.train=[\"{}\", \"{}\"]", a.display(), b.display());
    let eval = format!("data.eval={}", a.display());
    let share_of_b = |extra: &[&str], out: &str| {
        let dump = dir.path().join(out).join("dump");
        let dump_set = format!("rollout.dump_dir={}", dump.display());
        let mut sets = vec![
            train.as_str(),
            eval.as_str(),
            dump_set.as_str(),
            "data.question_field=prompt",
            "data.answer_field=reward_model.ground_truth",
            "data.num_eval=4",
            "warmup.steps=0",
            "algorithm=grpo",
            "rollout.prompts_per_step=16",
            "rollout.n=2",
            "steps=10",
        ];
        sets.extend_from_slice(extra);
        let (code, stdout, stderr) = run_with_sets(&sets, &dir.path().join(out));
        assert_eq!(code, Some(0), "{stdout}\n{stderr}");
        let (mut from_b, mut total) = (0, 0);
        for entry in std::fs::read_dir(&dump).unwrap() {
            let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
            // One line per completion, G = 2 a prompt.
            for row in text.lines().step_by(2) {
                let row: serde_json::Value = serde_json::from_str(row).unwrap();
                from_b += usize::from(row["data_source"] == "other");
                total += 1;
            }
        }
        assert_eq!(total, 160, "10 steps of 16 prompts");
        from_b as f64 / total as f64
    };
    // Without weights, 160 draws are 3 1/3 epochs of the 48 problems: b's 12 are drawn in
    // each epoch once, so between 36 and 48 times.
    let share = share_of_b(&[], "one_set");
    assert!((36.0..=48.0).contains(&(share * 160.0)), "{share}");
    let share = share_of_b(&["data.train_weights=[1, 3]"], "weighted");
    let se = (0.75f64 * 0.25 / 160.0).sqrt();
    assert!(
        (share - 0.75).abs() < 4.0 * se,
        "{share} of draws from b.jsonl"
    );
    let wrong = [
        train.as_str(),
        eval.as_str(),
        "data.question_field=prompt",
        "data.answer_field=reward_model.ground_truth",
        "data.train_weights=[1, 2, 3]",
    ];
    let (code, _, stderr) = run_with_sets(&wrong, &dir.path().join("wrong"));
    assert_eq!(code, Some(2), "{stderr}");
    assert!(
        stderr.contains("data.train_weights: must have one weight per data.train file (2), got 3"),
        "{stderr}"
    );
}
