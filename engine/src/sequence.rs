//! A sequence: its tokens, how many of them are in the KV cache, and its block table.

use std::sync::Arc;

use crate::kv_pool::BlockId;

/// Engine-wide sequence id.
pub type SeqId = u64;
/// Id of a request (one prompt, `n` samples).
pub type RequestId = u64;

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An EOS token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// Cancelled by the caller.
    Cancelled,
}

/// Scheduling class of a request. High-priority work (the trainer's rollouts and
/// evaluations) is admitted before and preempted after normal work (served requests).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum Priority {
    #[default]
    Normal,
    High,
}

/// Plain state of one sequence; the scheduler moves it, the runner reads it.
#[derive(Debug, Clone)]
pub struct Sequence {
    pub seq_id: SeqId,
    pub request_id: RequestId,
    /// Which of its request's samples this is.
    pub sample_index: usize,
    /// Samples to draw when its last token is computed: `n` for a group leader that has not
    /// forked yet, 1 otherwise.
    pub num_samples: usize,
    pub token_ids: Vec<u32>,
    pub num_prompt_tokens: usize,
    /// Tokens whose K/V are in the cache; "computed catches up with tokens" is the only
    /// rule (prefill, chunked prefill, recompute after preemption and decode alike).
    pub num_computed_tokens: usize,
    pub block_table: Vec<BlockId>,
    pub max_tokens: usize,
    pub eos_token_ids: Arc<[u32]>,
    pub priority: Priority,
}

impl Sequence {
    /// Tokens in the sequence (prompt and output).
    pub fn len(&self) -> usize {
        self.token_ids.len()
    }

    /// Whether the sequence holds no token (never true for an admitted request).
    pub fn is_empty(&self) -> bool {
        self.token_ids.is_empty()
    }

    /// Generated tokens so far.
    pub fn num_output_tokens(&self) -> usize {
        self.len() - self.num_prompt_tokens
    }
}
