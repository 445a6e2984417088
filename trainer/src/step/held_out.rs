//! The held-out problems a run is evaluated on (this rank's share of them), greedily, with
//! the accuracy summed over ranks.

use std::sync::Arc;

use dppo_engine::{Engine, SamplingParams};
use dppo_model::TextTokenizer;

use crate::dist::shard_range;
use crate::eval::{evaluate, EvalSet, EvalSpec};
use crate::reward::Scorer;
use crate::TrainError;

use super::shard::Ranks;

/// This rank's held-out problems and how they are scored.
pub(crate) struct HeldOut {
    /// This rank's share of the held-out problems (all of them on one rank).
    set: EvalSet,
    /// Held-out problems over all ranks.
    num_eval: usize,
    spec: EvalSpec,
    /// The run's reward, without its overlong penalty.
    scorer: Arc<Scorer>,
}

impl HeldOut {
    /// This rank's share of `set`, evaluated on `max_tokens` new tokens scored by `scorer`.
    pub fn new(set: EvalSet, ranks: &Ranks, max_tokens: usize, scorer: Arc<Scorer>) -> Self {
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
            },
            scorer,
        }
    }

    /// The engine's newest policy's mean greedy reward on every rank's held-out problems
    /// (the verifier's: accuracy).
    pub fn accuracy(
        &self,
        engine: &Engine,
        tokenizer: &TextTokenizer,
        ranks: &Ranks,
    ) -> Result<f64, TrainError> {
        let (result, samples) = evaluate(engine, tokenizer, &self.set, &self.spec, &self.scorer)?;
        if ranks.rank().1 == 1 {
            return Ok(result.avg);
        }
        // Each rank evaluated its share: the score of all of them is the sum of rewards
        // over all ranks (the verifier's are whole numbers: exact in any order) over the
        // sample count.
        let total: f64 = samples.iter().flatten().map(|g| g.reward).sum();
        let total = ranks.sum(total)?;
        Ok(total / (self.num_eval.max(1) * self.spec.n) as f64)
    }
}
