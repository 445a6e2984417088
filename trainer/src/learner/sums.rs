//! What the forward/backward passes of a step add up, and the step's metrics from it.

use crate::correction::CorrectionSums;
use crate::dist::{sum_f64, Collective};
use crate::mismatch::Mismatch;
use crate::TrainError;

use super::StepMetrics;

/// What one rank's forward/backward passes add up, before any division: summed over ranks
/// for the global batch's metrics.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Sums {
    pub pg_loss: f64,
    pub tokens: usize,
    pub clipped: usize,
    pub entropy: f64,
    pub num_buffers: usize,
    /// Tokens of every packed sequence (prompt and completion).
    pub seq_tokens: usize,
    /// Seconds of forward/backward (ranks run at once: their maximum).
    pub seconds: f64,
    /// The learner's logprobs against the rollout's.
    pub mismatch: Mismatch,
    /// Tensors in the buffers' autograd graphs ([`StepMetrics::graph_nodes`]).
    pub graph_nodes: usize,
}

impl Sums {
    /// The step's metrics from these sums (`grad_norm` and `lr` are set later).
    pub fn metrics(&self, pack_tokens: usize) -> StepMetrics {
        StepMetrics {
            pg_loss: self.pg_loss,
            num_buffers: self.num_buffers,
            pack_density: if self.num_buffers == 0 {
                1.0
            } else {
                self.seq_tokens as f64 / (self.num_buffers * pack_tokens) as f64
            },
            clipfrac: self.clipped as f64 / self.tokens.max(1) as f64,
            entropy: self.entropy / self.tokens.max(1) as f64,
            train_tokens_per_s: self.seq_tokens as f64 / self.seconds,
            mismatch: self.mismatch,
            graph_nodes: self.graph_nodes,
            ..StepMetrics::default()
        }
    }

    /// The sums over every rank (in rank order, so every rank gets the same bits).
    pub fn over_ranks(&self, coll: &dyn Collective) -> Result<Self, TrainError> {
        if coll.world_size() == 1 {
            return Ok(*self);
        }
        let counts = sum_f64(
            coll,
            &[
                self.pg_loss,
                self.tokens as f64,
                self.clipped as f64,
                self.entropy,
                self.num_buffers as f64,
                self.seq_tokens as f64,
                self.mismatch.tokens as f64,
                self.mismatch.abs_sum,
                self.mismatch.k3_sum,
                self.mismatch.outside as f64,
                self.mismatch.correction.weight_sum,
                self.mismatch.correction.truncated as f64,
                self.mismatch.correction.masked as f64,
                self.graph_nodes as f64,
            ],
        )?;
        let maxima = coll.all_gather_f64(&[self.seconds, self.mismatch.abs_max])?;
        let max_of = |i: usize| maxima.iter().map(|s| s[i]).fold(0.0, f64::max);
        Ok(Self {
            pg_loss: counts[0],
            tokens: counts[1] as usize,
            clipped: counts[2] as usize,
            entropy: counts[3],
            num_buffers: counts[4] as usize,
            seq_tokens: counts[5] as usize,
            seconds: max_of(0),
            mismatch: Mismatch {
                tokens: counts[6] as usize,
                abs_sum: counts[7],
                abs_max: max_of(1),
                k3_sum: counts[8],
                outside: counts[9] as usize,
                correction: CorrectionSums {
                    weight_sum: counts[10],
                    truncated: counts[11] as usize,
                    masked: counts[12] as usize,
                },
            },
            graph_nodes: counts[13] as usize,
        })
    }
}
