//! The device check's model and greedy requests, sized by `--full`: what the CPU reference
//! and every device check run.

use candle_core::Device;
use dppo_engine::GenerateRequest;
use dppo_model::{Policy, Weights};

use super::{SEED, WEIGHT_STD};
use crate::TrainError;

/// The sizes of one device check.
pub(super) struct Workload {
    pub prompts: usize,
    pub greedy_tokens: usize,
    /// Prompts, samples per prompt and new tokens of the timed rollout.
    pub rollout: (usize, usize, usize),
}

impl Workload {
    /// The check's sizes, larger with `full`.
    pub fn of(full: bool) -> Self {
        if full {
            Self {
                prompts: 16,
                greedy_tokens: 32,
                rollout: (32, 8, 64),
            }
        } else {
            Self {
                prompts: 4,
                greedy_tokens: 16,
                rollout: (8, 4, 32),
            }
        }
    }
}

/// The built-in tiny model's shape (larger with `full`) with the task tokenizer and
/// seeded random weights drawn on the CPU. Its heads are 32 wide, the narrowest the paged
/// CUDA kernels take (the tiny preset's are 16), so every check can run on the kernels.
pub(super) fn model(full: bool) -> Result<Policy, TrainError> {
    let base = dppo_model::presets::load_preset("tiny", &Device::Cpu)?;
    let mut config = base.config.clone();
    config.head_dim = 32;
    if full {
        config.hidden_size = 256;
        config.intermediate_size = 704;
        config.num_hidden_layers = 4;
        config.num_attention_heads = 8;
        config.num_key_value_heads = 4;
    }
    let weights = Weights::random(&config, WEIGHT_STD, SEED, &Device::Cpu)?;
    Ok(Policy::new(config, weights, base.tokenizer)?)
}

/// Greedy requests of varied prompt lengths, every one `greedy_tokens` long.
pub(super) fn greedy_requests(work: &Workload, vocab: usize) -> Vec<GenerateRequest> {
    (0..work.prompts)
        .map(|p| {
            let len = 3 + (p * 7) % 23;
            let ids = (0..len)
                .map(|i| ((i * 11 + p * 5 + 3) % vocab) as u32)
                .collect();
            let mut req = GenerateRequest::new(ids, 1, work.greedy_tokens);
            req.sampling.temperature = 0.0;
            req.ignore_eos = true;
            req
        })
        .collect()
}
