//! The GPU memory budget: how one GPU's memory divides between the engine's weights, the
//! learner's state and activations, and the KV cache, as one pure function of sizes
//! ([`budget`]), so that it is tested on the CPU and answers without a GPU (`dppo memory`).
//!
//! As vLLM's `gpu_memory_utilization`, the process may use that fraction of the GPU's total
//! memory; the KV cache gets what is left of it after everything else the process keeps:
//! the engine's weights and a forward pass's workspace, and (co-located with the learner)
//! the f32 master weights, the AdamW moments, the gradients, a compute-dtype copy of the
//! weights and the activations of one packed buffer.
//!
//! The activation budget is an estimate of what candle's autograd keeps for the backward
//! pass of a packed buffer of `pack.tokens` tokens, per token and layer: the two RMSNorm
//! inputs and outputs, q, k and v before and after RoPE, the attention output, the
//! residuals and the four MLP tensors (gate, up, SiLU(gate), their product): `6 h + 3 q +
//! 3 kv + 4 i` values of the compute dtype (`q`, `kv`: the query and key/value widths,
//! `i`: the MLP width); per layer the attention scores and probabilities, at most
//! `2 * heads * pack_tokens * segment` values, `segment` the longer of `seq_len` and
//! `SEGMENT_TOKENS` (a packed sequence attends only within itself, a GPU's attention call
//! within a segment of sequences: `dppo_model::packed::Grouping`); and the f32 logits,
//! log-probabilities and their gradient, `3 * pack_tokens * vocab` values. The composite
//! softmax a GPU runs keeps more score-sized tensors than two (about six, in f32), so on a
//! GPU the scores' term is low.

use std::fmt;
use std::str::FromStr;

use dppo_model::packed::SEGMENT_TOKENS;
use dppo_model::ModelConfig;

mod size;

pub use size::{format_size, parse_size, SizeError};

/// The sizes of a model that its memory depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelShape {
    /// Parameters (tied embeddings counted once).
    pub num_parameters: u64,
    pub num_layers: u64,
    pub hidden_size: u64,
    pub intermediate_size: u64,
    pub num_attention_heads: u64,
    pub num_kv_heads: u64,
    pub head_dim: u64,
    pub vocab_size: u64,
}

impl From<&ModelConfig> for ModelShape {
    fn from(cfg: &ModelConfig) -> Self {
        Self {
            num_parameters: cfg.num_parameters() as u64,
            num_layers: cfg.num_hidden_layers as u64,
            hidden_size: cfg.hidden_size as u64,
            intermediate_size: cfg.intermediate_size as u64,
            num_attention_heads: cfg.num_attention_heads as u64,
            num_kv_heads: cfg.num_key_value_heads as u64,
            head_dim: cfg.head_dim as u64,
            vocab_size: cfg.vocab_size as u64,
        }
    }
}

/// A floating-point storage type of weights, KV cache or compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    F32,
    Bf16,
    F16,
}

impl Precision {
    /// Bytes per value.
    pub fn bytes(self) -> u64 {
        match self {
            Self::F32 => 4,
            Self::Bf16 | Self::F16 => 2,
        }
    }
}

impl FromStr for Precision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Self::F32),
            "bf16" => Ok(Self::Bf16),
            "f16" => Ok(Self::F16),
            _ => Err(format!("{s:?}: expected f32, bf16 or f16")),
        }
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        })
    }
}

/// The learner's side of a co-located budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LearnerInputs {
    /// The dtype of the forward/backward pass (master weights and optimizer stay f32).
    pub compute_dtype: Precision,
    /// Tokens per packed training buffer (`pack.tokens`).
    pub pack_tokens: u64,
}

/// Everything [`budget`] needs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BudgetInputs {
    pub model: ModelShape,
    /// The engine's weights and KV cache dtype.
    pub engine_dtype: Precision,
    /// `None` for an engine alone (`dppo serve`).
    pub learner: Option<LearnerInputs>,
    /// The GPU's memory, and what of it is free now.
    pub total_memory: u64,
    pub free_memory: u64,
    /// The fraction of `total_memory` this process may use (`engine.gpu_memory_utilization`).
    pub gpu_memory_utilization: f64,
    /// Token slots per KV block.
    pub block_size: u64,
    /// Tokens of one engine forward pass at most (the engine's `max_batched_tokens`).
    pub max_batched_tokens: u64,
    /// The longest sequence: prompt plus response tokens.
    pub seq_len: u64,
}

/// How the memory divides, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryBudget {
    /// `gpu_memory_utilization * total_memory`.
    pub budget: u64,
    /// The engine's weights in its dtype.
    pub engine_weights: u64,
    /// One engine forward pass: f32 logits and one layer's activations of
    /// `max_batched_tokens` tokens.
    pub engine_workspace: u64,
    /// The learner's f32 master weights (0 without a learner).
    pub master_weights: u64,
    /// AdamW's two f32 moments.
    pub optimizer_state: u64,
    /// Gradients of the master weights, f32 (the compute dtype's are cast back).
    pub gradients: u64,
    /// The compute-dtype copy of the weights (0 when computing in f32).
    pub compute_weights: u64,
    /// The activation budget of one packed buffer (see the module doc).
    pub activations: u64,
    /// K and V of every layer for one token, in the engine's dtype.
    pub kv_bytes_per_token: u64,
    /// KV blocks, and the tokens they hold.
    pub kv_blocks: u64,
    pub kv_tokens: u64,
    /// Sequences of `seq_len` tokens whose KV fits at once.
    pub max_seqs: u64,
    /// The inputs, for printing.
    pub block_size: u64,
    pub seq_len: u64,
}

impl MemoryBudget {
    /// The memory of the KV blocks.
    pub fn kv_bytes(&self) -> u64 {
        self.kv_blocks * self.block_size * self.kv_bytes_per_token
    }

    /// What the budget keeps besides the KV cache, named.
    pub fn parts(&self) -> [(&'static str, u64); 7] {
        [
            ("engine weights", self.engine_weights),
            ("engine workspace", self.engine_workspace),
            ("f32 master weights", self.master_weights),
            ("AdamW moments (f32)", self.optimizer_state),
            ("gradients", self.gradients),
            ("compute-dtype weights", self.compute_weights),
            ("activation budget", self.activations),
        ]
    }
}

/// Why no budget can be made.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum BudgetError {
    #[error("engine.gpu_memory_utilization = {0} is not in (0, 1]")]
    Utilization(f64),
    #[error(
        "engine.gpu_memory_utilization = {utilization} of {} is {}, but only {} of the GPU is free",
        format_size(*total), format_size(*budget), format_size(*free)
    )]
    NotFree {
        utilization: f64,
        total: u64,
        budget: u64,
        free: u64,
    },
    #[error(
        "does not fit: {needs} need {} but engine.gpu_memory_utilization = {utilization} of {} \
         is {}, leaving nothing for the KV cache; raise engine.gpu_memory_utilization, lower \
         pack.tokens or take a smaller model",
        format_size(*needed), format_size(*total), format_size(*budget)
    )]
    DoesNotFit {
        /// The parts, each with its size.
        needs: String,
        needed: u64,
        utilization: f64,
        total: u64,
        budget: u64,
    },
    #[error(
        "does not fit: the KV cache left ({} in {kv_blocks} blocks of {block_size} tokens) \
         holds no sequence of {seq_len} tokens (prompt + response); raise \
         engine.gpu_memory_utilization, lower pack.tokens or rollout.max_response_len",
        format_size(*kv_bytes)
    )]
    NoSequenceFits {
        kv_bytes: u64,
        kv_blocks: u64,
        block_size: u64,
        seq_len: u64,
    },
}

/// Divides the GPU's memory (see the module doc), or says what does not fit.
pub fn budget(input: &BudgetInputs) -> Result<MemoryBudget, BudgetError> {
    let u = input.gpu_memory_utilization;
    if !(u > 0.0 && u <= 1.0) {
        return Err(BudgetError::Utilization(u));
    }
    let m = &input.model;
    let budget = (u * input.total_memory as f64) as u64;
    if budget > input.free_memory {
        return Err(BudgetError::NotFree {
            utilization: u,
            total: input.total_memory,
            budget,
            free: input.free_memory,
        });
    }
    let (q, kv) = (
        m.num_attention_heads * m.head_dim,
        m.num_kv_heads * m.head_dim,
    );
    let eb = input.engine_dtype.bytes();
    let one_layer = 2 * m.hidden_size + q + 2 * kv + 2 * m.intermediate_size;
    let engine_workspace = input.max_batched_tokens * (4 * m.vocab_size + one_layer * eb);
    let mut memory = MemoryBudget {
        budget,
        engine_weights: m.num_parameters * eb,
        engine_workspace,
        master_weights: 0,
        optimizer_state: 0,
        gradients: 0,
        compute_weights: 0,
        activations: 0,
        kv_bytes_per_token: 2 * m.num_layers * kv * eb,
        kv_blocks: 0,
        kv_tokens: 0,
        max_seqs: 0,
        block_size: input.block_size,
        seq_len: input.seq_len,
    };
    if let Some(learner) = &input.learner {
        let cb = learner.compute_dtype.bytes();
        let t = learner.pack_tokens;
        memory.master_weights = 4 * m.num_parameters;
        memory.optimizer_state = 8 * m.num_parameters;
        memory.gradients = 4 * m.num_parameters;
        if learner.compute_dtype != Precision::F32 {
            memory.compute_weights = cb * m.num_parameters;
        }
        let per_token_layer = 6 * m.hidden_size + 3 * q + 3 * kv + 4 * m.intermediate_size;
        let segment = input.seq_len.max(SEGMENT_TOKENS as u64).min(t);
        let scores = 2 * m.num_attention_heads * t * segment;
        memory.activations =
            m.num_layers * (t * per_token_layer + scores) * cb + 3 * t * m.vocab_size * 4;
    }
    let needed: u64 = memory.parts().iter().map(|(_, b)| b).sum();
    if needed >= budget {
        let needs = memory
            .parts()
            .iter()
            .filter(|(_, b)| *b > 0)
            .map(|(name, b)| format!("{name} {}", format_size(*b)))
            .collect::<Vec<_>>()
            .join(" + ");
        return Err(BudgetError::DoesNotFit {
            needs,
            needed,
            utilization: u,
            total: input.total_memory,
            budget,
        });
    }
    let block_bytes = memory.kv_bytes_per_token * input.block_size;
    memory.kv_blocks = (budget - needed) / block_bytes;
    memory.kv_tokens = memory.kv_blocks * input.block_size;
    memory.max_seqs = memory.kv_blocks / input.seq_len.div_ceil(input.block_size);
    if memory.max_seqs == 0 {
        return Err(BudgetError::NoSequenceFits {
            kv_bytes: memory.kv_bytes(),
            kv_blocks: memory.kv_blocks,
            block_size: input.block_size,
            seq_len: input.seq_len,
        });
    }
    Ok(memory)
}

impl fmt::Display for MemoryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "budget                  {}", format_size(self.budget))?;
        for (name, bytes) in self.parts() {
            if bytes > 0 {
                writeln!(f, "{name:<24}{}", format_size(bytes))?;
            }
        }
        writeln!(
            f,
            "KV cache                {} ({} per token): {} blocks of {} tokens, {} tokens",
            format_size(self.kv_bytes()),
            format_size(self.kv_bytes_per_token),
            self.kv_blocks,
            self.block_size,
            self.kv_tokens
        )?;
        writeln!(
            f,
            "sequences at once       {} of {} tokens (prompt + response)",
            self.max_seqs, self.seq_len
        )
    }
}

#[cfg(test)]
mod tests;
