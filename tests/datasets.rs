//! Datasets in the formats people have (issue #40): verl's schema as JSONL, read through
//! dotted field paths, trains; data without demonstrations and a warm-up is a clear error.

use serde_json::json;

use crate::util::run_dppo;

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
    let data = [
        format!("data.train={}", train.display()),
        format!("data.eval={}", eval.display()),
        "data.question_field=prompt".to_string(),
        "data.answer_field=reward_model.ground_truth".to_string(),
        "data.num_eval=16".to_string(),
        "steps=2".to_string(),
    ];
    let run = |extra: &[&str], out: &str| {
        let mut args = vec!["run".to_string()];
        for set in data.iter().map(String::as_str).chain(extra.iter().copied()) {
            args.push("--set".into());
            args.push(set.into());
        }
        args.extend(["--out".into(), dir.path().join(out).display().to_string()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_dppo(&args)
    };
    let (code, stdout, stderr) = run(&["warmup.steps=0"], "ok");
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    let lines = std::fs::read_to_string(dir.path().join("ok/metrics.jsonl")).unwrap();
    assert_eq!(
        lines.lines().filter(|l| l.contains("\"step\"")).count(),
        2,
        "{lines}"
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
