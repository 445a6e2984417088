//! The structure of an answer (a number, a number in a base, a tuple or interval, a set of
//! solutions, a union of intervals, or text) and when two answers are equivalent.

use std::collections::BTreeSet;

use crate::normalise::{assigned_variable, clean, is_wrapped, split_top, strip_variable};
use crate::parse::number;
use crate::value::{Number, Rational};

/// Answers longer than this (cleaned) compare as text: no gold answer of the shipped data
/// comes near (the longest has about 210 characters), and it bounds the recursion depth.
pub const MAX_STRUCTURED_LEN: usize = 1024;

/// A parsed answer; compare two with [`equivalent`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// An exact number (see [`crate::value`]).
    Number(Number),
    /// `52_8`: digits in a base from 2 to 36.
    Based { digits: String, base: u32 },
    /// `(3, \pi)`, `[1, 2)`: ordered items between brackets (points, tuples, intervals).
    Bracketed {
        open: char,
        close: char,
        items: Vec<Answer>,
    },
    /// Solutions in any order: `1, -2`, `\{1, 2\}`, `1 \pm \sqrt{19}` (two or more).
    Set(Vec<Answer>),
    /// `(0,9) \cup (9,36)`: its parts in any order.
    Union(Vec<Answer>),
    /// Anything else, as cleaned text (expressions with variables, names, matrices).
    Text(String),
}

impl Answer {
    /// Reads `raw` (a boxed answer, a gold answer) into its structure; one longer than
    /// [`MAX_STRUCTURED_LEN`] stays text (parsing recurses once per bracket).
    pub fn parse(raw: &str) -> Self {
        let cleaned = clean(raw);
        if cleaned.len() > MAX_STRUCTURED_LEN {
            return Answer::Text(cleaned);
        }
        Self::from_clean(&cleaned)
    }

    fn from_clean(s: &str) -> Self {
        let s = strip_variable(s);
        if let Some(n) = thousands(s).or_else(|| number(s)) {
            return Answer::Number(n);
        }
        let parts = split_top(s, "\\cup");
        if parts.len() > 1 {
            return Answer::Union(parts.into_iter().map(Self::from_clean).collect());
        }
        if let Some(inner) = s.strip_prefix("\\{").and_then(|r| r.strip_suffix("\\}")) {
            if is_wrapped(&s[1..]) {
                return Self::set(split_top(inner, ","));
            }
        }
        if let Some(bracketed) = Self::bracketed(s) {
            return bracketed;
        }
        let items = split_top(s, ",");
        if items.len() > 1 {
            return Self::set(items);
        }
        if let [a, b] = split_top(s, "\\pm")[..] {
            return Self::set(vec![&format!("{a}+{b}"), &format!("{a}-{b}")]);
        }
        based(s).unwrap_or_else(|| Answer::Text(s.to_string()))
    }

    /// `(…)`/`[…]` around comma-separated items; `(x)` alone is `x` (`(C)` is `C`).
    fn bracketed(s: &str) -> Option<Self> {
        let open = s.chars().next().filter(|c| matches!(c, '(' | '['))?;
        let close = s.chars().last().filter(|c| matches!(c, ')' | ']'))?;
        if !is_wrapped(s) {
            return None;
        }
        let inner = &s[1..s.len() - 1];
        let items = split_top(inner, ",");
        if open == '(' && close == ')' && items.len() == 1 {
            return Some(Self::from_clean(inner));
        }
        let items = items.into_iter().map(Self::from_clean).collect();
        Some(Answer::Bracketed { open, close, items })
    }

    /// A set of the items (sets among them, from `\pm`, flattened); one item is itself.
    /// Items that assign different variables (`x=1, y=2`) keep their equations, so that
    /// `x=2, y=1` differs.
    fn set<S: AsRef<str>>(items: Vec<S>) -> Self {
        let names: BTreeSet<&str> = items
            .iter()
            .filter_map(|i| assigned_variable(i.as_ref()))
            .collect();
        let mut out = Vec::new();
        for item in &items {
            let item = item.as_ref();
            let answer = if names.len() > 1 && assigned_variable(item).is_some() {
                Answer::Text(item.to_string())
            } else {
                Self::from_clean(item)
            };
            match answer {
                Answer::Set(inner) => out.extend(inner),
                other => out.push(other),
            }
        }
        if out.len() == 1 {
            out.pop().expect("one item")
        } else {
            Answer::Set(out)
        }
    }
}

/// `1,234,567.5`: a number with thousands separators (every group after the first has
/// exactly three digits, so that `1,2` stays a list of two).
fn thousands(s: &str) -> Option<Number> {
    let int = s.split_once('.').map_or(s, |(int, _)| int);
    let groups: Vec<&str> = int.strip_prefix('-').unwrap_or(int).split(',').collect();
    let grouped = groups.len() >= 2
        && (1..=3).contains(&groups[0].len())
        && groups[1..].iter().all(|g| g.len() == 3)
        && groups.iter().all(|g| g.bytes().all(|b| b.is_ascii_digit()));
    grouped.then(|| number(&s.replace(',', ""))).flatten()
}

/// `52_8`, `4210_{5}`: digits valid in a base from 2 to 36.
fn based(s: &str) -> Option<Answer> {
    let (digits, base) = s.split_once('_')?;
    let base: u32 = base
        .trim_start_matches('{')
        .trim_end_matches('}')
        .parse()
        .ok()?;
    let valid =
        (2..=36).contains(&base) && !digits.is_empty() && digits.chars().all(|c| c.is_digit(base));
    valid.then(|| Answer::Based {
        digits: digits.to_string(),
        base,
    })
}

/// Whether `a` and `b` are the same answer: numbers by exact value, numbers in a base by
/// value (or the same digits written without the base), brackets item by item, sets and
/// unions in any order, text exactly.
pub fn equivalent(a: &Answer, b: &Answer) -> bool {
    use Answer::*;
    match (a, b) {
        (Number(x), Number(y)) => x == y,
        (Based { .. }, Based { .. }) => {
            based_value(a).is_some() && based_value(a) == based_value(b)
        }
        (Based { digits, .. }, Number(n)) | (Number(n), Based { digits, .. }) => {
            let written = digits.parse::<i128>().ok().map(Rational::integer);
            written.is_some() && n.as_rational() == written
        }
        (
            Bracketed {
                open: o1,
                close: c1,
                items: x,
            },
            Bracketed {
                open: o2,
                close: c2,
                items: y,
            },
        ) => {
            (o1, c1) == (o2, c2)
                && x.len() == y.len()
                && x.iter().zip(y).all(|(p, q)| equivalent(p, q))
        }
        (Set(x), Set(y)) | (Union(x), Union(y)) => {
            let covers =
                |p: &[Answer], q: &[Answer]| p.iter().all(|u| q.iter().any(|v| equivalent(u, v)));
            covers(x, y) && covers(y, x)
        }
        (Text(x), Text(y)) => x == y,
        _ => false,
    }
}

fn based_value(a: &Answer) -> Option<u128> {
    match a {
        Answer::Based { digits, base } => u128::from_str_radix(digits, *base).ok(),
        _ => None,
    }
}

/// The normal form, which [`Answer::parse`] reads back to an equal answer: `3/4`,
/// `3\sqrt{13}`, `52_8`, `(3,\frac{1}{2}\pi)`, `\{1,-2\}`, `(0,9)\cup(9,36)`, text.
impl std::fmt::Display for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let join = |items: &[Answer], sep: &str| {
            items
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(sep)
        };
        match self {
            Answer::Number(n) => write!(f, "{n}"),
            Answer::Based { digits, base } => write!(f, "{digits}_{base}"),
            Answer::Bracketed { open, close, items } => {
                write!(f, "{open}{}{close}", join(items, ","))
            }
            Answer::Set(items) => write!(f, "\\{{{}\\}}", join(items, ",")),
            Answer::Union(items) => f.write_str(&join(items, "\\cup")),
            Answer::Text(t) => f.write_str(t),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn structures_are_recognised() {
        for (input, want) in [
            (
                "\\left( 3, \\frac{\\pi}{2} \\right)",
                "(3,\\frac{1}{2}\\pi)",
            ),
            ("(3,4]", "(3,4]"),
            ("1 \\pm \\sqrt{19}", "\\{1+\\sqrt{19},1-\\sqrt{19}\\}"),
            (
                "\\{1\\pm\\sqrt{5},-2\\}",
                "\\{1+\\sqrt{5},1-\\sqrt{5},-2\\}",
            ),
            ("(0,9) \\cup (9,36)", "(0,9)\\cup(9,36)"),
            ("4210_{5}", "4210_5"),
            ("E_{1}", "E_{1}"),
            ("\\text{(C)}", "C"),
            ("11,\\! 111,\\! 111,\\! 100", "11111111100"),
            ("2500,7500", "\\{2500,7500\\}"),
            ("(9,360)", "(9,360)"),
            ("a=2, a=-6-4 \\sqrt{2}", "\\{2,-6-4\\sqrt{2}\\}"),
            ("x \\in [-2,7]", "[-2,7]"),
            ("x=1, y=2", "\\{x=1,y=2\\}"),
        ] {
            let answer = Answer::parse(input);
            assert_eq!(answer.to_string(), want, "{input}");
            assert_eq!(Answer::parse(want), answer, "{input} reparsed");
        }
    }

    #[test]
    fn solutions_naming_different_variables_keep_their_names() {
        let gold = Answer::parse("x=1, y=2");
        assert!(equivalent(&Answer::parse("y=2, x=1"), &gold));
        assert!(!equivalent(&Answer::parse("x=2, y=1"), &gold));
        assert!(equivalent(
            &Answer::parse("x=2, x=1"),
            &Answer::parse("1, 2")
        ));
    }

    #[test]
    fn deep_nesting_parses_within_a_test_thread_stack_and_stays_text_beyond_the_limit() {
        let nested = |depth: usize| format!("{}1{}", "(".repeat(depth), ")".repeat(depth));
        let one = Answer::parse("1");
        assert!(equivalent(&Answer::parse(&nested(500)), &one));
        assert_eq!(Answer::parse(&nested(600)), Answer::Text(nested(600)));
    }
}
