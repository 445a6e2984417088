//! Verifiers: extract the final answer of a completion and compare it with the gold answer.
//! Numbers compare as exact rationals (fractions, decimals, thousands separators, signs,
//! LaTeX wrappers and units stripped); anything else compares as normalised text.

/// A gold answer that cannot be understood: an error at load time, never a free reward.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unparseable gold answer {0:?}")]
pub struct BadGold(pub String);

/// An exact rational `num / den` with `den > 0`, reduced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rational {
    num: i128,
    den: i128,
}

impl Rational {
    fn new(num: i128, den: i128) -> Option<Self> {
        if den == 0 {
            return None;
        }
        let g = gcd(num.unsigned_abs(), den.unsigned_abs()).max(1) as i128;
        let sign = if den < 0 { -1 } else { 1 };
        Some(Self {
            num: sign * num / g,
            den: sign * den / g,
        })
    }
}

fn gcd(a: u128, b: u128) -> u128 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// A normalised answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    Number(Rational),
    Text(String),
}

/// The normal form: `n` or `n/d` (lowest terms) for a number, the text otherwise.
impl std::fmt::Display for Answer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Answer::Number(Rational { num, den: 1 }) => write!(f, "{num}"),
            Answer::Number(Rational { num, den }) => write!(f, "{num}/{den}"),
            Answer::Text(t) => f.write_str(t),
        }
    }
}

/// Parses a gold answer (`#### 1,234` GSM8K style, or a MATH answer such as `\frac{3}{4}`).
pub fn parse_gold(gold: &str) -> Result<Answer, BadGold> {
    let raw = match gold.rfind("####") {
        Some(at) => &gold[at + 4..],
        None => gold,
    };
    let answer = normalise(raw);
    match &answer {
        Answer::Text(t) if t.is_empty() => Err(BadGold(gold.to_string())),
        _ => Ok(answer),
    }
}

/// Reward 1 when the completion's final answer equals `gold`, else 0.
pub fn score(completion: &str, gold: &Answer) -> f64 {
    match extract_answer(completion) {
        Some(pred) if normalise(&pred) == *gold => 1.0,
        _ => 0.0,
    }
}

/// The final answer of a completion: the last `\boxed{...}` (braces matched), else what
/// follows the last `####`, else what follows "the answer is", else the last number.
pub fn extract_answer(text: &str) -> Option<String> {
    if let Some(boxed) = last_boxed(text) {
        return Some(boxed);
    }
    if let Some(at) = text.rfind("####") {
        return Some(first_line(&text[at + 4..]));
    }
    let lower = text.to_lowercase();
    if let Some(at) = lower.rfind("the answer is") {
        let rest = &text[at + "the answer is".len()..];
        let rest = rest.trim_start_matches([':', ' ']);
        return Some(first_line(rest).trim_end_matches('.').to_string());
    }
    last_number(text)
}

fn first_line(s: &str) -> String {
    s.trim().lines().next().unwrap_or("").trim().to_string()
}

/// Contents of the last `\boxed{...}` or `\fbox{...}`, with nested braces matched.
fn last_boxed(text: &str) -> Option<String> {
    let start = text.rfind("\\boxed").or_else(|| text.rfind("\\fbox"))?;
    let open = start + text[start..].find('{')?;
    let mut depth = 0;
    for (i, c) in text[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(text[open + 1..open + i].to_string());
                }
            }
            _ => {}
        }
    }
    None
}

/// The last number-looking token (`-1,234.5`, `3/4`).
fn last_number(text: &str) -> Option<String> {
    let mut best = None;
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let starts = chars[i].is_ascii_digit()
            || (chars[i] == '-' && chars.get(i + 1).is_some_and(|c| c.is_ascii_digit()));
        if starts {
            let begin = i;
            i += 1;
            while i < chars.len()
                && (chars[i].is_ascii_digit()
                    || (matches!(chars[i], ',' | '.' | '/')
                        && chars.get(i + 1).is_some_and(|c| c.is_ascii_digit())))
            {
                i += 1;
            }
            best = Some(chars[begin..i].iter().collect());
        } else {
            i += 1;
        }
    }
    best
}

/// Strips LaTeX wrappers, units and spacing; numbers become exact rationals.
pub fn normalise(s: &str) -> Answer {
    let mut t = s.trim().to_string();
    for (from, to) in [
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\ ", ""),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("^{\\circ}", ""),
        ("^\\circ", ""),
        ("\\circ", ""),
        ("\\%", ""),
        ("%", ""),
        ("\u{2212}", "-"),
        ("\\$", ""),
        ("$", ""),
        ("\\displaystyle", ""),
    ] {
        t = t.replace(from, to);
    }
    t = strip_text_units(&t);
    let t: String = t.chars().filter(|c| !c.is_whitespace()).collect();
    let t = t.trim_end_matches('.').to_string();
    let t = t
        .strip_prefix("x=")
        .or_else(|| t.strip_prefix("="))
        .unwrap_or(&t)
        .to_string();
    match parse_number(&t) {
        Some(r) => Answer::Number(r),
        None => Answer::Text(t),
    }
}

/// Removes `\text{...}` / `\mbox{...}` (units, words) and trailing plain-word units.
fn strip_text_units(s: &str) -> String {
    let mut out = s.to_string();
    for cmd in ["\\text", "\\mbox", "\\mathrm"] {
        while let Some(at) = out.find(cmd) {
            let Some(open) = out[at..].find('{').map(|o| at + o) else {
                break;
            };
            let Some(close) = out[open..].find('}').map(|c| open + c) else {
                break;
            };
            let inner = out[open + 1..close].trim().to_string();
            // Keep the content when it is the whole answer (e.g. \text{(C)}).
            let keep = out[..at].trim().is_empty() && out[close + 1..].trim().is_empty();
            out = format!(
                "{}{}{}",
                &out[..at],
                if keep { inner } else { String::new() },
                &out[close + 1..]
            );
        }
    }
    // "18 dollars", "5 cm": a number followed by one word.
    let words: Vec<&str> = out.split_whitespace().collect();
    if words.len() == 2
        && parse_number(words[0]).is_some()
        && words[1].chars().all(char::is_alphabetic)
    {
        return words[0].to_string();
    }
    out
}

/// Integers, decimals, thousands separators, signs, `a/b` and `\frac{a}{b}` (also `\frac ab`).
fn parse_number(s: &str) -> Option<Rational> {
    let (neg, body) = match s.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, s.strip_prefix('+').unwrap_or(s)),
    };
    let r = if let Some(frac) = body.strip_prefix("\\frac") {
        let (a, b) = frac_parts(frac)?;
        let (a, b) = (parse_number(&a)?, parse_number(&b)?);
        Rational::new(a.num * b.den, a.den * b.num)?
    } else if let Some((a, b)) = body.split_once('/') {
        let (a, b) = (parse_number(a)?, parse_number(b)?);
        Rational::new(a.num * b.den, a.den * b.num)?
    } else {
        parse_decimal(body)?
    };
    Some(if neg {
        Rational::new(-r.num, r.den)?
    } else {
        r
    })
}

/// `{a}{b}` or `ab` (single-digit shorthand) after `\frac`.
fn frac_parts(s: &str) -> Option<(String, String)> {
    if let Some(rest) = s.strip_prefix('{') {
        let close = rest.find('}')?;
        let (a, rest) = (&rest[..close], &rest[close + 1..]);
        let rest = rest.strip_prefix('{')?.strip_suffix('}')?;
        return Some((a.to_string(), rest.to_string()));
    }
    let mut chars = s.chars();
    let (a, b) = (chars.next()?, chars.next()?);
    chars
        .next()
        .is_none()
        .then(|| (a.to_string(), b.to_string()))
}

/// `1,234.50` -> 123450/100; commas only as thousands separators.
fn parse_decimal(s: &str) -> Option<Rational> {
    if s.is_empty() {
        return None;
    }
    let (int, frac) = s.split_once('.').unwrap_or((s, ""));
    let groups: Vec<&str> = int.split(',').collect();
    let thousands_ok = groups.len() == 1
        || (groups[0].len() <= 3
            && !groups[0].is_empty()
            && groups[1..].iter().all(|g| g.len() == 3));
    let digits = |x: &str| x.chars().all(|c| c.is_ascii_digit());
    if !thousands_ok
        || !groups.iter().all(|g| digits(g))
        || !digits(frac)
        || (int.is_empty() && frac.is_empty())
    {
        return None;
    }
    let int: String = groups.concat();
    if int.len() + frac.len() > 30 {
        return None;
    }
    let num: i128 = format!("{int}{frac}").parse().ok()?;
    Rational::new(num, 10i128.pow(frac.len() as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// (completion, gold, expected reward)
    const CASES: [(&str, &str, f64); 44] = [
        ("The answer is \\boxed{42}.", "42", 1.0),
        ("\\boxed{42.0}", "42", 1.0),
        ("\\boxed{041}", "41", 1.0),
        ("\\boxed{1,000}", "1000", 1.0),
        ("\\boxed{1000}", "#### 1,000", 1.0),
        ("so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", 1.0),
        ("\\boxed{\\frac34}", "0.75", 1.0),
        ("\\boxed{6/8}", "\\frac{3}{4}", 1.0),
        ("\\boxed{-\\frac{1}{3}}", "-\\frac13", 1.0),
        ("\\boxed{-2}", "\u{2212}2", 1.0),
        ("\\boxed{-2}", "-2", 1.0),
        ("\\boxed{+7}", "7", 1.0),
        ("\\boxed{18 \\text{ dollars}}", "18", 1.0),
        ("\\boxed{5\\text{ cm}}", "5", 1.0),
        ("\\boxed{90^\\circ}", "90", 1.0),
        ("\\boxed{90^{\\circ}}", "90", 1.0),
        ("\\boxed{25\\%}", "25", 1.0),
        ("\\boxed{\\$18.50}", "18.5", 1.0),
        ("\\boxed{x = 3}", "3", 1.0),
        (
            "\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}",
            "\\left( 3, \\frac{\\pi}{2} \\right)",
            1.0,
        ),
        (
            "\\boxed{(3,\\frac{\\pi}{2})}",
            "\\left( 3, \\frac{\\pi}{2} \\right)",
            1.0,
        ),
        ("\\boxed{[1, 2)}", "[1,2)", 1.0),
        ("\\boxed{[1, 2]}", "[1,2)", 0.0),
        ("\\boxed{\\text{(C)}}", "(C)", 1.0),
        ("\\boxed{2\\sqrt{3}}", "2\\sqrt{3}", 1.0),
        ("\\boxed{2\\sqrt{2}}", "2\\sqrt{3}", 0.0),
        ("first \\boxed{1} then \\boxed{2}", "2", 1.0),
        ("first \\boxed{1} then \\boxed{2}", "1", 0.0),
        ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}", 1.0),
        ("#### 72", "72", 1.0),
        ("She earns 10 per hour.\n#### 1,200\n", "1200", 1.0),
        ("The answer is 15.", "15", 1.0),
        ("Therefore the answer is: 3/4", "0.75", 1.0),
        ("3 + 4 = 7, so she has 7 apples", "7", 1.0),
        ("3 + 4 = 7, so she has 8 apples", "7", 0.0),
        ("It costs $1,234.50 in total", "1234.5", 1.0),
        ("No number here", "5", 0.0),
        ("\\boxed{}", "5", 0.0),
        ("\\boxed{5", "5", 1.0),
        ("\\boxed{0.333}", "\\frac{1}{3}", 0.0),
        ("\\boxed{10}", "100", 0.0),
        ("\\boxed{1,00}", "100", 0.0),
        ("\\boxed{3.}", "3", 1.0),
    ];

    #[test]
    fn verifier_table() {
        for (completion, gold, want) in CASES {
            let gold_answer = parse_gold(gold).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(
                score(completion, &gold_answer),
                want,
                "{completion:?} vs gold {gold:?}"
            );
        }
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
        ] {
            let answer = parse_gold(gold).unwrap();
            assert_eq!(answer.to_string(), printed, "{gold}");
            assert_eq!(parse_gold(printed).unwrap(), answer, "{gold}");
        }
    }
}
