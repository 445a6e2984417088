//! The equivalence table (`data/equivalence.tsv`): gold answers of MATH-500 and OlympiadBench
//! (a few of Minerva math) against rewritten forms (must match) and near misses (must not),
//! each boxed and scored in every extraction mode that reads `\boxed{}`.

use dppo_rewards::{parse_gold, verify, ExtractMode};

/// One row per line: gold answer as the data set writes it, a model's answer, and whether
/// they are equivalent, separated by tabs; `#` starts a comment line.
const TABLE: &str = include_str!("data/equivalence.tsv");

/// The rows of [`TABLE`] as (gold, candidate, equivalent).
fn pairs() -> Vec<(&'static str, &'static str, bool)> {
    TABLE
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.is_empty() && !line.starts_with('#'))
        .map(|(i, line)| {
            let fields: Vec<&str> = line.split('\t').collect();
            let [gold, candidate, want] = fields[..] else {
                panic!("equivalence.tsv:{}: expected 3 tab-separated fields", i + 1);
            };
            let want = want
                .parse()
                .unwrap_or_else(|e| panic!("equivalence.tsv:{}: {want:?}: {e}", i + 1));
            (gold, candidate, want)
        })
        .collect()
}

#[test]
fn the_equivalence_table_holds_in_every_boxed_mode() {
    let pairs = pairs();
    assert_eq!(pairs.len(), 150, "rows of equivalence.tsv");
    let (mut same, mut different) = (0, 0);
    for (gold, candidate, want) in pairs {
        let gold_answer = parse_gold(gold).unwrap_or_else(|e| panic!("{e}"));
        let completion = format!("Reasoning. The result is \\boxed{{{candidate}}}.");
        for mode in [
            ExtractMode::Boxed,
            ExtractMode::Strict,
            ExtractMode::Flexible,
        ] {
            let verdict = verify(&completion, false, &gold_answer, mode);
            assert_eq!(
                verdict.is_correct, want,
                "{candidate:?} vs gold {gold:?} ({mode}): gold parsed as {gold_answer}"
            );
        }
        if want {
            same += 1;
        } else {
            different += 1;
        }
    }
    assert!(
        same >= 50 && different >= 40,
        "{same} equivalent, {different} not"
    );
}
