//! Sampling by the Gumbel-max trick with counter-based noise: the token is the argmax of
//! `logit / T + G`, G standard Gumbel noise drawn from Philox4x32-10 keyed by the sample's
//! seed and counted by (vocabulary index / 4, position, sample index). No state is carried
//! from one draw to the next, so a GPU draws every row at once, each element independently,
//! and the result depends on neither the batch nor the order. This module is the reference
//! of the device kernel (`kernels/sample.cu`): the same noise and scores in f32, the same
//! choice (lowest index on ties); log-sum-exps more precisely (see [`LogSumExp`]). Tests
//! and `dppo doctor` compare the two.

use crate::sampler::{Sampled, SamplingParams};

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

/// Whether the Gumbel sampler (host reference or device kernel) draws what `params` ask:
/// plain temperature or greedy, no top-k, top-p or top logprobs.
pub fn handles(params: &SamplingParams) -> bool {
    params.top_k == 0 && params.top_p >= 1.0 && params.top_logprobs == 0
}

/// One draw from `logits` (NaN counts as -inf) at inverse temperature `inv_t` (0:
/// greedy): the argmax of `logit * inv_t + G` (of the logit itself when greedy; the lowest
/// index on ties), its logprob under the tempered softmax (the untempered one when greedy)
/// and its untempered logprob, as the kernel returns them.
pub fn draw(logits: &[f32], inv_t: f32, key: &DrawKey) -> (u32, f32, f32) {
    let greedy = inv_t == 0.0;
    let scale = if greedy { 1.0 } else { inv_t };
    let (mut best, mut best_score) = (0usize, f32::NEG_INFINITY);
    let mut raw = LogSumExp::default();
    let mut tempered = LogSumExp::default();
    let clean = |l: f32| if l.is_nan() { f32::NEG_INFINITY } else { l };
    for (i, &l) in logits.iter().enumerate() {
        let l = clean(l);
        raw.push(l);
        tempered.push(l * scale);
        let score = if greedy {
            l
        } else {
            l * scale + gumbel(key, i)
        };
        if score > best_score {
            (best, best_score) = (i, score);
        }
    }
    let l = clean(logits[best]);
    let model = l - raw.value();
    let logprob = if greedy {
        model
    } else {
        l * scale - tempered.value()
    };
    (best as u32, logprob, model)
}

/// The inverse temperature a draw for `params` uses: 0 when greedy.
pub fn inverse_temperature(params: &SamplingParams) -> f32 {
    if params.is_greedy() {
        0.0
    } else {
        1.0 / params.temperature
    }
}

/// A draw's result as the worker streams it.
pub fn sampled((token, logprob, model): (u32, f32, f32), model_logprobs: bool) -> Sampled {
    Sampled {
        token_id: token,
        logprob,
        model_logprob: model_logprobs.then_some(model),
        top_logprobs: Vec::new(),
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
            let mut counts = [0usize; 9];
            for position in 0..n {
                let key = DrawKey {
                    key: 0x5eed,
                    position,
                    sample_index: 3,
                };
                counts[draw(&logits, 1.0 / temperature, &key).0 as usize] += 1;
            }
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
        let (token, logprob, model) = draw(&logits, 2.0, &key);
        let l = logits[token as usize];
        assert!((logprob - (l / 0.5 - lse(0.5))).abs() < 1e-5);
        assert!((model - (l - lse(1.0))).abs() < 1e-5);
        let (token, logprob, _) = draw(&logits, 0.0, &key);
        assert_eq!(token, 1);
        assert!((logprob - (2.0 - lse(1.0))).abs() < 1e-5);
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
