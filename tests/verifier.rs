//! The verifier on the shipped data sets: every gold answer parses and scores.

/// The real data sets shipped in the repository.
fn data_dir() -> std::path::PathBuf {
    crate::util::repo_root().join("data")
}

/// Every gold answer of the shipped data sets, as (`file:line`, raw answer).
fn gold_answers() -> Vec<(String, String)> {
    let files = [
        "gsm8k/train.jsonl",
        "gsm8k/test.jsonl",
        "eval/math500.jsonl",
        "eval/aime24.jsonl",
        "eval/aime25.jsonl",
        "eval/amc2023.jsonl",
        "eval/minervamath.jsonl",
        "eval/olympiadbench.jsonl",
    ];
    let mut out = Vec::new();
    for file in files {
        let path = data_dir().join(file);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for (line_no, line) in text.lines().enumerate() {
            let row: serde_json::Value = serde_json::from_str(line).unwrap();
            let raw = row["answer"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| row["answer"].to_string());
            out.push((format!("{file}:{}", line_no + 1), raw));
        }
    }
    out
}

/// Every gold answer of the real data sets parses, and a completion boxing it scores 1 in
/// every mode that reads `\boxed{}`.
#[test]
fn verifier_accepts_every_real_gold_answer() {
    use dppo_rewards::{equivalent, parse_gold, verify, ExtractMode};
    let golds = gold_answers();
    assert!(golds.len() > 10_000, "{} gold answers", golds.len());
    for (at, raw) in golds {
        let gold = parse_gold(&raw).unwrap_or_else(|e| panic!("{at}: {e}"));
        // `dppo score` reads gold answers back from the normal form `--samples` writes.
        let again = parse_gold(&gold.to_string()).unwrap_or_else(|e| panic!("{at}: {e}"));
        assert!(
            equivalent(&again, &gold),
            "{at}: {gold} reads back as {again}"
        );
        let final_answer = raw.rsplit("####").next().unwrap().trim();
        let completion = format!("Reasoning... so the result is \\boxed{{{final_answer}}}.");
        for mode in [
            ExtractMode::Boxed,
            ExtractMode::Strict,
            ExtractMode::Flexible,
        ] {
            let verdict = verify(&completion, false, &gold, mode);
            assert!(
                verdict.is_correct,
                "{at} ({mode}): {raw:?} parsed as {gold}"
            );
        }
    }
}
