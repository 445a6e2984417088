//! Min-p, top-k and top-p as one threshold on the tempered scores, as the device sampler applies
//! them (kernels/sample.cu): the scores kept are those whose [`order_key`] reaches the cut.
//! The kernel finds the cut by a search over the keys, block-wide counts or masses at 6
//! thresholds a pass and no sort (candle's CUDA argsort sorts a row in one block and fails on
//! vocabulary-sized rows); this reference finds the same cut from one sort. Tied scores at
//! the cut are all kept, where the host sampler keeps the lower ids; otherwise the kept sets
//! are the same.

use std::cmp::Reverse;

/// `x` as an unsigned integer in the same order (-inf lowest).
pub fn order_key(x: f32) -> u32 {
    let b = x.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

/// The cut for `scores` (tempered, NaN already -inf): the largest key with at least `top_k`
/// scores at or above it (0 disables), raised to the key of `max + ln(min_p)` (0
/// disables), then, among the scores left, the largest with a share of at least `top_p` of
/// their softmax mass at or above it (1 disables). 0 keeps everything.
pub fn cut(scores: &[f32], top_k: usize, top_p: f32, min_p: f32) -> u32 {
    let k_active = top_k > 0 && top_k < scores.len();
    if !k_active && top_p >= 1.0 && min_p <= 0.0 {
        return 0;
    }
    let mut keys: Vec<(u32, f32)> = scores.iter().map(|&s| (order_key(s), s)).collect();
    keys.sort_unstable_by_key(|&(k, _)| Reverse(k));
    let mut cut = 0;
    if k_active {
        cut = keys[top_k - 1].0;
    }
    if min_p > 0.0 {
        cut = cut.max(order_key(keys[0].1 + min_p.ln()));
    }
    keys.truncate(keys.partition_point(|&(k, _)| k >= cut));
    if top_p < 1.0 {
        let max = keys[0].1;
        let weight = |s: f32| f64::from(s - max).exp();
        let target = f64::from(top_p) * keys.iter().map(|&(_, s)| weight(s)).sum::<f64>();
        // The first key whose mass, ties included, reaches the target.
        let mut mass = 0.0;
        let mut i = 0;
        while i < keys.len() {
            let key = keys[i].0;
            while i < keys.len() && keys[i].0 == key {
                mass += weight(keys[i].1);
                i += 1;
            }
            if mass >= target {
                return key;
            }
        }
    }
    cut
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_order_like_the_floats() {
        let xs = [
            f32::NEG_INFINITY,
            -3.5,
            -1e-30,
            -0.0,
            0.0,
            1e-30,
            2.0,
            f32::INFINITY,
        ];
        for w in xs.windows(2) {
            assert!(order_key(w[0]) < order_key(w[1]), "{w:?}");
        }
    }

    /// The kept sets of distinct scores are the host sampler's: the k largest, then the
    /// smallest most-likely prefix reaching top_p of their mass.
    #[test]
    fn the_cut_keeps_the_host_samplers_set() {
        let scores = [0.5f32, 2.0, -1.0, 1.5, 0.1, f32::NEG_INFINITY, 1.9, -0.2];
        let kept = |top_k, top_p| -> Vec<usize> {
            let c = cut(&scores, top_k, top_p, 0.0);
            (0..scores.len())
                .filter(|&i| order_key(scores[i]) >= c)
                .collect()
        };
        assert_eq!(kept(0, 1.0).len(), 8);
        assert_eq!(kept(3, 1.0), [1, 3, 6]);
        // Masses relative to the max: 1, e^-0.1 = 0.905, e^-0.5 = 0.607, ... of a total of
        // 3.04 over all: 2.0 and 1.9 hold 62.6%, with 1.5 82.5%.
        assert_eq!(kept(0, 0.5), [1, 6]);
        assert_eq!(kept(0, 0.7), [1, 3, 6]);
        // top-p over the top-k only: of the three, 2.0 and 1.9 hold 75.8%.
        assert_eq!(kept(3, 0.75), [1, 6]);
        assert_eq!(kept(0, 1e-6), [1]);
    }

    /// min-p keeps the scores within ln(min_p) of the max, before top-p's mass is taken.
    #[test]
    fn min_p_keeps_the_tokens_near_the_most_likely() {
        let scores = [0.5f32, 2.0, -1.0, 1.5, 0.1, 1.9];
        let kept = |top_p, min_p: f32| -> Vec<usize> {
            let c = cut(&scores, 0, top_p, min_p);
            (0..scores.len())
                .filter(|&i| order_key(scores[i]) >= c)
                .collect()
        };
        // e^-0.1 = 0.905, e^-0.5 = 0.607, e^-1.5 = 0.223.
        assert_eq!(kept(1.0, 0.5), [1, 3, 5]);
        assert_eq!(kept(1.0, 0.95), [1]);
        assert_eq!(kept(1.0, 0.2), [0, 1, 3, 5]);
        // top-p over the min-p survivors: 2.0 and 1.9 hold 1.905 / 2.51 = 75.8% of them.
        assert_eq!(kept(0.75, 0.5), [1, 5]);
    }

    #[test]
    fn ties_at_the_cut_are_all_kept() {
        let scores = [1.0f32, 3.0, 1.0, 2.0];
        let c = cut(&scores, 3, 1.0, 0.0);
        assert_eq!(c, order_key(1.0));
        assert_eq!(scores.iter().filter(|&&s| order_key(s) >= c).count(), 4);
    }
}
