//! The held-out problems a run is evaluated on (this rank's share of them), greedily, with
//! the accuracy summed over ranks.

use std::collections::BTreeMap;
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
    /// Held-out problems of each data source, over all ranks.
    sources: BTreeMap<String, usize>,
    spec: EvalSpec,
    /// The run's reward, without its overlong penalty.
    scorer: Arc<Scorer>,
}

impl HeldOut {
    /// This rank's share of `set`, evaluated on `max_tokens` new tokens scored by `scorer`.
    pub fn new(set: EvalSet, ranks: &Ranks, max_tokens: usize, scorer: Arc<Scorer>) -> Self {
        let num_eval = set.problems().len();
        let mut sources = BTreeMap::new();
        for p in set.problems() {
            *sources.entry(p.data_source.clone()).or_default() += 1;
        }
        let (rank, world) = ranks.rank();
        Self {
            set: set.shard(shard_range(num_eval, rank, world)),
            num_eval,
            sources,
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
    /// (the verifier's: accuracy), and that of each data source when there are several.
    pub fn accuracy(
        &self,
        engine: &Engine,
        tokenizer: &TextTokenizer,
        ranks: &Ranks,
    ) -> Result<(f64, BTreeMap<String, f64>), TrainError> {
        let (_, samples) = evaluate(engine, tokenizer, &self.set, &self.spec, &self.scorer)?;
        // Sums over this rank's share: all of them, then each source's (in the order of
        // `self.sources`, which every rank knows), summed over ranks in one collective (the
        // verifier's rewards are whole numbers: exact in any order).
        let mut sums = vec![0.0; 1 + self.sources.len()];
        for (p, graded) in self.set.problems().iter().zip(&samples) {
            let reward: f64 = graded.iter().map(|g| g.reward).sum();
            sums[0] += reward;
            let k = self.sources.keys().position(|s| *s == p.data_source);
            sums[1 + k.expect("every held-out source is counted")] += reward;
        }
        let sums = ranks.sum_all(&sums)?;
        let n = self.spec.n as f64;
        let mean = sums[0] / (self.num_eval.max(1) as f64 * n);
        let by_source = match self.sources.len() {
            0 | 1 => BTreeMap::new(),
            _ => self
                .sources
                .iter()
                .zip(&sums[1..])
                .map(|((source, &count), sum)| (source.clone(), sum / (count as f64 * n)))
                .collect(),
        };
        Ok((mean, by_source))
    }
}
