//! The step across ranks. Every rank draws and prunes the same prompts (the draw is a
//! function of the seed, the step and the prompt history, which every rank updates alike);
//! rank r rolls out its contiguous share of the kept prompts ([`shard_range`]), so groups
//! never straddle ranks. What the one-rank loop computes over the whole batch (batch-scope
//! completion pruning, loss normalisers, the prompt history, GRESO's state, the metrics)
//! every rank computes from the whole batch's rewards and completion lengths, gathered
//! here; only a group's tokens stay on the rank that generated it.

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::dist::{shard_range, sum_f64, weights_checksum, Collective};
use crate::group::{Group, Sample};
use crate::learner::Learner;
use crate::prune::Drawn;
use crate::reward::RewardTally;
use crate::TrainError;

use super::prompts::Prompts;
use super::rollout::StepRollout;

/// The ranks of a data-parallel run ([`crate::dist::Single`] on one), as the step loop
/// sees them.
pub(crate) struct Ranks {
    collective: Arc<dyn Collective>,
}

/// What a rank tells the others of its share of a step's rollout.
#[derive(Debug, Serialize, Deserialize)]
struct ShardReport {
    /// Per group, per sample: the reward and the completion's length in tokens.
    groups: Vec<Vec<(f64, usize)>>,
    gen_tokens: usize,
    gen_busy_s: f64,
    tally: RewardTally,
}

/// A step's rollout as every rank sees it.
pub(super) struct BatchView {
    /// Every rank's groups in the order of the step's kept prompts: this rank's own
    /// (`own`) as generated; the others' as their rewards and completions of the right
    /// length, whose tokens stay with the rank that generated them (zeros here, never
    /// trained on: a rank trains on its own groups only).
    pub groups: Vec<Group>,
    pub own: Range<usize>,
    pub gen_tokens: usize,
    /// The slowest rank's generation time (ranks generate at once).
    pub gen_busy_s: f64,
    pub tally: RewardTally,
}

/// (training problem, `w_q`) of each prompt of `drawn` that is rolled out, in order.
pub(super) fn kept_prompts(drawn: &Drawn) -> Vec<(usize, f64)> {
    drawn
        .problems
        .iter()
        .zip(&drawn.w_q)
        .filter_map(|(&i, w)| w.map(|w| (i, w)))
        .collect()
}

impl Ranks {
    pub fn new(collective: Arc<dyn Collective>) -> Self {
        Self { collective }
    }

    /// This rank's place: (rank, world size).
    pub fn rank(&self) -> (usize, usize) {
        (self.collective.rank(), self.collective.world_size())
    }

    /// Whether any rank says `yes`: every rank gets the same answer at the same point. A
    /// collective when there are several ranks.
    pub fn any(&self, yes: bool) -> Result<bool, TrainError> {
        Ok(sum_f64(self.collective.as_ref(), &[f64::from(u8::from(yes))])?[0] > 0.0)
    }

    /// Each of `xs` summed over every rank, in one collective (free on one rank).
    pub fn sum_all(&self, xs: &[f64]) -> Result<Vec<f64>, TrainError> {
        match self.collective.world_size() {
            1 => Ok(xs.to_vec()),
            _ => Ok(sum_f64(self.collective.as_ref(), xs)?),
        }
    }

    /// Fails with [`TrainError::Diverged`] unless every rank's weights have the same
    /// checksum: silent divergence of the replicas (a non-deterministic kernel, a bad
    /// collective) becomes an error. A collective; free on one rank.
    pub fn check_replicas(&self, learner: &Learner, step: u64) -> Result<(), TrainError> {
        if self.collective.world_size() == 1 {
            return Ok(());
        }
        let tensors: BTreeMap<String, candle_core::Tensor> = learner
            .vars
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        let sum = weights_checksum(&tensors)?;
        let all = self
            .collective
            .all_gather_f64(&[f64::from(sum), learner.optimizer.step as f64])?;
        if all.iter().all(|x| *x == all[0]) {
            return Ok(());
        }
        let checksums = all
            .iter()
            .enumerate()
            .map(|(rank, x)| format!("rank {rank}: {:08x} after {} updates", x[0] as u32, x[1]))
            .collect::<Vec<_>>()
            .join(", ");
        Err(TrainError::Diverged { step, checksums })
    }

    /// This rank's share of `num_kept` rolled-out prompts.
    pub fn own_groups(&self, num_kept: usize) -> Range<usize> {
        shard_range(
            num_kept,
            self.collective.rank(),
            self.collective.world_size(),
        )
    }

    /// The whole step's view from this rank's finished share `rollout`: a collective
    /// (every rank calls it at the same point of the step).
    pub fn batch_view(
        &self,
        rollout: StepRollout,
        prompts: &Prompts,
    ) -> Result<BatchView, TrainError> {
        let StepRollout {
            drawn,
            groups,
            gen_tokens,
            gen_busy_s,
            tally,
            version,
            step,
        } = rollout;
        let world = self.collective.world_size();
        if world == 1 {
            let own = 0..groups.len();
            return Ok(BatchView {
                groups,
                own,
                gen_tokens,
                gen_busy_s,
                tally,
            });
        }
        let report = ShardReport {
            groups: groups
                .iter()
                .map(|g| {
                    g.samples
                        .iter()
                        .map(|s| (s.reward, s.completion_ids.len()))
                        .collect()
                })
                .collect(),
            gen_tokens,
            gen_busy_s,
            tally,
        };
        let bytes = serde_json::to_vec(&report).map_err(|e| TrainError::State {
            what: "this rank's rollout report",
            reason: e.to_string(),
        })?;
        let reports = self
            .collective
            .all_gather_bytes(&bytes)?
            .into_iter()
            .enumerate()
            .map(|(rank, b)| {
                serde_json::from_slice::<ShardReport>(&b).map_err(|e| TrainError::Rank {
                    rank,
                    reason: format!("unreadable rollout report: {e}"),
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        let kept = kept_prompts(&drawn);
        let own = self.own_groups(kept.len());
        let mut own_groups = Some(groups);
        let mut view = BatchView {
            groups: Vec::with_capacity(kept.len()),
            own: own.clone(),
            gen_tokens: 0,
            gen_busy_s: 0.0,
            tally: RewardTally::default(),
        };
        for (rank, report) in reports.into_iter().enumerate() {
            let range = shard_range(kept.len(), rank, world);
            if report.groups.len() != range.len() {
                return Err(TrainError::Rank {
                    rank,
                    reason: format!(
                        "rolled out {} prompts of step {}, its share is {}: the ranks drew \
                         different prompts",
                        report.groups.len(),
                        step,
                        range.len()
                    ),
                });
            }
            if rank == self.collective.rank() {
                view.groups
                    .extend(own_groups.take().expect("one own share"));
            } else {
                for (&(i, w_q), samples) in kept[range].iter().zip(report.groups) {
                    let samples = samples
                        .into_iter()
                        .map(|(reward, len)| Sample {
                            prompt_ids: Vec::new(),
                            completion_ids: vec![0; len],
                            reward,
                            rollout_logprobs: Vec::new(),
                            policy_version: version,
                        })
                        .collect();
                    view.groups.push(Group {
                        w_q,
                        ..Group::new(prompts.problem(i).prompt_id, samples)
                    });
                }
            }
            view.gen_tokens += report.gen_tokens;
            view.gen_busy_s = view.gen_busy_s.max(report.gen_busy_s);
            view.tally.merge(report.tally);
        }
        Ok(view)
    }

    /// Every rank's share of a rollout waiting for its step, joined into the whole step's
    /// (in rank order): what rank 0 saves in a checkpoint. A collective.
    pub fn gather_rollout(
        &self,
        rollout: Option<&StepRollout>,
    ) -> Result<Option<StepRollout>, TrainError> {
        if self.collective.world_size() == 1 {
            return Ok(rollout.cloned());
        }
        let bytes = serde_json::to_vec(&rollout).map_err(|e| TrainError::State {
            what: "this rank's rollout",
            reason: e.to_string(),
        })?;
        let mut whole: Option<StepRollout> = None;
        for (rank, b) in self
            .collective
            .all_gather_bytes(&bytes)?
            .into_iter()
            .enumerate()
        {
            let share: Option<StepRollout> =
                serde_json::from_slice(&b).map_err(|e| TrainError::Rank {
                    rank,
                    reason: format!("unreadable rollout: {e}"),
                })?;
            whole = match (whole, share) {
                (None, share) if rank == 0 => share,
                (Some(mut w), Some(s)) if s.step == w.step && s.version == w.version => {
                    w.groups.extend(s.groups);
                    w.gen_tokens += s.gen_tokens;
                    w.gen_busy_s = w.gen_busy_s.max(s.gen_busy_s);
                    w.tally.merge(s.tally);
                    Some(w)
                }
                (None, None) => None,
                _ => {
                    return Err(TrainError::Rank {
                        rank,
                        reason: "its rollout waiting for the next step is not rank 0's".into(),
                    })
                }
            };
        }
        Ok(whole)
    }

    /// This rank's share of a whole step's rollout read from a checkpoint: its groups; the
    /// rollout's counts go to rank 0 only, so that the step's sums over ranks count them
    /// once.
    pub fn share_of(&self, mut rollout: StepRollout) -> StepRollout {
        if self.collective.world_size() == 1 {
            return rollout;
        }
        let own = self.own_groups(rollout.groups.len());
        rollout.groups = rollout.groups.drain(own).collect();
        if self.collective.rank() != 0 {
            rollout.gen_tokens = 0;
            rollout.gen_busy_s = 0.0;
            rollout.tally = RewardTally::default();
        }
        rollout
    }
}
