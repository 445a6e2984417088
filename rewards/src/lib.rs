//! dppo-rewards: the math verifier. It extracts the final answer of a completion (by
//! [`ExtractMode`]) and compares it with the gold answer by exact value and structure; the
//! training reward adds DAPO's soft overlong penalty.
//!
//! What counts as equal: numbers by exact value (fractions, decimals, scientific notation,
//! thousands separators, mixed numbers, square roots of rationals, rational multiples of
//! powers of pi, complex numbers `a+bi`); numbers in a base (`52_8`) by value; tuples and
//! intervals item by item; sets of solutions (`1, -2`, `\{..\}`, `\pm`) and unions of
//! intervals in any order; the variable of an equation (`x = 5`), `\text{}` units, `\$`,
//! percent and degree signs are ignored.
//!
//! Limits, each a possible false negative and never a false positive: expressions with
//! variables, functions (`\sin`, `\log`, `e`), cube roots and nested radicals such as
//! `\sqrt{2+\sqrt{3}}` compare as cleaned text; a division by a sum of more than two
//! radical terms is not evaluated; integers beyond `i128` are text. Two readings are
//! conventions: `2\frac{1}{2}` is the mixed number 5/2, and `1,000` is one thousand
//! (every group after the first of three digits), not the list 1, 0.
//!
//! No crate fits: symbolica is a CAS under a non-open licence, exmex evaluates in floating
//! point (unsound for equality), savage (AGPL) and cas-rs are REPLs, and mathlex only parses
//! LaTeX to an AST without evaluating it.

mod answer;
mod extract;
mod normalise;
mod parse;
mod value;

use serde::{Deserialize, Serialize};

pub use answer::{equivalent, Answer};
pub use extract::{extract, ExtractMode, Extracted, Rule, UnknownMode};
pub use value::{Number, Rational};

/// A gold answer that cannot be understood: an error at load time, never a free reward.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unparseable gold answer {0:?}")]
pub struct BadGold(pub String);

/// Parses a gold answer (`#### 1,234` GSM8K style, or a MATH answer such as `\frac{3}{4}`).
pub fn parse_gold(gold: &str) -> Result<Answer, BadGold> {
    let raw = gold.rfind("####").map_or(gold, |at| &gold[at + 4..]);
    match Answer::parse(raw) {
        Answer::Text(t) if t.is_empty() => Err(BadGold(gold.to_string())),
        answer => Ok(answer),
    }
}

/// The verifier's judgement of one completion.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    pub is_correct: bool,
    /// The rule that found the final answer; `None` when no rule found one.
    pub extracted_by: Option<Rule>,
}

/// Judges `text` against `gold` under `mode`; `is_truncated` when the completion ended on
/// the token limit (then only an answer complete before the cut counts).
pub fn verify(text: &str, is_truncated: bool, gold: &Answer, mode: ExtractMode) -> Verdict {
    match extract(text, mode, is_truncated) {
        Some(e) => Verdict {
            is_correct: equivalent(&Answer::parse(e.answer), gold),
            extracted_by: Some(e.rule),
        },
        None => Verdict {
            is_correct: false,
            extracted_by: None,
        },
    }
}

/// The name of a verdict's rule in metrics and sample files (`none` when nothing was found).
pub fn rule_name(rule: Option<Rule>) -> &'static str {
    rule.map_or("none", Rule::name)
}

/// `[reward]`: how completions are scored in training.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardConfig {
    /// The extraction mode; when absent, `strict` for JSONL data and `answer` for the
    /// built-in tasks (the trainer's `data::default_extract_mode`).
    #[serde(default)]
    pub extract: Option<ExtractMode>,
    /// DAPO's soft overlong penalty: the last this many tokens before
    /// `rollout.max_response_len` cost up to `overlong_penalty`, linearly (0: off).
    #[serde(default)]
    pub overlong_buffer: usize,
    /// The penalty at the token limit (DAPO's `overlong_penalty_factor`).
    #[serde(default = "default_overlong_penalty")]
    pub overlong_penalty: f64,
}

fn default_overlong_penalty() -> f64 {
    1.0
}

impl Default for RewardConfig {
    fn default() -> Self {
        Self {
            extract: None,
            overlong_buffer: 0,
            overlong_penalty: default_overlong_penalty(),
        }
    }
}

/// Everything a training reward depends on besides the completion and its gold answer.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RewardSpec {
    pub mode: ExtractMode,
    /// The token limit of a completion (`rollout.max_response_len`).
    pub max_tokens: usize,
    pub overlong_buffer: usize,
    pub overlong_penalty: f64,
}

/// A completion that cannot have come from the rollout it is scored for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RewardError {
    #[error("a completion of {num_tokens} tokens exceeds the token limit of {max_tokens}")]
    TooLong {
        num_tokens: usize,
        max_tokens: usize,
    },
}

/// DAPO's soft overlong penalty (verl's `overlong_buffer`): 0 up to `max_tokens - buffer`
/// tokens, then falling linearly to `-overlong_penalty` at `max_tokens`.
pub fn overlong_penalty(num_tokens: usize, spec: &RewardSpec) -> Result<f64, RewardError> {
    if num_tokens > spec.max_tokens {
        return Err(RewardError::TooLong {
            num_tokens,
            max_tokens: spec.max_tokens,
        });
    }
    if spec.overlong_buffer == 0 {
        return Ok(0.0);
    }
    let expected = spec.max_tokens.saturating_sub(spec.overlong_buffer);
    let exceed = num_tokens.saturating_sub(expected) as f64;
    Ok(-exceed / spec.overlong_buffer as f64 * spec.overlong_penalty)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn correct(text: &str, gold: &str, mode: ExtractMode, is_truncated: bool) -> bool {
        let gold = parse_gold(gold).unwrap_or_else(|e| panic!("{e}"));
        verify(text, is_truncated, &gold, mode).is_correct
    }

    /// A truncated ramble that happens to mention the gold number is no answer: `flexible`
    /// takes no last-number fallback.
    #[test]
    fn issue_21_a_truncated_ramble_that_mentions_the_gold_scores_zero() {
        let completion = "Let me compute step by step.\nSo, the final answer is 84.\n\n\
            ```python\n# Verify: the count should be 284 if we include";
        for mode in [
            ExtractMode::Strict,
            ExtractMode::Boxed,
            ExtractMode::Flexible,
        ] {
            let gold = parse_gold("284").unwrap();
            let verdict = verify(completion, true, &gold, mode);
            assert!(!verdict.is_correct, "{mode}");
            let spec = RewardSpec {
                mode,
                max_tokens: 400,
                overlong_buffer: 0,
                overlong_penalty: 1.0,
            };
            assert_eq!(overlong_penalty(400, &spec).unwrap(), 0.0, "{mode}");
        }
        let verdict = verify(
            completion,
            true,
            &parse_gold("84").unwrap(),
            ExtractMode::Flexible,
        );
        assert_eq!(
            verdict.extracted_by,
            Some(Rule::Phrase),
            "the phrase rule reads 84"
        );
    }

    #[test]
    fn truncated_completions_count_only_answers_complete_before_the_cut() {
        use ExtractMode::*;
        // (completion, mode, gold, correct when truncated, correct when finished)
        let cases = [
            ("so \\boxed{42} and then more tal", Boxed, "42", true, true),
            ("\\boxed{42} then \\boxed{4", Boxed, "42", true, true),
            ("\\boxed{42} then \\boxed{4", Strict, "42", true, true),
            (
                "the result is \\boxed{\\frac{1}{2",
                Boxed,
                "\\frac12",
                false,
                false,
            ),
            (
                "the result is \\boxed{\\frac{1}{2",
                Flexible,
                "2",
                false,
                true,
            ),
            ("#### 72\nmore", Strict, "72", true, true),
            ("#### 72", Strict, "72", false, true),
            ("#### 72", Boxed, "72", false, false),
            ("#### 72\n#### Check\nok\n", Strict, "72", true, true),
            ("The answer is 15.\nBut", Flexible, "15", true, true),
            ("The answer is 15", Flexible, "15", false, true),
            ("3 + 4 = 7", Flexible, "7", false, true),
            ("3 + 4 = 7", Strict, "7", false, false),
            ("Answer: 42<", Answer, "42", true, true),
            ("Answer: 42", Answer, "42", false, true),
            ("Answer: 4", Answer, "42", false, false),
        ];
        for (text, mode, gold, truncated, finished) in cases {
            assert_eq!(
                correct(text, gold, mode, true),
                truncated,
                "{text:?} {mode} cut"
            );
            assert_eq!(
                correct(text, gold, mode, false),
                finished,
                "{text:?} {mode}"
            );
        }
    }

    #[test]
    fn phrase_rules_take_the_last_phrase_and_only_in_flexible() {
        use ExtractMode::*;
        let cases = [
            ("The answer is 15.", "15"),
            ("Therefore the answer is: 3/4", "0.75"),
            ("So, the final answer is 84. Let me check: 284", "84"),
            ("**Final Answer:** $\\frac{1}{2}$", "0.5"),
            ("The answer is 3. No wait, the final answer is 4.", "4"),
            ("THE ANSWER IS 7", "7"),
        ];
        for (text, gold) in cases {
            assert!(correct(text, gold, Flexible, false), "{text:?}");
            assert!(!correct(text, gold, Strict, false), "{text:?} strict");
        }
        let text = "so the final answer is 84. Let me check: 284";
        let verdict = verify(text, false, &parse_gold("284").unwrap(), Flexible);
        assert_eq!(
            (verdict.is_correct, verdict.extracted_by),
            (false, Some(Rule::Phrase))
        );
    }

    #[test]
    fn the_answer_format_reads_the_number_after_the_last_answer_label() {
        let gold = parse_gold("-13").unwrap();
        for (text, want) in [
            ("Answer: -13", true),
            ("Answer: 5\nAnswer: -13", true),
            ("Answer: -13\nAnswer: 5", false),
            ("Answer: -130", false),
            ("-13", false),
            ("\\boxed{-13}", false),
        ] {
            let verdict = verify(text, false, &gold, ExtractMode::Answer);
            assert_eq!(verdict.is_correct, want, "{text:?}");
        }
    }

    #[test]
    fn overlong_penalty_is_linear_over_the_buffer() {
        let spec = RewardSpec {
            mode: ExtractMode::Boxed,
            max_tokens: 100,
            overlong_buffer: 20,
            overlong_penalty: 0.5,
        };
        for (tokens, want) in [(10, 0.0), (80, 0.0), (90, -0.25), (100, -0.5)] {
            assert_eq!(overlong_penalty(tokens, &spec).unwrap(), want, "{tokens}");
        }
        let verdict = verify("\\boxed{3}", false, &parse_gold("3").unwrap(), spec.mode);
        let reward = f64::from(u8::from(verdict.is_correct)) + overlong_penalty(90, &spec).unwrap();
        assert_eq!(reward, 0.75);
        let err = overlong_penalty(101, &spec).unwrap_err().to_string();
        assert!(
            err.contains("101 tokens exceeds the token limit of 100"),
            "{err}"
        );
    }

    #[test]
    fn unparseable_gold_is_an_error() {
        assert!(parse_gold("").is_err());
        assert!(parse_gold("#### ").is_err());
        assert!(parse_gold("$$").is_err());
    }

    #[test]
    fn normal_form_prints_lowest_terms_and_reparses_to_itself() {
        for (gold, printed) in [
            ("\\frac{6}{8}", "3/4"),
            ("#### -1,234", "-1234"),
            ("0.50", "1/2"),
            ("\\text{blue}", "blue"),
            ("\\sqrt{117}", "3\\sqrt{13}"),
            ("3, 1", "\\{3,1\\}"),
        ] {
            let answer = parse_gold(gold).unwrap();
            assert_eq!(answer.to_string(), printed, "{gold}");
            assert_eq!(parse_gold(printed).unwrap(), answer, "{gold}");
        }
    }
}
