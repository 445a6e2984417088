//! Token sampling from one sequence's logits row. Each sample draws from its own RNG, so a
//! seeded result never depends on what else is in the batch.

use dppo_model::behaviour::{self, Shaping};
use rand::{rngs::StdRng, Rng, SeedableRng};

pub use behaviour::top_ids;

/// Most alternatives a request may ask for per token (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Per-request sampling parameters (OpenAI / vLLM vocabulary).
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 samples greedily.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest most-likely set with this much mass; 1 disables. In (0, 1].
    pub top_p: f32,
    /// Keep the tokens at least this likely relative to the most likely one (vLLM's
    /// min_p, applied before top-k and top-p); 0 disables. In [0, 1].
    pub min_p: f32,
    /// Per-request seed; sample `i` of the request draws from `SeqRng::new(seed, i)`.
    pub seed: Option<u64>,
    /// Also return the untempered full-softmax logprob of each sampled token.
    pub model_logprobs: bool,
    /// Also return this many most likely tokens of the untempered distribution.
    pub top_logprobs: usize,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            model_logprobs: false,
            top_logprobs: 0,
        }
    }
}

impl SamplingParams {
    /// Checks ranges; the error names the field and the value.
    pub(crate) fn validate(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!(
                "temperature must be >= 0 and finite, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(format!(
                "top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {}",
                self.top_logprobs
            ));
        }
        Ok(())
    }

    /// Whether sampling is greedy (temperature 0).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// The shaping of the distribution drawn from (when not greedy).
    pub fn shaping(&self) -> Shaping {
        Shaping {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
        }
    }
}

/// One sampled token.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token_id: u32,
    /// Log-probability under the distribution sampled from (see [`sample`]).
    pub logprob: f32,
    /// Untempered full-softmax log-probability, when requested.
    pub model_logprob: Option<f32>,
    /// The `top_logprobs` most likely tokens, untempered, most likely first.
    pub top_logprobs: Vec<(u32, f32)>,
}

/// The seed of sample `index`'s stream in a request seeded with `seed` (the host RNG's
/// and the device sampler's noise key).
pub fn stream_seed(seed: u64, index: u64) -> u64 {
    seed ^ index.wrapping_add(1).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

/// A sample's random stream.
#[derive(Debug, Clone)]
pub struct SeqRng(StdRng);

impl SeqRng {
    /// The stream of sample `index` of a request seeded with `seed`: reproducible, and
    /// different for the different samples of one request.
    pub fn new(seed: u64, index: u64) -> Self {
        Self(StdRng::seed_from_u64(stream_seed(seed, index)))
    }

    /// An unseeded stream.
    pub fn from_entropy() -> Self {
        Self(StdRng::from_os_rng())
    }
}

/// Samples one token from `logits` (one row, vocab-sized), in this order:
/// 1. NaN logits count as -inf.
/// 2. Greedy (temperature 0): the argmax, lowest id on ties. Its `logprob` is the untempered
///    full-softmax logprob (a point mass would say 0, which tells nothing).
/// 3. Otherwise divide by the temperature;
/// 4. min-p: keep the tokens whose tempered probability is at least `min_p` times the
///    largest;
/// 5. top-k: keep the k largest of those (ties broken by lower id);
/// 6. top-p: keep the smallest prefix of the remaining tokens, most likely first, whose
///    renormalised mass reaches `top_p` (at least one token);
/// 7. draw with one uniform number by inverse CDF over the kept tokens.
///
/// `logprob` is the log-probability of the drawn token under the distribution of steps 3-6,
/// renormalised: the behaviour policy's logprob that RL importance ratios need.
pub fn sample(logits: &[f32], params: &SamplingParams, rng: &mut SeqRng) -> Sampled {
    let logits = behaviour::cleaned(logits);
    let logits: &[f32] = &logits;
    let max32 = behaviour::max_of(logits);
    let max = max32 as f64;
    let log_z = std::cell::OnceCell::new();
    let raw = |i: usize| {
        let log_z = *log_z.get_or_init(|| {
            let z: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
            z.ln()
        });
        (logits[i] as f64 - max - log_z) as f32
    };
    let top_logprobs = top_ids(logits, params.top_logprobs)
        .into_iter()
        .map(|i| (i as u32, raw(i)))
        .collect();
    if params.is_greedy() {
        let best = (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });
        let lp = raw(best);
        return Sampled {
            token_id: best as u32,
            logprob: lp,
            model_logprob: params.model_logprobs.then_some(lp),
            top_logprobs,
        };
    }
    // Weights exp((l - max) / t) in f32 (each in [0, 1]), summed in f64, and the logprob,
    // in `behaviour`'s arithmetic: the learner's.
    let shaping = params.shaping();
    let (token, logprob) = if !shaping.truncates() {
        let (weights, chunk_sums, z) =
            behaviour::full_weights(logits, max32, shaping.inv_temperature());
        let token = draw_from_all(&weights, &chunk_sums, rng.0.random::<f64>() * z);
        (token, behaviour::log_prob(f64::from(weights[token]), z))
    } else {
        let (ids, weights) = behaviour::candidates(logits, &shaping, max32);
        let z: f64 = weights.iter().sum();
        let u = rng.0.random::<f64>() * z;
        let pick = first_past(weights.iter().copied(), 0.0, u).map_or(weights.len() - 1, |p| p.0);
        (ids[pick], behaviour::log_prob(weights[pick], z))
    };
    Sampled {
        token_id: token as u32,
        logprob,
        model_logprob: params.model_logprobs.then(|| raw(token)),
        top_logprobs,
    }
}

/// Inverse-CDF draw over every token for `u` uniform in [0, z), from
/// [`behaviour::full_weights`]' weights, chunk sums and total `z`: the draw finds its chunk
/// by the chunk totals, then its token by a running sum inside the chunk. Fixed orders, and
/// about one pass over the vocabulary instead of a dependent f64 add per token.
fn draw_from_all(weights: &[f32], chunk_sums: &[f64], u: f64) -> usize {
    let last = chunk_sums.len() - 1;
    let (chunk, before) = first_past(chunk_sums.iter().copied(), 0.0, u)
        .unwrap_or_else(|| (last, chunk_sums[..last].iter().sum()));
    let start = chunk * behaviour::CHUNK;
    let in_chunk = &weights[start..(start + behaviour::CHUNK).min(weights.len())];
    let pick = first_past(in_chunk.iter().map(|&w| f64::from(w)), before, u)
        .map(|p| p.0)
        // Rounding can leave `u` past the running sum's end: the chunk's last drawable token.
        .or_else(|| in_chunk.iter().rposition(|&w| w > 0.0))
        .unwrap_or(in_chunk.len() - 1);
    start + pick
}

/// Inverse CDF: the first index at which `start` plus the running sum of `weights` passes
/// `u`, with the running total just before it.
fn first_past(weights: impl IntoIterator<Item = f64>, start: f64, u: f64) -> Option<(usize, f64)> {
    let mut acc = start;
    weights.into_iter().enumerate().find_map(|(i, w)| {
        let before = acc;
        acc += w;
        (u < acc).then_some((i, before))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOGITS: [f32; 8] = [1.0, 3.0, -2.0, 3.0, 0.5, 2.0, -1.0, 2.5];

    fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p: 0.0,
            seed: Some(1),
            model_logprobs: true,
            top_logprobs: 3,
        }
    }

    /// Independent reference: probabilities after temperature, min-p, top-k and top-p by
    /// sorting.
    fn reference(logits: &[f32], p: &SamplingParams) -> Vec<f64> {
        let scaled: Vec<f64> = logits
            .iter()
            .map(|&l| l as f64 / p.temperature as f64)
            .collect();
        let mut order: Vec<usize> = (0..logits.len()).collect();
        order.sort_by(|&a, &b| scaled[b].partial_cmp(&scaled[a]).unwrap().then(a.cmp(&b)));
        let max = scaled[order[0]];
        order.retain(|&i| (scaled[i] - max).exp() >= p.min_p as f64);
        if p.top_k > 0 {
            order.truncate(p.top_k);
        }
        let z: f64 = order.iter().map(|&i| scaled[i].exp()).sum();
        let mut kept = Vec::new();
        let mut mass = 0.0;
        for &i in &order {
            kept.push(i);
            mass += scaled[i].exp() / z;
            if mass >= p.top_p as f64 {
                break;
            }
        }
        let z: f64 = kept.iter().map(|&i| scaled[i].exp()).sum();
        let mut probs = vec![0.0; logits.len()];
        for &i in &kept {
            probs[i] = scaled[i].exp() / z;
        }
        probs
    }

    fn log_softmax(logits: &[f32], i: usize) -> f64 {
        let z: f64 = logits.iter().map(|&l| (l as f64).exp()).sum();
        logits[i] as f64 - z.ln()
    }

    #[test]
    fn greedy_takes_the_lowest_argmax_with_its_model_logprob() {
        let s = sample(&LOGITS, &params(0.0, 0, 1.0), &mut SeqRng::new(0, 0));
        assert_eq!(s.token_id, 1);
        assert!((s.logprob as f64 - log_softmax(&LOGITS, 1)).abs() < 1e-6);
        assert_eq!(s.model_logprob, Some(s.logprob));
    }

    #[test]
    fn draws_follow_the_truncated_distribution() {
        for p in [
            params(1.0, 0, 1.0),
            params(0.7, 5, 1.0),
            params(1.3, 0, 0.8),
            params(0.7, 5, 0.8),
            SamplingParams {
                min_p: 0.1,
                ..params(0.7, 0, 1.0)
            },
            SamplingParams {
                min_p: 0.3,
                ..params(1.3, 5, 0.9)
            },
        ] {
            let want = reference(&LOGITS, &p);
            let mut rng = SeqRng::new(42, 0);
            let draws = 20_000;
            let mut counts = [0usize; 8];
            for _ in 0..draws {
                let s = sample(&LOGITS, &p, &mut rng);
                counts[s.token_id as usize] += 1;
                // The returned logprobs are the reference ones.
                let i = s.token_id as usize;
                assert!((s.logprob as f64 - want[i].ln()).abs() < 1e-5, "{p:?}");
                assert!((s.model_logprob.unwrap() as f64 - log_softmax(&LOGITS, i)).abs() < 1e-5);
            }
            for (i, &c) in counts.iter().enumerate() {
                if want[i] == 0.0 {
                    assert_eq!(c, 0, "token {i} is outside the support for {p:?}");
                } else {
                    let mean = draws as f64 * want[i];
                    let sd = (draws as f64 * want[i] * (1.0 - want[i])).sqrt();
                    assert!(
                        (c as f64 - mean).abs() < 5.0 * sd + 1.0,
                        "token {i}: {c} vs {mean} for {p:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn top_logprobs_are_the_most_likely_untempered_tokens() {
        let s = sample(&LOGITS, &params(1.7, 2, 0.5), &mut SeqRng::new(5, 0));
        // LOGITS ranks 1 and 3 (tied at 3.0, lower id first), then 7 (2.5).
        let ids: Vec<u32> = s.top_logprobs.iter().map(|t| t.0).collect();
        assert_eq!(ids, vec![1, 3, 7]);
        for (id, lp) in s.top_logprobs {
            assert!((lp as f64 - log_softmax(&LOGITS, id as usize)).abs() < 1e-6);
        }
        let none = SamplingParams {
            top_logprobs: 0,
            ..params(1.0, 0, 1.0)
        };
        assert!(sample(&LOGITS, &none, &mut SeqRng::new(5, 0))
            .top_logprobs
            .is_empty());
    }

    #[test]
    fn seeded_streams_reproduce_and_samples_differ() {
        let p = params(1.0, 0, 1.0);
        let run = |seed, index| {
            let mut rng = SeqRng::new(seed, index);
            (0..50)
                .map(|_| sample(&LOGITS, &p, &mut rng).token_id)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7, 0), run(7, 0));
        assert_ne!(run(7, 0), run(7, 1));
        assert_ne!(run(7, 0), run(8, 0));
    }

    #[test]
    fn nan_logits_are_never_drawn() {
        let mut logits = LOGITS;
        logits[1] = f32::NAN;
        let mut rng = SeqRng::new(3, 0);
        for p in [
            params(0.0, 0, 1.0),
            params(1.0, 0, 1.0),
            params(1.0, 3, 0.9),
        ] {
            for _ in 0..200 {
                assert_ne!(sample(&logits, &p, &mut rng).token_id, 1);
            }
        }
    }

    #[test]
    fn invalid_parameters_name_the_field() {
        let bad = [
            (params(-1.0, 0, 1.0), "temperature"),
            (params(f32::NAN, 0, 1.0), "temperature"),
            (params(1.0, 0, 0.0), "top_p"),
            (params(1.0, 0, 1.5), "top_p"),
            (params(1.0, 0, f32::NAN), "top_p"),
        ];
        for (p, field) in bad {
            let err = p.validate().unwrap_err();
            assert!(err.starts_with(field), "{err}");
        }
        assert!(params(0.0, 3, 0.5).validate().is_ok());
    }
}
