//! Datasets in the formats people have (issue #40): verl's schema as JSONL, read through
//! dotted field paths, trains; data without demonstrations and a warm-up is a clear error.

use serde_json::json;

use crate::util::{metrics_lines, run_with_sets};

/// Writes `n` verl rows of two-digit sums (system and user messages, the answer nested in
/// `reward_model`) to `path`.
fn verl_file(path: &std::path::Path, n: usize, first: usize) {
    let rows: Vec<String> = (first..first + n)
        .map(|i| {
            let (a, b) = (10 + i % 80, 11 + (i * 7) % 80);
            json!({
                "data_source": "arithmetic",
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
    let (code, stdout, stderr) = run(&["warmup.steps=0"], "ok");
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    let steps = metrics_lines(&dir.path().join("ok"));
    assert_eq!(steps.iter().filter(|l| l.get("step").is_some()).count(), 2);
    let (code, _, stderr) = run(&[], "refused");
    assert_ne!(code, Some(0));
    assert!(
        stderr.contains("warmup.steps = 1000 trains on demonstrations")
            && stderr.contains("train.jsonl has none")
            && stderr.contains("set warmup.steps = 0"),
        "{stderr}"
    );
}
