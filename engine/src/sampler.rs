//! Token sampling from one sequence's logits row (interim version; being replaced).

use rand::{rngs::StdRng, Rng, SeedableRng};

/// Per-request sampling parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub seed: Option<u64>,
    pub model_logprobs: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: None,
            model_logprobs: false,
        }
    }
}

impl SamplingParams {
    /// Checks ranges.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!(
                "temperature must be >= 0 and finite, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        Ok(())
    }

    /// Whether sampling is greedy.
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// One sampled token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampled {
    pub token_id: u32,
    pub logprob: f32,
    pub model_logprob: Option<f32>,
}

/// Per-sequence random stream.
pub struct SeqRng(StdRng);

impl SeqRng {
    /// Stream for sample `index` of a seeded request.
    pub fn new(seed: u64, index: u64) -> Self {
        Self(StdRng::seed_from_u64(
            seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15),
        ))
    }

    /// Unseeded stream.
    pub fn from_entropy() -> Self {
        Self(StdRng::from_os_rng())
    }
}

/// Samples one token.
pub fn sample(logits: &[f32], params: &SamplingParams, rng: &mut SeqRng) -> Sampled {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let raw = |i: usize| {
        let lse = logits
            .iter()
            .map(|&l| (l as f64 - max).exp())
            .sum::<f64>()
            .ln()
            + max;
        (logits[i] as f64 - lse) as f32
    };
    if params.is_greedy() {
        let best = (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });
        let lp = raw(best);
        return Sampled {
            token_id: best as u32,
            logprob: lp,
            model_logprob: params.model_logprobs.then_some(lp),
        };
    }
    let t = params.temperature as f64;
    let (idx, mut p): (Vec<usize>, Vec<f64>) = if params.top_k == 0 && params.top_p >= 1.0 {
        (
            (0..logits.len()).collect(),
            logits
                .iter()
                .map(|&l| ((l as f64 - max) / t).exp())
                .collect(),
        )
    } else {
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if params.top_k > 0 {
            idx.truncate(params.top_k);
        }
        let p: Vec<f64> = idx
            .iter()
            .map(|&i| ((logits[i] as f64 - max) / t).exp())
            .collect();
        let z: f64 = p.iter().sum();
        let mut cum = 0.0;
        let keep = p
            .iter()
            .position(|x| {
                cum += x / z;
                cum >= params.top_p as f64
            })
            .map_or(p.len(), |j| j + 1);
        (idx[..keep].to_vec(), p[..keep].to_vec())
    };
    let z: f64 = p.iter().sum();
    let u: f64 = rng.0.random::<f64>() * z;
    let mut pick = p.len() - 1;
    let mut acc = 0.0;
    for (j, x) in p.iter_mut().enumerate() {
        acc += *x;
        if u < acc {
            pick = j;
            break;
        }
    }
    let token = idx[pick];
    let lp = ((logits[token] as f64 - max) / t - z.ln()) as f32;
    Sampled {
        token_id: token as u32,
        logprob: lp,
        model_logprob: params.model_logprobs.then(|| raw(token)),
    }
}
