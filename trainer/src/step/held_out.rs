//! The held-out problems a run is evaluated on (this rank's share of them), greedily, with
//! the accuracy summed over ranks.

use dppo_engine::{Engine, SamplingParams};
use dppo_model::TextTokenizer;

use crate::dist::shard_range;
use crate::eval::{evaluate, EvalSet, EvalSpec};
use crate::TrainError;
use dppo_rewards::ExtractMode;

use super::shard::Ranks;

/// This rank's held-out problems and how they are scored.
pub(crate) struct HeldOut {
    /// This rank's share of the held-out problems (all of them on one rank).
    set: EvalSet,
    /// Held-out problems over all ranks.
    num_eval: usize,
    spec: EvalSpec,
}

impl HeldOut {
    /// This rank's share of `set`, evaluated on `max_tokens` new tokens scored by `mode`.
    pub fn new(set: EvalSet, ranks: &Ranks, max_tokens: usize, mode: ExtractMode) -> Self {
        let num_eval = set.problems().len();
        let (rank, world) = ranks.rank();
        Self {
            set: set.shard(shard_range(num_eval, rank, world)),
            num_eval,
            spec: EvalSpec {
                sampling: SamplingParams {
                    temperature: 0.0,
                    ..SamplingParams::default()
                },
                n: 1,
                k: 1,
                max_tokens,
                mode,
            },
        }
    }

    /// Greedy accuracy of the engine's newest policy on every rank's held-out problems.
    pub fn accuracy(
        &self,
        engine: &Engine,
        tokenizer: &TextTokenizer,
        ranks: &Ranks,
    ) -> Result<f64, TrainError> {
        let (result, samples) = evaluate(engine, tokenizer, &self.set, &self.spec)?;
        if ranks.rank().1 == 1 {
            return Ok(result.avg);
        }
        // Each rank evaluated its share: the accuracy of all of them is the sum of rewards
        // over all ranks (whole numbers: exact in any order) over the sample count.
        let total: f64 = samples.iter().flatten().map(|g| g.reward).sum();
        let total = ranks.sum(total)?;
        Ok(total / (self.num_eval.max(1) * self.spec.n) as f64)
    }
}
