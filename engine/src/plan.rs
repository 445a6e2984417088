//! What the scheduler hands the runner for one iteration: plain data, no tensors.

use crate::kv_pool::BlockCopy;
use crate::sequence::SeqId;

/// One sequence's share of an iteration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub seq_id: SeqId,
    /// Tokens already in the cache; the new ones start at this position.
    pub num_computed_tokens: usize,
    /// Tokens to compute now.
    pub num_new_tokens: usize,
    /// Tokens to sample from the last new token's logits (0 for a prefill chunk that does
    /// not reach the end of the sequence; `n` when a group forks).
    pub num_samples: usize,
}

/// One iteration's work.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Plan {
    pub seqs: Vec<ScheduledSeq>,
    /// Copy-on-write orders to carry out before the forward pass.
    pub block_copies: Vec<BlockCopy>,
    /// Sequences preempted (their blocks freed; they will be recomputed).
    pub preempted: Vec<SeqId>,
}

impl Plan {
    /// Whether there is nothing to run.
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    /// Tokens computed in this iteration.
    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.num_new_tokens).sum()
    }
}
