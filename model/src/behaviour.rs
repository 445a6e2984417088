//! The behaviour policy of one logits row: the token weights and log-probabilities the
//! engine's sampler draws with, in its exact arithmetic. The sampler and the learner both
//! compute them here, so that on the CPU in f32 the learner's logprob of a sampled token is
//! the sampler's to the bit, and a synchronous step's ratio is exactly 1.

use std::borrow::Cow;

use crate::fast_exp::exp_nonpositive;

/// How the sampler shapes a row's softmax: temperature, then min-p, top-k and top-p (the
/// order of [`candidates`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shaping {
    /// Greater than 0 (greedy decoding has no behaviour distribution to shape).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 keeps all.
    pub top_k: usize,
    /// Keep the smallest most-likely set with this much mass; 1 keeps all.
    pub top_p: f32,
    /// Keep the tokens at least this likely relative to the most likely one; 0 keeps all.
    pub min_p: f32,
}

impl Shaping {
    /// The full softmax at temperature 1.
    pub const NONE: Shaping = Shaping {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
    };

    /// The full softmax of the logits divided by `temperature`, restricted to its top-`top_p`
    /// nucleus: what an RL rollout samples from.
    pub fn nucleus(temperature: f32, top_p: f32) -> Self {
        Self {
            temperature,
            top_p,
            ..Self::NONE
        }
    }

    /// The factor the logits are multiplied by.
    pub fn inv_temperature(&self) -> f32 {
        1.0 / self.temperature
    }

    /// Whether some tokens are left out (min-p, top-k or top-p active).
    pub fn truncates(&self) -> bool {
        self.top_k != 0 || self.top_p < 1.0 || self.min_p > 0.0
    }
}

/// The row with NaN logits as -inf (borrowed when it has none). One pass without early
/// exit, so that it runs as vector code.
pub fn cleaned(logits: &[f32]) -> Cow<'_, [f32]> {
    if logits.iter().fold(false, |nan, x| nan | x.is_nan()) {
        Cow::Owned(
            logits
                .iter()
                .map(|&x| if x.is_nan() { f32::NEG_INFINITY } else { x })
                .collect(),
        )
    } else {
        Cow::Borrowed(logits)
    }
}

/// The largest of `x` (no NaN), in sixteen running maxima (the maximum does not depend on
/// the order, so this is only for speed).
pub fn max_of(x: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = x.chunks_exact(16);
    let tail = chunks
        .remainder()
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    for c in chunks {
        for (lane, &v) in lanes.iter_mut().zip(c) {
            *lane = lane.max(v);
        }
    }
    lanes.into_iter().fold(tail, f32::max)
}

/// Sum in f64 with eight running sums over `i mod 8`, then added in order.
pub fn sum_f64(x: &[f32]) -> f64 {
    let mut lanes = [0f64; 8];
    let chunks = x.chunks_exact(8);
    let tail: f64 = chunks.remainder().iter().map(|&v| f64::from(v)).sum();
    for c in chunks {
        for (lane, &v) in lanes.iter_mut().zip(c) {
            *lane += f64::from(v);
        }
    }
    lanes.iter().sum::<f64>() + tail
}

/// The weight `exp((l - max) * inv_t)` of a logit `l` of a row whose largest is `max`, in
/// f32 (in [0, 1]: the most likely token weighs 1).
#[inline(always)]
pub fn weight(l: f32, max: f32, inv_t: f32) -> f32 {
    exp_nonpositive((l - max) * inv_t)
}

/// Tokens per chunk of the full row's weight sums.
pub const CHUNK: usize = 1024;

/// The weights of a whole row, their sums per [`CHUNK`] tokens (each by [`sum_f64`]) and
/// the total of those in order: the normaliser of the untruncated draw.
pub fn full_weights(logits: &[f32], max: f32, inv_t: f32) -> (Vec<f32>, Vec<f64>, f64) {
    let weights: Vec<f32> = logits.iter().map(|&l| weight(l, max, inv_t)).collect();
    let chunk_sums: Vec<f64> = weights.chunks(CHUNK).map(sum_f64).collect();
    let z = chunk_sums.iter().sum();
    (weights, chunk_sums, z)
}

/// A token's log-probability from its weight and the normaliser.
#[inline(always)]
pub fn log_prob(weight: f64, z: f64) -> f32 {
    (weight / z).ln() as f32
}

/// Ordering by logit, highest first, lower id on ties.
fn by_rank(logits: &[f32]) -> impl Fn(&usize, &usize) -> std::cmp::Ordering + '_ {
    |a, b| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b))
}

/// Ids of the `k` largest logits, largest first (lower ids first on ties).
pub fn top_ids(logits: &[f32], k: usize) -> Vec<usize> {
    if k == 0 {
        return Vec::new();
    }
    let mut ids: Vec<usize> = (0..logits.len()).collect();
    if k < ids.len() {
        ids.select_nth_unstable_by(k - 1, by_rank(logits));
        ids.truncate(k);
    }
    ids.sort_unstable_by(by_rank(logits));
    ids
}

/// The tokens kept by min-p, top-k and top-p (at least one of them active) with their
/// weights in f64 (the most likely weighs 1), most likely first; the normaliser of a
/// truncated draw is their sum in this order.
pub fn candidates(logits: &[f32], shaping: &Shaping, max: f32) -> (Vec<usize>, Vec<f64>) {
    let inv_t = shaping.inv_temperature();
    let k = match shaping.top_k {
        0 => logits.len(),
        k => k.min(logits.len()),
    };
    let mut ids = top_ids(logits, k);
    let mut weights: Vec<f64> = ids
        .iter()
        .map(|&i| f64::from(weight(logits[i], max, inv_t)))
        .collect();
    if shaping.min_p > 0.0 {
        let keep = weights.partition_point(|&w| w >= f64::from(shaping.min_p));
        ids.truncate(keep.max(1));
        weights.truncate(keep.max(1));
    }
    if shaping.top_p < 1.0 {
        let z: f64 = weights.iter().sum();
        let mut mass = 0.0;
        let keep = weights
            .iter()
            .position(|w| {
                mass += w / z;
                mass >= f64::from(shaping.top_p)
            })
            .map_or(weights.len(), |j| j + 1);
        ids.truncate(keep);
        weights.truncate(keep);
    }
    (ids, weights)
}

/// The tokens of a row that the behaviour distribution keeps, `None` for all of them:
/// [`candidates`], plus `target` where it is missing (a token drawn at other weights may
/// lie outside this row's set; it keeps a finite logprob).
pub fn kept(logits: &[f32], target: usize, shaping: &Shaping) -> Option<Vec<usize>> {
    if !shaping.truncates() {
        return None;
    }
    let logits = cleaned(logits);
    Some(kept_weights(&logits, target, shaping, max_of(&logits)).0)
}

/// [`candidates`] with `target` appended (at its weight) where it is missing.
fn kept_weights(
    logits: &[f32],
    target: usize,
    shaping: &Shaping,
    max: f32,
) -> (Vec<usize>, Vec<f64>) {
    let (mut ids, mut weights) = candidates(logits, shaping, max);
    if !ids.contains(&target) {
        ids.push(target);
        let inv_t = shaping.inv_temperature();
        weights.push(f64::from(weight(logits[target], max, inv_t)));
    }
    (ids, weights)
}

/// The behaviour logprob of `target` in a logits row, and the entropy (in f64, a metric)
/// of the shaped distribution: the logprob is the sampler's for a draw of `target` from
/// this row, bit for bit.
pub fn target_stats(logits: &[f32], target: usize, shaping: &Shaping) -> (f32, f64) {
    let logits = cleaned(logits);
    let max = max_of(&logits);
    let inv_t = shaping.inv_temperature();
    // The entropy -sum p ln p with ln p = (l - max) / t - ln z, over the kept tokens.
    let entropy = |ids: &mut dyn Iterator<Item = (usize, f64)>, z: f64| {
        let mean: f64 = ids
            .map(|(i, w)| w * f64::from((logits[i] - max) * inv_t))
            .filter(|x| x.is_finite())
            .sum::<f64>()
            / z;
        z.ln() - mean
    };
    if !shaping.truncates() {
        let (weights, _, z) = full_weights(&logits, max, inv_t);
        let h = entropy(&mut weights.iter().map(|&w| f64::from(w)).enumerate(), z);
        return (log_prob(f64::from(weights[target]), z), h);
    }
    let (ids, weights) = kept_weights(&logits, target, shaping, max);
    let z: f64 = weights.iter().sum();
    let w_target = weights[ids.iter().position(|&i| i == target).expect("kept")];
    let h = entropy(&mut ids.iter().copied().zip(weights.iter().copied()), z);
    (log_prob(w_target, z), h)
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOGITS: [f32; 8] = [1.0, 3.0, -2.0, 3.0, 0.5, 2.0, -1.0, 2.5];

    /// Reference in f64: the shaped distribution's probabilities, by sorting.
    fn reference(logits: &[f32], s: &Shaping) -> Vec<f64> {
        let scaled: Vec<f64> = logits
            .iter()
            .map(|&l| f64::from(l) / f64::from(s.temperature))
            .collect();
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| scaled[b].total_cmp(&scaled[a]).then(a.cmp(&b)));
        let max = scaled[order[0]];
        order.retain(|&i| (scaled[i] - max).exp() >= f64::from(s.min_p));
        if s.top_k > 0 {
            order.truncate(s.top_k);
        }
        let z: f64 = order.iter().map(|&i| (scaled[i] - max).exp()).sum();
        let (mut kept, mut mass) = (Vec::new(), 0.0);
        for &i in &order {
            kept.push(i);
            mass += (scaled[i] - max).exp() / z;
            if mass >= f64::from(s.top_p) {
                break;
            }
        }
        let z: f64 = kept.iter().map(|&i| (scaled[i] - max).exp()).sum();
        let mut probs = vec![0.0; logits.len()];
        for &i in &kept {
            probs[i] = (scaled[i] - max).exp() / z;
        }
        probs
    }

    #[test]
    fn target_stats_are_the_shaped_distributions_logprob_and_entropy() {
        for s in [
            Shaping::NONE,
            Shaping::nucleus(0.7, 1.0),
            Shaping::nucleus(1.3, 0.8),
            Shaping {
                top_k: 5,
                min_p: 0.1,
                ..Shaping::nucleus(0.7, 0.9)
            },
        ] {
            let probs = reference(&LOGITS, &s);
            let h: f64 = probs
                .iter()
                .filter(|&&p| p > 0.0)
                .map(|p| -p * p.ln())
                .sum();
            for (t, &p) in probs.iter().enumerate() {
                if p == 0.0 {
                    assert!(kept(&LOGITS, t, &s).unwrap().contains(&t), "{s:?}: {t}");
                    continue;
                }
                let (lp, entropy) = target_stats(&LOGITS, t, &s);
                assert!((f64::from(lp) - p.ln()).abs() < 1e-6, "{s:?}: token {t}");
                assert!(
                    (entropy - h).abs() < 1e-6,
                    "{s:?}: entropy {entropy} vs {h}"
                );
            }
        }
    }

    #[test]
    fn a_target_outside_the_set_is_kept_with_its_own_weight() {
        let s = Shaping::nucleus(1.0, 0.5);
        // Token 2 (logit -2) lies far outside the nucleus of tokens 1 and 3.
        let kept_ids = kept(&LOGITS, 2, &s).unwrap();
        assert_eq!(kept_ids.last(), Some(&2));
        let (lp, _) = target_stats(&LOGITS, 2, &s);
        let z: f64 = kept_ids
            .iter()
            .map(|&i| f64::from(LOGITS[i] - 3.0).exp())
            .sum();
        assert!((f64::from(lp) - (-5.0 - z.ln())).abs() < 1e-5);
        assert_eq!(kept(&LOGITS, 2, &Shaping::NONE), None);
    }

    #[test]
    fn nan_logits_weigh_nothing() {
        let mut logits = LOGITS;
        logits[1] = f32::NAN;
        let (lp, h) = target_stats(&logits, 3, &Shaping::NONE);
        let clean: Vec<f32> = logits
            .iter()
            .map(|&l| if l.is_nan() { -1e30 } else { l })
            .collect();
        let (want, _) = target_stats(&clean, 3, &Shaping::NONE);
        assert_eq!(lp, want);
        assert!(h.is_finite());
    }
}
