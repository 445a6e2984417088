//! From pruned groups to what the learner consumes: the kept sequences with their weights,
//! and the step's normalisers (computed once, by the algorithm, before packing).

use rand::rngs::StdRng;

use crate::group::Group;
use crate::loss::{Normalisers, TrainSeq};
use crate::prune::{Kept, PruningAlgorithm};

/// What one optimizer step trains on.
#[derive(Debug, Clone)]
pub struct TrainBatch {
    pub seqs: Vec<TrainSeq>,
    pub norm: Normalisers,
}

/// The train batch of the `kept` completions of `groups`, with the normalisers `norm` of
/// the whole step (the algorithm's: [`crate::prune::PruningAlgorithm::normalisers`]).
pub fn build_train_batch(groups: &[Group], kept: &[Kept], norm: Normalisers) -> TrainBatch {
    build_train_shard(groups, kept, 0..groups.len(), norm)
}

/// One rank's share of the train batch: the kept sequences of the groups in `own` only,
/// with the normalisers of the whole batch (`groups` and `kept` are the whole step's, as
/// every rank sees them), so that the ranks' losses add up to the one-rank loss.
pub fn build_train_shard(
    groups: &[Group],
    kept: &[Kept],
    own: std::ops::Range<usize>,
    norm: Normalisers,
) -> TrainBatch {
    let seqs: Vec<TrainSeq> = kept
        .iter()
        .filter(|k| own.contains(&k.group_idx))
        .map(|k| {
            let group = &groups[k.group_idx];
            let s = &group.samples[k.sample_idx];
            let mut tokens = s.prompt_ids.clone();
            tokens.extend_from_slice(&s.completion_ids);
            TrainSeq {
                tokens,
                num_prompt_tokens: s.prompt_ids.len(),
                advantage: group.advantages[k.sample_idx],
                weight: k.weight,
                rollout_logprobs: s.rollout_logprobs.clone(),
            }
        })
        .collect();
    TrainBatch { seqs, norm }
}

/// Completion pruning of a step's `groups` by `algorithm` at `rate` (every rank prunes the
/// whole batch alike) and the learner's batch of the survivors among this rank's `own`
/// groups, with the whole batch's normalisers; also returns the survivors of the whole
/// batch. `num_drawn` counts every prompt drawn for the step.
pub fn prune_and_build(
    algorithm: &dyn PruningAlgorithm,
    groups: &[Group],
    own: std::ops::Range<usize>,
    num_drawn: usize,
    rate: f64,
    rng: &mut StdRng,
) -> (TrainBatch, Vec<Kept>) {
    let kept = algorithm.select_completions(groups, rate, rng);
    let norm = algorithm.normalisers(groups, &kept, num_drawn);
    (build_train_shard(groups, &kept, own, norm), kept)
}
