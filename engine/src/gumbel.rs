//! Sampling by the Gumbel-max trick with counter-based noise: the token is the argmax of
//! `logit / T + G`, G standard Gumbel noise drawn from Philox4x32-10 keyed by the sample's
//! seed and counted by (vocabulary index / 4, position, sample index). No state is carried
//! from one draw to the next, so a GPU draws every row at once, each element independently,
//! and the result depends on neither the batch nor the order. This module is the reference
//! of the device kernel (`kernels/sample.cu`): the same noise and scores in f32, the same
//! choice (lowest index on ties); log-sum-exps more precisely (see [`LogSumExp`]). Tests
//! and `dppo doctor` compare the two.

use crate::sampler::{top_ids, Sampled, SamplingParams, MAX_TOP_LOGPROBS};
use crate::truncation;

const PHILOX_M0: u32 = 0xD251_1F53;
const PHILOX_M1: u32 = 0xCD9E_8D57;
const PHILOX_W0: u32 = 0x9E37_79B9;
const PHILOX_W1: u32 = 0xBB67_AE85;

/// Philox4x32 with 10 rounds (Salmon et al., SC'11): four random words of `counter` under
/// `key`.
pub fn philox4x32(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let (mut c, mut k) = (counter, key);
    for _ in 0..10 {
        let p0 = u64::from(PHILOX_M0) * u64::from(c[0]);
        let p1 = u64::from(PHILOX_M1) * u64::from(c[2]);
        let (hi0, lo0) = ((p0 >> 32) as u32, p0 as u32);
        let (hi1, lo1) = ((p1 >> 32) as u32, p1 as u32);
        c = [hi1 ^ c[1] ^ k[0], lo1, hi0 ^ c[3] ^ k[1], lo0];
        k = [k[0].wrapping_add(PHILOX_W0), k[1].wrapping_add(PHILOX_W1)];
    }
    c
}

/// Where one draw's noise comes from: the sample's key and its counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DrawKey {
    /// The sample's stream: derived from the request's seed and the sample's index.
    pub key: u64,
    /// The position of the token drawn (its index in the sequence).
    pub position: u32,
    /// The sample's index in its request.
    pub sample_index: u32,
}

impl DrawKey {
    /// The Philox key words.
    pub fn key_words(&self) -> [u32; 2] {
        [self.key as u32, (self.key >> 32) as u32]
    }
}

/// Uniform in (0, 1) from the top 23 bits of `x`: `(bits + 0.5) / 2^23`, exact in f32.
pub fn uniform(x: u32) -> f32 {
    ((x >> 9) as f32 + 0.5) * (1.0 / 8_388_608.0)
}

/// Standard Gumbel noise of vocabulary index `i` for `draw`.
pub fn gumbel(draw: &DrawKey, i: usize) -> f32 {
    let words = philox4x32(
        [(i / 4) as u32, draw.position, draw.sample_index, 0],
        draw.key_words(),
    );
    -(-uniform(words[i % 4]).ln()).ln()
}

/// What one draw asks, as the kernel reads it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DrawParams {
    /// 0: greedy.
    pub inv_temperature: f32,
    /// 0: off.
    pub top_k: u32,
    /// 1: off.
    pub top_p: f32,
    /// 0: off.
    pub min_p: f32,
    /// How many most likely untempered tokens to return with their logprobs.
    pub top_logprobs: u32,
}

impl DrawParams {
    /// The draw a request's sampling parameters ask for.
    pub fn of(params: &SamplingParams) -> Self {
        Self {
            inv_temperature: if params.is_greedy() {
                0.0
            } else {
                1.0 / params.temperature
            },
            top_k: params.top_k.min(u32::MAX as usize) as u32,
            top_p: params.top_p,
            min_p: params.min_p,
            top_logprobs: params.top_logprobs.min(MAX_TOP_LOGPROBS) as u32,
        }
    }
}

/// One draw's result.
#[derive(Debug, Clone, PartialEq)]
pub struct Drawn {
    pub token: u32,
    /// Under the tempered, truncated and renormalised distribution (untempered if greedy).
    pub logprob: f32,
    /// Under the untempered full softmax.
    pub model_logprob: f32,
    /// The most likely untempered tokens and their logprobs, most likely first.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// One draw from `logits` (NaN counts as -inf): scores `logit * inv_t` (the logit itself
/// when greedy), truncated to those reaching [`truncation::cut`] (min-p and top-k, then
/// top-p; not when greedy), and the argmax of score + G over them (lowest index on ties), as the
/// kernel draws it.
pub fn draw(logits: &[f32], params: &DrawParams, key: &DrawKey) -> Drawn {
    let greedy = params.inv_temperature == 0.0;
    let scale = if greedy { 1.0 } else { params.inv_temperature };
    let logits: Vec<f32> = logits
        .iter()
        .map(|&l| if l.is_nan() { f32::NEG_INFINITY } else { l })
        .collect();
    let scores: Vec<f32> = logits.iter().map(|&l| l * scale).collect();
    let cut = if greedy {
        0
    } else {
        truncation::cut(&scores, params.top_k as usize, params.top_p, params.min_p)
    };
    let (mut best, mut best_score) = (0usize, f32::NEG_INFINITY);
    let mut raw = LogSumExp::default();
    let mut kept = LogSumExp::default();
    for (i, (&l, &s)) in logits.iter().zip(&scores).enumerate() {
        raw.push(l);
        if truncation::order_key(s) < cut {
            continue;
        }
        kept.push(s);
        let score = if greedy { l } else { s + gumbel(key, i) };
        if score > best_score {
            (best, best_score) = (i, score);
        }
    }
    let model_logprob = logits[best] - raw.value();
    let top_logprobs = top_ids(&logits, params.top_logprobs as usize)
        .into_iter()
        .map(|i| (i as u32, logits[i] - raw.value()))
        .collect();
    Drawn {
        token: best as u32,
        logprob: if greedy {
            model_logprob
        } else {
            scores[best] - kept.value()
        },
        model_logprob,
        top_logprobs,
    }
}

/// A draw's result as the worker streams it.
pub fn sampled(d: Drawn, model_logprobs: bool) -> Sampled {
    Sampled {
        token_id: d.token,
        logprob: d.logprob,
        model_logprob: model_logprobs.then_some(d.model_logprob),
        top_logprobs: d.top_logprobs,
    }
}

/// A running log-sum-exp: the max in f32, the sum in f64. The kernel sums in f32 over a
/// tree (each thread a strided share, then the block), which errs by about 3e-7 over a
/// 151,936-logit row; one f32 sum in row order would err by about 2.4e-4, so the reference
/// sums in f64.
#[derive(Debug, Clone, Copy)]
pub struct LogSumExp {
    max: f32,
    sum: f64,
}

impl Default for LogSumExp {
    fn default() -> Self {
        Self {
            max: f32::NEG_INFINITY,
            sum: 0.0,
        }
    }
}

impl LogSumExp {
    /// Adds `x`.
    pub fn push(&mut self, x: f32) {
        if x == f32::NEG_INFINITY {
            return;
        }
        if x > self.max {
            self.sum = self.sum * f64::from(self.max - x).exp() + 1.0;
            self.max = x;
        } else {
            self.sum += f64::from(x - self.max).exp();
        }
    }

    /// `log(sum(exp(x)))` of what was pushed.
    pub fn value(&self) -> f32 {
        (f64::from(self.max) + self.sum.ln()) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampler::{sample, SeqRng};

    fn plain(inv_temperature: f32) -> DrawParams {
        DrawParams {
            inv_temperature,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            top_logprobs: 0,
        }
    }

    /// How often each token of a 9-logit row is drawn at positions `0..n` of one sample.
    fn token_counts(
        logits: &[f32; 9],
        params: &DrawParams,
        n: u32,
        sample_index: u32,
    ) -> [usize; 9] {
        let mut counts = [0usize; 9];
        for position in 0..n {
            let key = DrawKey {
                key: 0x5eed,
                position,
                sample_index,
            };
            counts[draw(logits, params, &key).token as usize] += 1;
        }
        counts
    }

    /// Truncated draws follow the renormalised tempered softmax over the kept tokens and
    /// never leave them (chi-square over 20,000 draws; 0.999 quantiles 13.8 and 16.3 for 2
    /// and 3 degrees of freedom).
    #[test]
    fn top_k_and_top_p_draws_follow_the_kept_tokens_softmax() {
        let logits = [1.0f32, 0.5, -0.3, 2.0, f32::NAN, 0.0, -1.5, 1.2, 0.7];
        let t = 0.7f32;
        // (top_k, top_p, kept, 0.999 quantile): top-3 = {3, 7, 0}; at T 0.7 the masses of
        // 2.0, 1.2, 1.0, 0.7 relative to the max are 1, 0.319, 0.239, 0.156 (total with the
        // rest 1.93): top-p 0.85 keeps four of them, 1.71 / 1.93 = 88.7% >= 85% > 80.6%.
        let cases = [
            (3, 1.0, vec![0, 3, 7], 13.8),
            (0, 0.85, vec![0, 3, 7, 8], 16.3),
        ];
        for (top_k, top_p, kept, quantile) in cases {
            let params = DrawParams {
                top_k,
                top_p,
                ..plain(1.0 / t)
            };
            let n = 20_000;
            let counts = token_counts(&logits, &params, n, 1);
            let weight = |i: usize| (f64::from(logits[i]) / f64::from(t)).exp();
            let z: f64 = kept.iter().map(|&i| weight(i)).sum();
            let mut chi2 = 0.0;
            for (i, &c) in counts.iter().enumerate() {
                if kept.contains(&i) {
                    let expected = weight(i) / z * n as f64;
                    chi2 += (c as f64 - expected).powi(2) / expected;
                } else {
                    assert_eq!(c, 0, "token {i} is outside {kept:?}");
                }
            }
            assert!(
                chi2 < quantile,
                "top_k {top_k} top_p {top_p}: chi2 {chi2}, {counts:?}"
            );
            // The logprob is the renormalised one over the kept tokens.
            let key = DrawKey {
                key: 1,
                position: 2,
                sample_index: 3,
            };
            let d = draw(&logits, &params, &key);
            let want = (weight(d.token as usize) / z).ln() as f32;
            assert!((d.logprob - want).abs() < 1e-5, "{} vs {want}", d.logprob);
        }
    }

    #[test]
    fn top_logprobs_are_the_host_samplers() {
        let logits = [0.3f32, 2.0, 2.0, -1.0, 1.5, f32::NAN, 0.9];
        let params = SamplingParams {
            temperature: 0.8,
            top_logprobs: 4,
            ..SamplingParams::default()
        };
        let key = DrawKey {
            key: 5,
            position: 0,
            sample_index: 0,
        };
        let got = draw(&logits, &DrawParams::of(&params), &key).top_logprobs;
        let want = sample(&logits, &params, &mut SeqRng::new(0, 0)).top_logprobs;
        assert_eq!(got.len(), 4);
        for ((a, x), (b, y)) in got.iter().zip(&want) {
            assert_eq!(a, b);
            assert!((x - y).abs() < 1e-6, "{x} vs {y}");
        }
    }

    /// Random123's known-answer vectors for philox4x32-10.
    #[test]
    fn philox_matches_the_published_known_answers() {
        assert_eq!(
            philox4x32([0; 4], [0; 2]),
            [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]
        );
        assert_eq!(
            philox4x32([u32::MAX; 4], [u32::MAX; 2]),
            [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]
        );
        assert_eq!(
            philox4x32(
                [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
                [0xa409_3822, 0x299f_31d0]
            ),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn uniforms_stay_inside_the_open_interval() {
        assert!(uniform(0) > 0.0 && uniform(u32::MAX) < 1.0);
        assert_eq!(uniform(0), 0.5 / 8_388_608.0);
    }

    /// Draws at many positions follow softmax(logits / T): a chi-square test over a small
    /// vocabulary (20,000 draws, 7 degrees of freedom, the 0.999 quantile is 24.3).
    #[test]
    fn draws_follow_the_tempered_softmax() {
        let logits = [1.0f32, 0.5, -0.3, 2.0, f32::NAN, 0.0, -1.5, 1.2, 0.7];
        for temperature in [1.0f32, 0.7] {
            let n = 20_000;
            let counts = token_counts(&logits, &plain(1.0 / temperature), n, 3);
            assert_eq!(counts[4], 0, "a NaN logit is never drawn");
            let weights: Vec<f64> = logits
                .iter()
                .map(|&l| {
                    if l.is_nan() {
                        0.0
                    } else {
                        (f64::from(l) / f64::from(temperature)).exp()
                    }
                })
                .collect();
            let z: f64 = weights.iter().sum();
            let chi2: f64 = weights
                .iter()
                .zip(counts)
                .filter(|(w, _)| **w > 0.0)
                .map(|(w, c)| {
                    let expected = w / z * n as f64;
                    (c as f64 - expected).powi(2) / expected
                })
                .sum();
            assert!(
                chi2 < 24.3,
                "T {temperature}: chi2 {chi2}, counts {counts:?}"
            );
        }
    }

    #[test]
    fn logprobs_are_the_tempered_and_untempered_softmax_and_greedy_takes_the_first_max() {
        let logits = [0.3f32, 2.0, 2.0, -1.0];
        let lse = |t: f32| logits.iter().map(|l| (l / t).exp()).sum::<f32>().ln();
        let key = DrawKey {
            key: 9,
            position: 4,
            sample_index: 0,
        };
        let d = draw(&logits, &plain(2.0), &key);
        let l = logits[d.token as usize];
        assert!((d.logprob - (l / 0.5 - lse(0.5))).abs() < 1e-5);
        assert!((d.model_logprob - (l - lse(1.0))).abs() < 1e-5);
        let d = draw(&logits, &plain(0.0), &key);
        assert_eq!(d.token, 1);
        assert!((d.logprob - (2.0 - lse(1.0))).abs() < 1e-5);
    }

    #[test]
    fn samples_and_positions_draw_independent_noise() {
        let a = DrawKey {
            key: 1,
            position: 0,
            sample_index: 0,
        };
        let b = DrawKey {
            sample_index: 1,
            ..a
        };
        let c = DrawKey { position: 1, ..a };
        let noise = |k: &DrawKey| (0..8).map(|i| gumbel(k, i)).collect::<Vec<_>>();
        assert_ne!(noise(&a), noise(&b));
        assert_ne!(noise(&a), noise(&c));
        assert_eq!(noise(&a), noise(&a));
    }
}
