//! Text clean-up before an answer is parsed: LaTeX spacing and sizing commands, dollar
//! signs, degrees, percent, `\text{}` wrappers and units, thousands separators, and the
//! variable of an equation (`x = 5` is `5`).

/// Plain substitutions, applied in order.
const REPLACEMENTS: [(&str, &str); 29] = [
    ("\\left", ""),
    ("\\right", ""),
    ("\\!", ""),
    ("\\,", ""),
    ("\\;", ""),
    ("\\:", ""),
    ("\\qquad", ""),
    ("\\quad", ""),
    ("\\ ", " "),
    ("\\dfrac", "\\frac"),
    ("\\tfrac", "\\frac"),
    ("^{\\circ}", ""),
    ("^\\circ", ""),
    ("\\circ", ""),
    ("\\degree", ""),
    ("\\%", ""),
    ("%", ""),
    ("\u{2212}", "-"),
    ("\\$", ""),
    ("$", ""),
    ("\\displaystyle", ""),
    ("\\cdots", "\\dots"),
    ("\\cdot", "*"),
    ("\\times", "*"),
    ("\\div", "/"),
    ("{,}", ","),
    ("\\mp", "\\pm"),
    ("\\geqslant", "\\geq"),
    ("\\leqslant", "\\leq"),
];

/// Wrappers whose content is kept when they are the whole answer (`\text{Evelyn}`) and
/// dropped as a unit otherwise (`5\text{ cm}`).
const TEXT_COMMANDS: [&str; 6] = [
    "\\textbf", "\\textit", "\\text", "\\mbox", "\\mathrm", "\\mathbf",
];

/// `s` with the substitutions above, units and wrappers removed, no whitespace and no
/// trailing period.
pub fn clean(s: &str) -> String {
    let mut t = s.trim().to_string();
    for (from, to) in REPLACEMENTS {
        t = t.replace(from, to);
    }
    let t = strip_word_unit(&strip_text(&t));
    let t: String = t.chars().filter(|c| !c.is_whitespace()).collect();
    t.trim_end_matches('.').to_string()
}

/// The index just past the brace that closes the one at `open`.
pub fn matching_brace(s: &str, open: usize) -> Option<usize> {
    let mut depth = 0;
    for (i, c) in s[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(open + i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// Unwraps a `\text{...}` that is the whole answer or inside braces, turns `\text{ and }`/
/// `\text{ or }` into a comma and drops other wrapped words (units) with any `^2`/`^{3}`
/// after them.
fn strip_text(s: &str) -> String {
    let mut out = s.to_string();
    for cmd in TEXT_COMMANDS {
        while let Some(at) = out.find(cmd) {
            let after = &out[at + cmd.len()..];
            let open = at + cmd.len() + (after.len() - after.trim_start().len());
            if !out[open..].starts_with('{') {
                break;
            }
            let Some(close) = matching_brace(&out, open) else {
                break;
            };
            let inner = out[open + 1..close - 1].trim().to_string();
            let mut end = close;
            let before = &out[..at];
            let is_whole = before.trim().is_empty() && out[close..].trim().is_empty();
            // Inside braces (`\lambda_{\text{red}}`) the words are a name, not a unit.
            let is_nested = before.matches('{').count() > before.matches('}').count();
            let replacement = if matches!(inner.as_str(), "and" | "or" | ",") {
                ",".to_string()
            } else if is_whole || is_nested {
                inner
            } else {
                end += unit_power_len(&out[close..]);
                String::new()
            };
            out = format!("{}{replacement}{}", &out[..at], &out[end..]);
        }
    }
    out
}

/// The length of a `^2` or `^{3}` at the start of `s` (0 when there is none).
fn unit_power_len(s: &str) -> usize {
    let b = s.as_bytes();
    match b {
        [b'^', d, ..] if d.is_ascii_digit() => 2,
        [b'^', b'{', d, b'}', ..] if d.is_ascii_digit() => 4,
        _ => 0,
    }
}

/// "18 dollars", "5 cm": a decimal number followed by one word is the number.
fn strip_word_unit(s: &str) -> String {
    let words: Vec<&str> = s.split_whitespace().collect();
    let is_decimal = |w: &str| {
        let w = w.strip_prefix('-').unwrap_or(w);
        !w.is_empty()
            && w.chars()
                .all(|c| c.is_ascii_digit() || c == '.' || c == ',')
    };
    match words[..] {
        [number, unit] if is_decimal(number) && unit.chars().all(char::is_alphabetic) => {
            number.to_string()
        }
        _ => s.to_string(),
    }
}

/// The right side of `x=5` when the left is one variable (`x`, `x_1`, `\theta`), and
/// `x\in[1,2]`'s set; `=5` is `5`; anything else unchanged.
pub fn strip_variable(s: &str) -> &str {
    for relation in ["=", "\\in"] {
        if let Some((lhs, rhs)) = s.split_once(relation) {
            if !rhs.contains('=') && is_variable(lhs) {
                return rhs;
            }
        }
    }
    s
}

/// The variable that `s` assigns (`x` of `x=5`), if any.
pub fn assigned_variable(s: &str) -> Option<&str> {
    let (lhs, rhs) = s.split_once('=')?;
    (!lhs.is_empty() && !rhs.contains('=') && is_variable(lhs)).then_some(lhs)
}

fn is_variable(s: &str) -> bool {
    let name = match s.split_once('_') {
        Some((name, sub)) => {
            let sub = sub.trim_start_matches('{').trim_end_matches('}');
            if sub.is_empty() || !sub.chars().all(char::is_alphanumeric) {
                return false;
            }
            name
        }
        None => s,
    };
    let greek = name
        .strip_prefix('\\')
        .is_some_and(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_alphabetic()));
    name.is_empty() || greek || (name.len() == 1 && name.chars().all(|c| c.is_alphabetic()))
}

/// Splits `s` on `sep` outside any bracket (`()`, `[]`, `{}` counted alike, so that
/// half-open intervals nest).
pub fn split_top<'a>(s: &'a str, sep: &str) -> Vec<&'a str> {
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    let mut i = 0;
    while i < s.len() {
        let rest = &s[i..];
        let c = rest.chars().next().expect("i < len on a char boundary");
        if depth == 0 && rest.starts_with(sep) {
            parts.push(&s[start..i]);
            i += sep.len();
            start = i;
            continue;
        }
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth -= 1,
            _ => {}
        }
        i += c.len_utf8();
    }
    parts.push(&s[start..]);
    parts
}

/// Whether the bracket opening `s` closes at its last character and not before.
pub fn is_wrapped(s: &str) -> bool {
    let mut depth = 0i32;
    for (i, c) in s.char_indices() {
        match c {
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' => depth -= 1,
            _ => {}
        }
        if depth == 0 {
            return i + c.len_utf8() == s.len() && i > 0;
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clean_strips_wrappers_units_and_spacing() {
        for (input, want) in [
            ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
            ("864 \\mbox{ inches}^2", "864"),
            ("15\\mbox{ cm}^2", "15"),
            ("\\text{Evelyn}", "Evelyn"),
            ("1 \\text{ and } 2", "1,2"),
            ("\\{1 \\text{ or } 2\\}", "\\{1,2\\}"),
            ("\\$32,\\!348", "32,348"),
            ("18 dollars", "18"),
            ("90^\\circ", "90"),
            ("$\\frac{1}{2}$.", "\\frac{1}{2}"),
            ("10{,}080", "10,080"),
            ("\\lambda_{\\text {red}}", "\\lambda_{red}"),
        ] {
            assert_eq!(clean(input), want, "{input}");
        }
    }

    #[test]
    fn only_a_single_variable_is_stripped() {
        assert_eq!(strip_variable("x=5"), "5");
        assert_eq!(strip_variable("\\theta=\\pi"), "\\pi");
        assert_eq!(strip_variable("a_{1}=3"), "3");
        assert_eq!(strip_variable("x\\in[1,2]"), "[1,2]");
        assert_eq!(strip_variable("x+y=5"), "x+y=5");
        assert_eq!(strip_variable("5x-7y+11z+4=0"), "5x-7y+11z+4=0");
    }
}
