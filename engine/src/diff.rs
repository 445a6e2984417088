//! Differences for checks in which a NaN never passes: `max` skips a NaN, so a check that
//! folds plain differences would pass a device that returns one.

/// |a - b|; 0 where they are equal (infinities included), infinite where either is NaN.
pub fn abs_diff(a: f64, b: f64) -> f64 {
    match a == b {
        true => 0.0,
        false => Some((a - b).abs())
            .filter(|d| !d.is_nan())
            .unwrap_or(f64::INFINITY),
    }
}

/// The largest [`abs_diff`] of `a` against `b`, infinite where the lengths differ.
pub fn worst(a: &[f32], b: &[f64]) -> f64 {
    if a.len() != b.len() {
        return f64::INFINITY;
    }
    a.iter()
        .zip(b)
        .fold(0.0, |m, (&x, &y)| m.max(abs_diff(x as f64, y)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_nan_is_the_largest_difference_and_equal_infinities_none() {
        assert_eq!(abs_diff(1.0, 1.5), 0.5);
        assert_eq!(abs_diff(f64::INFINITY, f64::INFINITY), 0.0);
        assert_eq!(abs_diff(f64::NAN, f64::NAN), f64::INFINITY);
        assert_eq!(
            worst(&[1.0, f32::NAN, 2.0], &[1.0, 0.0, 2.5]),
            f64::INFINITY
        );
        assert_eq!(worst(&[1.0, 2.0], &[1.0, 2.25]), 0.25);
        assert_eq!(worst(&[1.0], &[1.0, 2.0]), f64::INFINITY);
    }
}
