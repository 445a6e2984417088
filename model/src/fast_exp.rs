//! `exp` for softmax weights in plain arithmetic the compiler can vectorise. libm's `expf`
//! is a scalar call per element; the sampler's full-vocabulary weights and the attention
//! kernel's probabilities need millions of them per decode step. Written by hand because no
//! maintained crate offers a branch-free `f32` exp whose bits are the same on every CPU:
//! every step here is one IEEE operation in a fixed order (Rust never fuses a multiply and
//! an add), so SSE2, AVX2 and AVX-512 compilations agree bit for bit.

/// `e^x` for `x <= 0` (what softmax feeds it: a logit minus the maximum), within 2 ulp of
/// the exact value; exactly `1` at `0` and `0` below `-87` (where `e^x` is under 1.7e-38,
/// next to the smallest normal float). Cody-Waite reduction `x = n ln2 + r`, `|r| <= ln2/2`,
/// and a degree-6 polynomial for `e^r` (Cephes' `expf` coefficients).
#[inline(always)]
pub fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    // ln 2 split so that `n * LN2_HI` is exact for |n| < 2^9.
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 * 2^23: adding it rounds to an integer (ties to even) held in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let t = x * LOG2E + ROUND;
    let n = t - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let y = p * (r * r) + r + 1.0;
    // Multiply by 2^n by adding n to the exponent field; n's two's complement sits in t's
    // low bits.
    let n_bits = t.to_bits().wrapping_sub(ROUND.to_bits());
    let scaled = f32::from_bits(y.to_bits().wrapping_add(n_bits << 23));
    if x < -87.0 {
        0.0
    } else {
        scaled
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Units in the last place between `got` and the exact value; infinite for a NaN (which
    /// `max` would skip).
    fn ulps(got: f32, exact: f64) -> f64 {
        let e = exact as f32;
        let ulp = (f32::from_bits(e.to_bits() + 1) - e) as f64;
        let d = (got as f64 - exact).abs() / ulp;
        if d.is_nan() {
            f64::INFINITY
        } else {
            d
        }
    }

    #[test]
    fn within_two_ulp_of_f64_exp_over_the_range() {
        let mut worst = 0f64;
        let mut x = 0f32;
        while x > -87.0 {
            worst = worst.max(ulps(exp_nonpositive(x), (x as f64).exp()));
            x -= 0.000_731;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
    }

    #[test]
    fn one_at_zero_and_zero_far_below() {
        assert_eq!(exp_nonpositive(0.0), 1.0);
        assert_eq!(exp_nonpositive(-0.0), 1.0);
        assert_eq!(exp_nonpositive(-87.5), 0.0);
        assert_eq!(exp_nonpositive(f32::NEG_INFINITY), 0.0);
        assert!(exp_nonpositive(-86.9) > 0.0);
    }
}
