//! Where a completion states its final answer: the rules, and the extraction modes that
//! chain them (named as verl names its GSM8K modes).

use serde::{Deserialize, Serialize};

use crate::normalise::matching_brace;

/// Which rules may find the final answer (`reward.extract`, `dppo eval --extract`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExtractMode {
    /// The last complete `\boxed{}` only (MATH-style data).
    Boxed,
    /// The last complete `\boxed{}`, else a `#### n` line.
    #[default]
    Strict,
    /// `strict`'s rules, then "the final answer is"/"final answer:"/"the answer is", then
    /// the last number anywhere (the last only when the completion was not truncated).
    Flexible,
    /// `Answer: N` (the built-in arithmetic task's format).
    Answer,
}

/// An extraction mode name that does not exist.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown extraction mode {0:?} (expected boxed, strict, flexible or answer)")]
pub struct UnknownMode(pub String);

impl std::str::FromStr for ExtractMode {
    type Err = UnknownMode;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "boxed" => Ok(Self::Boxed),
            "strict" => Ok(Self::Strict),
            "flexible" => Ok(Self::Flexible),
            "answer" => Ok(Self::Answer),
            other => Err(UnknownMode(other.to_string())),
        }
    }
}

impl std::fmt::Display for ExtractMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Boxed => "boxed",
            Self::Strict => "strict",
            Self::Flexible => "flexible",
            Self::Answer => "answer",
        })
    }
}

impl ExtractMode {
    /// The rules this mode tries, in order.
    fn rules(self) -> &'static [Rule] {
        match self {
            Self::Boxed => &[Rule::Boxed],
            Self::Strict => &[Rule::Boxed, Rule::Hashes],
            Self::Flexible => &[Rule::Boxed, Rule::Hashes, Rule::Phrase, Rule::LastNumber],
            Self::Answer => &[Rule::AnswerLine],
        }
    }
}

/// The rule that found a completion's final answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Rule {
    /// The last `\boxed{...}` or `\fbox{...}` whose braces close.
    Boxed,
    /// The line after the last `####` (GSM8K) that is not a Markdown heading.
    Hashes,
    /// The number after the last `Answer:`.
    AnswerLine,
    /// The line after the last "the final answer is", "final answer:" or "the answer is".
    Phrase,
    /// The last number anywhere.
    LastNumber,
}

impl Rule {
    /// The rule's name in metrics (`reward/extracted_by/<name>`) and sample files.
    pub fn name(self) -> &'static str {
        match self {
            Self::Boxed => "boxed",
            Self::Hashes => "hashes",
            Self::AnswerLine => "answer_line",
            Self::Phrase => "phrase",
            Self::LastNumber => "last_number",
        }
    }

    /// The answer this rule finds in `text`. A truncated completion (cut by the token
    /// limit) only counts an answer that is complete before the cut: a `\boxed{}` whose
    /// braces close, a `####`/phrase line ended by a line break, an `Answer:` number
    /// followed by something; never the last number.
    fn find(self, text: &str, is_truncated: bool) -> Option<&str> {
        let answer = match self {
            Rule::Boxed => last_boxed(text)?,
            Rule::Hashes => whole_line(after_last_hashes(text)?, is_truncated)?.trim(),
            Rule::AnswerLine => {
                let rest = text[text.rfind("Answer:")? + 7..].trim_start_matches(' ');
                let len = number_len(rest)?;
                if is_truncated && len == rest.len() {
                    return None;
                }
                &rest[..len]
            }
            Rule::Phrase => {
                let line = whole_line(after_last_phrase(text)?, is_truncated)?;
                let line = line.trim_start_matches([':', ' ', '*', '$']);
                let sentence = line.split(". ").next().unwrap_or(line);
                sentence.trim_end_matches(['.', ' ', '*', '$'])
            }
            Rule::LastNumber if is_truncated => return None,
            Rule::LastNumber => last_number(text)?,
        };
        (!answer.is_empty() || self == Rule::Boxed).then_some(answer)
    }
}

/// `rest` up to its first line break; all of it only when the completion was not cut.
fn whole_line(rest: &str, is_truncated: bool) -> Option<&str> {
    match rest.find('\n') {
        Some(end) => Some(&rest[..end]),
        None => (!is_truncated).then_some(rest),
    }
}

/// The final answer of a completion and the rule that found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extracted<'a> {
    pub answer: &'a str,
    pub rule: Rule,
}

/// The final answer of `text` under `mode`: the first of the mode's rules that finds one.
pub fn extract(text: &str, mode: ExtractMode, is_truncated: bool) -> Option<Extracted<'_>> {
    mode.rules().iter().find_map(|&rule| {
        let answer = rule.find(text, is_truncated)?;
        Some(Extracted { answer, rule })
    })
}

/// The content of the last `\boxed{...}`/`\fbox{...}` whose braces close (an unclosed one
/// after it, cut by the token limit, does not hide it).
fn last_boxed(text: &str) -> Option<&str> {
    let mut best: Option<(usize, &str)> = None;
    for cmd in ["\\boxed", "\\fbox"] {
        for (at, _) in text.match_indices(cmd) {
            let open = at + cmd.len();
            let open = open + (text[open..].len() - text[open..].trim_start().len());
            if !text[open..].starts_with('{') {
                continue;
            }
            if let Some(end) = matching_brace(text, open) {
                if best.is_none_or(|(b, _)| at > b) {
                    best = Some((at, &text[open + 1..end - 1]));
                }
            }
        }
    }
    best.map(|(_, content)| content)
}

/// The text after the last `####` that is not a Markdown heading (`#### Step 1`).
fn after_last_hashes(text: &str) -> Option<&str> {
    text.rmatch_indices("####")
        .map(|(at, _)| text[at + 4..].trim_start_matches('#'))
        .find(|rest| {
            !rest
                .trim_start()
                .starts_with(|c: char| c.is_ascii_alphabetic())
        })
}

const PHRASES: [&str; 3] = ["the final answer is", "final answer:", "the answer is"];

/// The text after the last of [`PHRASES`] (case-insensitive).
fn after_last_phrase(text: &str) -> Option<&str> {
    // ASCII lowercase keeps byte offsets, so they index `text` too.
    let lower = text.to_ascii_lowercase();
    PHRASES
        .iter()
        .filter_map(|p| lower.rfind(p).map(|at| (at, at + p.len())))
        .max()
        .map(|(_, end)| &text[end..])
}

/// The length of a signed integer at the start of `s`.
fn number_len(s: &str) -> Option<usize> {
    let sign = usize::from(s.starts_with('-'));
    let digits = s[sign..].bytes().take_while(u8::is_ascii_digit).count();
    (digits > 0).then_some(sign + digits)
}

/// The last number-looking token (`-1,234.5`, `3/4`).
fn last_number(text: &str) -> Option<&str> {
    let bytes = text.as_bytes();
    let mut best = None;
    let mut i = 0;
    while i < bytes.len() {
        let starts = bytes[i].is_ascii_digit()
            || (bytes[i] == b'-' && bytes.get(i + 1).is_some_and(u8::is_ascii_digit));
        if !starts {
            i += 1;
            continue;
        }
        let begin = i;
        i += 1;
        while i < bytes.len()
            && (bytes[i].is_ascii_digit()
                || (matches!(bytes[i], b',' | b'.' | b'/')
                    && bytes.get(i + 1).is_some_and(u8::is_ascii_digit)))
        {
            i += 1;
        }
        best = Some(&text[begin..i]);
    }
    best
}
