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
    let lse = logits
        .iter()
        .map(|&l| (l as f64 - max).exp())
        .sum::<f64>()
        .ln()
        + max;
    let raw = |i: usize| (logits[i] as f64 - lse) as f32;
    if params.is_greedy() {
        let best = (0..logits.len()).fold(0, |b, i| if logits[i] > logits[b] { i } else { b });
        return Sampled {
            token_id: best as u32,
            logprob: raw(best),
            model_logprob: params.model_logprobs.then(|| raw(best)),
        };
    }
    let t = params.temperature as f64;
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if params.top_k > 0 {
        idx.truncate(params.top_k);
    }
    let mut p: Vec<f64> = idx
        .iter()
        .map(|&i| ((logits[i] as f64 - max) / t).exp())
        .collect();
    let z: f64 = p.iter().sum();
    let mut cum = 0.0;
    let mut keep = p.len();
    for (j, x) in p.iter().enumerate() {
        cum += x / z;
        if cum >= params.top_p as f64 {
            keep = j + 1;
            break;
        }
    }
    p.truncate(keep);
    let z: f64 = p.iter().sum();
    let u: f64 = rng.0.random::<f64>() * z;
    let mut acc = 0.0;
    let mut pick = keep - 1;
    for (j, x) in p.iter().enumerate() {
        acc += x;
        if u < acc {
            pick = j;
            break;
        }
    }
    let token = idx[pick];
    Sampled {
        token_id: token as u32,
        logprob: (p[pick] / z).ln() as f32,
        model_logprob: params.model_logprobs.then(|| raw(token)),
    }
}
