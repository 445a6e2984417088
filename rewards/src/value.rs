//! Exact numbers: complex numbers whose real and imaginary parts are finite sums of
//! `q * sqrt(s) * pi^k` (q rational, s a square-free integer, k an integer).
//!
//! NOTE: the numbers `sqrt(s) * pi^k` for distinct square-free `s` and distinct `k` are
//! linearly independent over the rationals (square roots of distinct square-free integers
//! are independent, and pi is transcendental), so two values are equal exactly when their
//! canonical term maps are equal: equality here is sound, never a floating-point guess.
//! Every operation is checked: an overflow of `i128`, a radicand too large to factor or a
//! division this field cannot express returns `None`, never a wrong value.

use std::collections::BTreeMap;

/// An exact rational `num / den` with `den > 0`, in lowest terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Rational {
    num: i128,
    den: i128,
}

impl Rational {
    /// `num / den` reduced; `None` when `den` is 0 or the sign flip overflows.
    pub fn new(num: i128, den: i128) -> Option<Self> {
        if den == 0 {
            return None;
        }
        let g = gcd(num.unsigned_abs(), den.unsigned_abs()).max(1) as i128;
        let (num, den) = (num / g, den / g);
        if den < 0 {
            Some(Self {
                num: num.checked_neg()?,
                den: den.checked_neg()?,
            })
        } else {
            Some(Self { num, den })
        }
    }

    /// The integer `n`.
    pub fn integer(n: i128) -> Self {
        Self { num: n, den: 1 }
    }

    /// Whether this is 0.
    pub fn is_zero(self) -> bool {
        self.num == 0
    }

    /// The numerator and the (positive) denominator.
    pub fn parts(self) -> (i128, i128) {
        (self.num, self.den)
    }

    fn add(self, o: Self) -> Option<Self> {
        let g = gcd(self.den.unsigned_abs(), o.den.unsigned_abs()) as i128;
        let num = self
            .num
            .checked_mul(o.den / g)?
            .checked_add(o.num.checked_mul(self.den / g)?)?;
        Self::new(num, self.den.checked_mul(o.den / g)?)
    }

    fn mul(self, o: Self) -> Option<Self> {
        let g1 = gcd(self.num.unsigned_abs(), o.den.unsigned_abs()).max(1) as i128;
        let g2 = gcd(o.num.unsigned_abs(), self.den.unsigned_abs()).max(1) as i128;
        Self::new(
            (self.num / g1).checked_mul(o.num / g2)?,
            (self.den / g2).checked_mul(o.den / g1)?,
        )
    }

    fn neg(self) -> Option<Self> {
        Some(Self {
            num: self.num.checked_neg()?,
            den: self.den,
        })
    }

    fn recip(self) -> Option<Self> {
        Self::new(self.den, self.num)
    }
}

fn gcd(a: u128, b: u128) -> u128 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// Radicands above this are not factored (trial division up to its square root).
const MAX_RADICAND: u128 = 1 << 40;

/// `n = root^2 * free` with `free` square-free; `None` above [`MAX_RADICAND`].
fn split_square(mut n: u128) -> Option<(u128, u128)> {
    if n > MAX_RADICAND {
        return None;
    }
    let (mut root, mut free) = (1, 1);
    let mut p = 2;
    while p * p <= n {
        let mut count = 0;
        while n.is_multiple_of(p) {
            n /= p;
            count += 1;
        }
        root *= p.pow(count / 2);
        if count % 2 == 1 {
            free *= p;
        }
        p += 1;
    }
    Some((root, free * n))
}

/// `sqrt(s) * pi^k`: one basis element of a [`Real`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Basis {
    radicand: u128,
    pi_power: i32,
}

const ONE: Basis = Basis {
    radicand: 1,
    pi_power: 0,
};

/// A real number `sum q_j * sqrt(s_j) * pi^k_j`, zero coefficients dropped.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Real(BTreeMap<Basis, Rational>);

impl Real {
    fn term(basis: Basis, q: Rational) -> Self {
        let mut map = BTreeMap::new();
        if !q.is_zero() {
            map.insert(basis, q);
        }
        Self(map)
    }

    fn is_zero(&self) -> bool {
        self.0.is_empty()
    }

    fn as_rational(&self) -> Option<Rational> {
        match self.0.iter().collect::<Vec<_>>()[..] {
            [] => Some(Rational::integer(0)),
            [(&ONE, &q)] => Some(q),
            _ => None,
        }
    }

    fn add(&self, o: &Self) -> Option<Self> {
        let mut map = self.0.clone();
        for (&b, &q) in &o.0 {
            let sum = map.get(&b).map_or(Some(q), |&p| p.add(q))?;
            if sum.is_zero() {
                map.remove(&b);
            } else {
                map.insert(b, sum);
            }
        }
        Some(Self(map))
    }

    fn neg(&self) -> Option<Self> {
        let map = self.0.iter().map(|(&b, &q)| Some((b, q.neg()?)));
        Some(Self(map.collect::<Option<_>>()?))
    }

    fn mul(&self, o: &Self) -> Option<Self> {
        let mut out = Self::default();
        for (a, &p) in &self.0 {
            for (b, &q) in &o.0 {
                // sqrt(s) sqrt(t) = g sqrt(s/g * t/g) with g = gcd(s, t): square-free again.
                let g = gcd(a.radicand, b.radicand);
                let radicand = (a.radicand / g).checked_mul(b.radicand / g)?;
                let basis = Basis {
                    radicand,
                    pi_power: a.pi_power.checked_add(b.pi_power)?,
                };
                let q = p.mul(q)?.mul(Rational::integer(i128::try_from(g).ok()?))?;
                out = out.add(&Self::term(basis, q))?;
            }
        }
        Some(out)
    }

    /// `1 / self` for one term, or for two terms of one power of pi (by the conjugate).
    fn recip(&self) -> Option<Self> {
        let terms: Vec<(Basis, Rational)> = self.0.iter().map(|(&b, &q)| (b, q)).collect();
        let monomial = |b: Basis, q: Rational| {
            // 1 / (q sqrt(s) pi^k) = sqrt(s) pi^-k / (q s)
            let s = Rational::integer(i128::try_from(b.radicand).ok()?);
            let basis = Basis {
                radicand: b.radicand,
                pi_power: b.pi_power.checked_neg()?,
            };
            Some(Self::term(basis, q.mul(s)?.recip()?))
        };
        match terms[..] {
            [(b, q)] => monomial(b, q),
            [(a, p), (b, q)] if a.pi_power == b.pi_power => {
                // (p sqrt(s) + q sqrt(t)) (p sqrt(s) - q sqrt(t)) = pi^2k (p^2 s - q^2 t)
                let conjugate = Self::term(a, p).add(&Self::term(b, q.neg()?))?;
                let norm = self.mul(&conjugate)?;
                let (&basis, &value) = norm.0.iter().next().filter(|_| norm.0.len() == 1)?;
                conjugate.mul(&monomial(basis, value)?)
            }
            _ => None,
        }
    }
}

/// An exact complex number `re + im * i`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Number {
    re: Real,
    im: Real,
}

impl Number {
    /// The rational `q`.
    pub fn rational(q: Rational) -> Self {
        Self {
            re: Real::term(ONE, q),
            im: Real::default(),
        }
    }

    /// pi.
    pub fn pi() -> Self {
        let basis = Basis {
            radicand: 1,
            pi_power: 1,
        };
        Self {
            re: Real::term(basis, Rational::integer(1)),
            im: Real::default(),
        }
    }

    /// The imaginary unit.
    pub fn i() -> Self {
        Self {
            re: Real::default(),
            im: Real::term(ONE, Rational::integer(1)),
        }
    }

    /// The value when it is a rational.
    pub fn as_rational(&self) -> Option<Rational> {
        if self.im.is_zero() {
            self.re.as_rational()
        } else {
            None
        }
    }

    /// `self + o`.
    pub fn add(&self, o: &Self) -> Option<Self> {
        Some(Self {
            re: self.re.add(&o.re)?,
            im: self.im.add(&o.im)?,
        })
    }

    /// `-self`.
    pub fn neg(&self) -> Option<Self> {
        Some(Self {
            re: self.re.neg()?,
            im: self.im.neg()?,
        })
    }

    /// `self * o`.
    pub fn mul(&self, o: &Self) -> Option<Self> {
        Some(Self {
            re: self.re.mul(&o.re)?.add(&self.im.mul(&o.im)?.neg()?)?,
            im: self.re.mul(&o.im)?.add(&self.im.mul(&o.re)?)?,
        })
    }

    /// `self / o`; `None` for 0 and for divisors outside the field this type can invert.
    pub fn div(&self, o: &Self) -> Option<Self> {
        // 1 / (c + di) = (c - di) / (c^2 + d^2)
        let norm = o.re.mul(&o.re)?.add(&o.im.mul(&o.im)?)?;
        let inv = norm.recip()?;
        let conjugate = Self {
            re: o.re.mul(&inv)?,
            im: o.im.neg()?.mul(&inv)?,
        };
        self.mul(&conjugate)
    }

    /// `self ^ (p / q)` for integer powers (|p| <= 64) and square roots of rationals.
    pub fn pow(&self, exponent: Rational) -> Option<Self> {
        let (p, q) = exponent.parts();
        match q {
            1 if p.abs() <= 64 => {
                let mut out = Self::rational(Rational::integer(1));
                for _ in 0..p.abs() {
                    out = out.mul(self)?;
                }
                if p < 0 {
                    out = Self::rational(Rational::integer(1)).div(&out)?;
                }
                Some(out)
            }
            2 => self.pow(Rational::integer(p))?.sqrt(),
            _ => None,
        }
    }

    /// The principal square root of a rational (`i sqrt(-x)` for a negative one).
    pub fn sqrt(&self) -> Option<Self> {
        let (num, den) = self.as_rational()?.parts();
        let (root, free) = split_square(num.unsigned_abs().checked_mul(den.unsigned_abs())?)?;
        let basis = Basis {
            radicand: free,
            pi_power: 0,
        };
        let part = Real::term(basis, Rational::new(i128::try_from(root).ok()?, den)?);
        Some(if num < 0 {
            Self {
                re: Real::default(),
                im: part,
            }
        } else {
            Self {
                re: part,
                im: Real::default(),
            }
        })
    }
}

/// The canonical form, which [`crate::parse`] reads back to the same value: terms in basis
/// order, such as `3/4`, `\frac{3}{4}\sqrt{13}\pi`, `-2i`; `0` for zero.
impl std::fmt::Display for Number {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let re = self.re.0.iter().map(|(b, q)| (b, q, false));
        let im = self.im.0.iter().map(|(b, q)| (b, q, true));
        let mut first = true;
        for (b, q, imaginary) in re.chain(im) {
            let term = format_term(b, *q, imaginary);
            if !first && !term.starts_with('-') {
                f.write_str("+")?;
            }
            f.write_str(&term)?;
            first = false;
        }
        if first {
            f.write_str("0")?;
        }
        Ok(())
    }
}

fn format_term(b: &Basis, q: Rational, imaginary: bool) -> String {
    let mut factors = String::new();
    if b.radicand > 1 {
        factors += &format!("\\sqrt{{{}}}", b.radicand);
    }
    match b.pi_power {
        0 => {}
        1 => factors += "\\pi",
        k => factors += &format!("\\pi^{{{k}}}"),
    }
    if imaginary {
        factors += "i";
    }
    let (num, den) = q.parts();
    let sign = if num < 0 { "-" } else { "" };
    let abs = num.unsigned_abs();
    match (factors.is_empty(), abs, den) {
        (true, _, 1) => format!("{num}"),
        (true, _, _) => format!("{num}/{den}"),
        (false, 1, 1) => format!("{sign}{factors}"),
        (false, _, 1) => format!("{num}{factors}"),
        (false, _, _) => format!("{sign}\\frac{{{abs}}}{{{den}}}{factors}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn int(n: i128) -> Number {
        Number::rational(Rational::integer(n))
    }

    #[test]
    fn radicals_reduce_to_square_free_form() {
        let sqrt117 = int(117).sqrt().unwrap();
        let three_sqrt13 = int(3).mul(&int(13).sqrt().unwrap()).unwrap();
        assert_eq!(sqrt117, three_sqrt13);
        assert_eq!(sqrt117.to_string(), "3\\sqrt{13}");
        let half = Number::rational(Rational::new(1, 2).unwrap());
        assert_eq!(half.sqrt().unwrap().to_string(), "\\frac{1}{2}\\sqrt{2}");
        assert_eq!(int(-4).sqrt().unwrap(), int(2).mul(&Number::i()).unwrap());
    }

    #[test]
    fn division_rationalises_two_term_denominators() {
        // 1 / (1 + sqrt 2) = sqrt 2 - 1
        let sqrt2 = int(2).sqrt().unwrap();
        let x = int(1).div(&int(1).add(&sqrt2).unwrap()).unwrap();
        assert_eq!(x, sqrt2.add(&int(-1)).unwrap());
        // (6 - 5i)(1 + i) / (1 + i) = 6 - 5i
        let z = int(6).add(&int(-5).mul(&Number::i()).unwrap()).unwrap();
        let w = int(1).add(&Number::i()).unwrap();
        assert_eq!(z.mul(&w).unwrap().div(&w).unwrap(), z);
        assert!(int(1).div(&int(0)).is_none());
    }

    #[test]
    fn overflow_is_none_not_a_wrong_value() {
        assert!(int(10).pow(Rational::integer(40)).is_none());
        assert!(int(10).pow(Rational::integer(38)).is_some());
        assert!(Number::pi().pow(Rational::new(1, 3).unwrap()).is_none());
    }
}
