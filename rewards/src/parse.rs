//! Reads a cleaned LaTeX expression (see [`crate::normalise`]) into an exact [`Number`]:
//! integers, decimals, scientific notation (`4.5e33`), `+ - * /`, implicit products,
//! `^`, `\frac{a}{b}` (and `\frac ab`), mixed numbers, `\sqrt{x}`, `\pi` and `i`.
//!
//! A mixed number is an integer written directly before `\frac` of two integers:
//! `2\frac{1}{2}` is 5/2 (the MATH convention), while `2\frac{\pi}{3}` is a product.
//! Products and quotients associate left to right, so `3/4\sqrt{13}` is (3/4) sqrt(13).
//! Anything else (letters, functions, `\infty`, roots other than square roots) is not a
//! number: the caller compares it as text.

use crate::value::{Number, Rational};

#[derive(Debug, Clone, PartialEq)]
enum Token {
    Num(Rational),
    Frac,
    Sqrt,
    Pi,
    I,
    Plus,
    Minus,
    Star,
    Slash,
    Caret,
    Open,
    Close,
}

/// The exact value of `s` (already cleaned: no whitespace), or `None` when it is not a
/// number this verifier can evaluate.
pub fn number(s: &str) -> Option<Number> {
    let tokens = lex(s)?;
    let mut p = Parser { tokens, at: 0 };
    let value = p.sum()?;
    (p.at == p.tokens.len()).then_some(value)
}

fn lex(s: &str) -> Option<Vec<Token>> {
    let chars: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let after_command = matches!(out.last(), Some(Token::Frac | Token::Sqrt));
        let token = match c {
            '0'..='9' | '.' if after_command => {
                // `\frac12`, `\sqrt2`: a command's bare argument is one digit.
                i += 1;
                Token::Num(Rational::integer(c.to_digit(10)? as i128))
            }
            '0'..='9' | '.' => {
                let (value, len) = decimal(&chars[i..])?;
                i += len;
                Token::Num(value)
            }
            '\\' => {
                let len = chars[i + 1..]
                    .iter()
                    .take_while(|c| c.is_ascii_alphabetic())
                    .count();
                let name: String = chars[i + 1..i + 1 + len].iter().collect();
                i += 1 + len;
                match name.as_str() {
                    "frac" => Token::Frac,
                    "sqrt" => Token::Sqrt,
                    "pi" => Token::Pi,
                    _ => return None,
                }
            }
            _ => {
                i += 1;
                match c {
                    'i' => Token::I,
                    '+' => Token::Plus,
                    '-' => Token::Minus,
                    '*' => Token::Star,
                    '/' => Token::Slash,
                    '^' => Token::Caret,
                    '(' | '{' => Token::Open,
                    ')' | '}' => Token::Close,
                    _ => return None,
                }
            }
        };
        out.push(token);
    }
    Some(out)
}

/// A decimal at the start of `chars` (`12`, `0.5`, `3.`, `4.5e33`, `1e-5`) and its length.
fn decimal(chars: &[char]) -> Option<(Rational, usize)> {
    let digits = |from: usize| {
        chars[from..]
            .iter()
            .take_while(|c| c.is_ascii_digit())
            .count()
    };
    let int_len = digits(0);
    let mut len = int_len;
    let mut frac_len = 0;
    if chars.get(len) == Some(&'.') {
        frac_len = digits(len + 1);
        len += 1 + frac_len;
    }
    if int_len + frac_len == 0 || int_len + frac_len > 39 {
        return None;
    }
    let text: String = chars[..len].iter().filter(|c| **c != '.').collect();
    let mut exponent = -(frac_len as i64);
    if chars.get(len) == Some(&'e') {
        let sign = usize::from(matches!(chars.get(len + 1), Some('-' | '+')));
        let exp_len = digits(len + 1 + sign);
        if exp_len > 0 && exp_len <= 3 {
            let exp: String = chars[len + 1..len + 1 + sign + exp_len].iter().collect();
            exponent += exp.parse::<i64>().ok()?;
            len += 1 + sign + exp_len;
        }
    }
    let mantissa = Rational::integer(text.parse().ok()?);
    let scale = Number::rational(Rational::integer(10)).pow(Rational::integer(exponent.into()))?;
    let value = Number::rational(mantissa).mul(&scale)?.as_rational()?;
    Some((value, len))
}

struct Parser {
    tokens: Vec<Token>,
    at: usize,
}

impl Parser {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.at)
    }

    fn eat(&mut self, t: &Token) -> bool {
        let hit = self.peek() == Some(t);
        self.at += usize::from(hit);
        hit
    }

    fn sum(&mut self) -> Option<Number> {
        let mut acc = self.product()?;
        loop {
            if self.eat(&Token::Plus) {
                acc = acc.add(&self.product()?)?;
            } else if self.eat(&Token::Minus) {
                acc = acc.add(&self.product()?.neg()?)?;
            } else {
                return Some(acc);
            }
        }
    }

    fn product(&mut self) -> Option<Number> {
        let mut acc = self.unary()?;
        loop {
            if self.eat(&Token::Star) {
                acc = acc.mul(&self.unary()?)?;
            } else if self.eat(&Token::Slash) {
                acc = acc.div(&self.unary()?)?;
            } else if matches!(
                self.peek(),
                Some(
                    Token::Num(_) | Token::Frac | Token::Sqrt | Token::Pi | Token::I | Token::Open
                )
            ) {
                acc = acc.mul(&self.power()?)?;
            } else {
                return Some(acc);
            }
        }
    }

    fn unary(&mut self) -> Option<Number> {
        if self.eat(&Token::Minus) {
            self.unary()?.neg()
        } else if self.eat(&Token::Plus) {
            self.unary()
        } else {
            self.power()
        }
    }

    fn power(&mut self) -> Option<Number> {
        let base = self.primary()?;
        if !self.eat(&Token::Caret) {
            return Some(base);
        }
        let exponent = if self.eat(&Token::Minus) {
            self.primary()?.neg()?
        } else {
            self.primary()?
        };
        base.pow(exponent.as_rational()?)
    }

    fn primary(&mut self) -> Option<Number> {
        let token = self.peek()?.clone();
        self.at += 1;
        match token {
            Token::Num(n) => Some(self.mixed_fraction(n).unwrap_or(Number::rational(n))),
            Token::Frac => {
                let num = self.primary()?;
                num.div(&self.primary()?)
            }
            Token::Sqrt => self.primary()?.sqrt(),
            Token::Pi => Some(Number::pi()),
            Token::I => Some(Number::i()),
            Token::Open => {
                let inner = self.sum()?;
                self.eat(&Token::Close).then_some(inner)
            }
            _ => None,
        }
    }

    /// `n\frac{a}{b}` with integers n, a, b: the mixed number `n + a/b` (consumed).
    fn mixed_fraction(&mut self, whole: Rational) -> Option<Number> {
        let int = |t: &Token| match t {
            Token::Num(n) if n.parts().1 == 1 => Some(*n),
            _ => None,
        };
        if whole.parts().1 != 1 {
            return None;
        }
        let t = &self.tokens[self.at..];
        let (a, b, len) = match t {
            [Token::Frac, Token::Open, a, Token::Close, Token::Open, b, Token::Close, ..] => {
                (int(a)?, int(b)?, 7)
            }
            [Token::Frac, a, b, ..] => (int(a)?, int(b)?, 3),
            _ => return None,
        };
        if t.get(len) == Some(&Token::Caret) {
            return None;
        }
        let value = Number::rational(whole).add(&Number::rational(a).div(&Number::rational(b))?)?;
        self.at += len;
        Some(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn show(s: &str) -> String {
        number(s).map_or("none".into(), |n| n.to_string())
    }

    #[test]
    fn latex_numbers_evaluate_exactly() {
        for (input, want) in [
            ("\\frac{3}{4}", "3/4"),
            ("\\frac34", "3/4"),
            ("\\frac{270}7", "270/7"),
            ("\\frac9{19}", "9/19"),
            ("2\\frac{1}{2}", "5/2"),
            ("137\\frac12", "275/2"),
            ("2\\frac{\\pi}{3}", "\\frac{2}{3}\\pi"),
            ("3\\sqrt{13}", "3\\sqrt{13}"),
            ("\\sqrt{117}", "3\\sqrt{13}"),
            ("11\\sqrt2", "11\\sqrt{2}"),
            ("\\frac{3\\sqrt{3}}{4}", "\\frac{3}{4}\\sqrt{3}"),
            ("\\frac{1}{\\sqrt{3}}", "\\frac{1}{3}\\sqrt{3}"),
            ("6-5i", "6-5i"),
            ("\\frac{20000}{\\pi}", "20000\\pi^{-1}"),
            ("4.5e33", "4500000000000000000000000000000000"),
            ("1e-3", "1/1000"),
            ("3*10^8", "300000000"),
            ("2^{-2/3}", "none"),
            ("-1./3", "-1/3"),
            ("(1+\\sqrt{2})^2", "3+2\\sqrt{2}"),
            ("\\infty", "none"),
            ("x+1", "none"),
            ("3/4\\sqrt{13}\\pi", "\\frac{3}{4}\\sqrt{13}\\pi"),
        ] {
            assert_eq!(show(input), want, "{input}");
        }
    }

    #[test]
    fn the_canonical_form_reads_back_to_the_same_value() {
        for input in [
            "6-5i",
            "\\frac{1}{\\sqrt{3}}+\\pi",
            "\\frac{\\pi^2}{8}",
            "-\\frac{1}{2}i",
        ] {
            let value = number(input).unwrap();
            assert_eq!(number(&value.to_string()), Some(value), "{input}");
        }
    }
}
