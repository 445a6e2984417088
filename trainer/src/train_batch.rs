//! From pruned groups to what the learner consumes: the kept sequences with their weights,
//! and the normalisers of the full batch (computed here, once, before packing).

use crate::group::Group;
use crate::loss::{Normalisers, TrainSeq};
use crate::prune::{Algorithm, Kept};

/// What one optimizer step trains on.
#[derive(Debug, Clone)]
pub struct TrainBatch {
    pub seqs: Vec<TrainSeq>,
    pub norm: Normalisers,
}

/// Builds the train batch. `num_drawn_prompts` counts every prompt drawn for the step
/// (rolled out or pruned before rollout); `group_size` is `rollout.n`; `max_len` is
/// `max_response_len`.
///
/// DPPO and GRPO normalise by the full batch (`N_seq` = all completions of all drawn
/// prompts, `N_tok` = sum of `w_q * T_j` over rolled-out prompts); GRESO, which does not
/// re-weight, by the prompts it rolled out; CPPO averages over the retained completions
/// only, as its paper does.
pub fn build_train_batch(
    groups: &[Group],
    kept: &[Kept],
    num_drawn_prompts: usize,
    group_size: usize,
    max_len: usize,
    algorithm: Algorithm,
) -> TrainBatch {
    build_train_shard(
        groups,
        kept,
        0..groups.len(),
        num_drawn_prompts,
        group_size,
        max_len,
        algorithm,
    )
}

/// One rank's share of the train batch: the kept sequences of the groups in `own` only,
/// with the normalisers of the whole batch (`groups` and `kept` are the whole step's, as
/// every rank sees them), so that the ranks' losses add up to the one-rank loss.
pub fn build_train_shard(
    groups: &[Group],
    kept: &[Kept],
    own: std::ops::Range<usize>,
    num_drawn_prompts: usize,
    group_size: usize,
    max_len: usize,
    algorithm: Algorithm,
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
    let num_prompts = match algorithm {
        Algorithm::Greso => groups.len(),
        _ => num_drawn_prompts,
    };
    let norm = match algorithm {
        Algorithm::Cppo => Normalisers {
            num_seqs: kept.len() as f64,
            num_tokens: kept
                .iter()
                .map(|k| {
                    groups[k.group_idx].samples[k.sample_idx]
                        .completion_ids
                        .len()
                })
                .sum::<usize>() as f64,
            max_len: max_len as f64,
        },
        Algorithm::Grpo | Algorithm::Dppo | Algorithm::Greso => Normalisers {
            num_seqs: (num_prompts * group_size) as f64,
            num_tokens: groups
                .iter()
                .map(|g| g.w_q * g.num_completion_tokens() as f64)
                .sum(),
            max_len: max_len as f64,
        },
    };
    TrainBatch { seqs, norm }
}
