//! Completion-level pruning (after rollout, before the learner): score `|A|`, scope a
//! group or the whole batch; and CPPO's batch-wide deterministic cut.

use rand::Rng;
use serde::{Deserialize, Serialize};

use super::design::prune_scope;
use super::{Kept, LevelConfig};
use crate::group::Group;

/// Where completion candidates are compared (`scope`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CompletionScope {
    Group,
    Batch,
}

/// Whether an item's loss is identically zero: `A = 0` and no KL term (`beta = 0`).
/// Such items are dropped with probability 1, at no bias.
fn is_zero_loss(advantage: f64, beta: f64) -> bool {
    advantage == 0.0 && beta == 0.0
}

/// DPPO's completion pruning. Every kept item's weight is `w_q` of its group times `w_o`.
pub fn prune_completions<R: Rng>(
    groups: &[Group],
    level: &LevelConfig,
    scope: CompletionScope,
    beta: f64,
    rng: &mut R,
) -> Vec<Kept> {
    // Items that can carry signal, in batch order.
    let items: Vec<(usize, usize)> = groups
        .iter()
        .enumerate()
        .flat_map(|(g, group)| {
            (0..group.samples.len())
                .filter(move |&i| !is_zero_loss(group.advantages[i], beta))
                .map(move |i| (g, i))
        })
        .collect();
    let scopes: Vec<Vec<(usize, usize)>> = match scope {
        CompletionScope::Batch => vec![items],
        CompletionScope::Group => {
            let mut by_group: Vec<Vec<(usize, usize)>> = vec![Vec::new(); groups.len()];
            for (g, i) in items {
                by_group[g].push((g, i));
            }
            by_group
        }
    };
    let mut kept = Vec::new();
    for members in scopes {
        let scores: Vec<f64> = members
            .iter()
            .map(|&(g, i)| groups[g].advantages[i].abs())
            .collect();
        let inclusion = prune_scope(&scores, level.rate, level.candidates, level.mode, rng);
        for (&(g, i), w_o) in members.iter().zip(inclusion) {
            if let Some(w_o) = w_o {
                kept.push(Kept {
                    group_idx: g,
                    sample_idx: i,
                    weight: groups[g].w_q * w_o,
                });
            }
        }
    }
    kept.sort_by_key(|k| (k.group_idx, k.sample_idx));
    kept
}

/// CPPO: drop the `floor(rate * N)` completions of the whole batch with the smallest |A|
/// (and any other zero-loss ones), keep the rest with weight 1. Biased by design.
pub fn cppo_completions(groups: &[Group], rate: f64, beta: f64) -> Vec<Kept> {
    let mut all: Vec<(usize, usize)> = groups
        .iter()
        .enumerate()
        .flat_map(|(g, group)| (0..group.samples.len()).map(move |i| (g, i)))
        .collect();
    let abs_a = |&(g, i): &(usize, usize)| groups[g].advantages[i].abs();
    all.sort_by(|a, b| abs_a(a).total_cmp(&abs_a(b)).then(a.cmp(b)));
    let num_drop = (rate * all.len() as f64).floor() as usize;
    let mut kept: Vec<Kept> = all[num_drop..]
        .iter()
        .filter(|&&(g, i)| !is_zero_loss(groups[g].advantages[i], beta))
        .map(|&(g, i)| Kept {
            group_idx: g,
            sample_idx: i,
            weight: 1.0,
        })
        .collect();
    kept.sort_by_key(|k| (k.group_idx, k.sample_idx));
    kept
}
