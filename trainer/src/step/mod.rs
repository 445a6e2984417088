//! The step loop of docs/design.md: draw -> prune prompts -> rollout -> reward -> advantages ->
//! prune completions -> pack + learn -> publish -> metrics. [`Trainer::step`] reads as that
//! loop. The trainer is built from parts that each own their fields and their share of a
//! checkpoint: the training prompts and the pruning algorithm (`prompts`), the engine's
//! rollouts and weight publication (`rollout`), the learner, the held-out evaluation
//! (`held_out`), the ranks of a data-parallel run (`shard`) and the non-finite step count
//! (`nonfinite`); the gradient-variance study (`variance`) and the metrics line (`report`)
//! are functions of a step's data; `state` saves and restores the whole. The trainer only
//! calls the parts' methods.

mod dump;
mod held_out;
mod nonfinite;
mod prompts;
mod report;
mod rollout;
mod scoring;
mod setup;
mod shard;
mod state;
mod variance;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use candle_core::Device;
use dppo_engine::Engine;
use dppo_model::{Policy, TextTokenizer};
use rand::{rngs::StdRng, SeedableRng};
use serde_json::{Map, Value};

use crate::advantages::compute_advantages;
use crate::config::RunConfig;
use crate::data::{mix, Problem};
use crate::dist::{broadcast_weights, Collective, Single};
use crate::eval::EvalSet;
use crate::learner::Learner;
use crate::reward::Scorer;
use crate::train_batch::prune_and_build;
use crate::TrainError;

use held_out::HeldOut;
use nonfinite::NonFinite;
use prompts::Prompts;
use report::StepReport;
use rollout::{Pending, Rollouts};
use shard::{kept_prompts, Ranks};

pub use rollout::StepRollout;
pub use state::TrainerState;

/// Steps between two checks that every rank holds the same weights (also checked before
/// every checkpoint).
const REPLICA_CHECK_EVERY: u64 = 10;

/// Random-stream phases of a step: the prompt draw and completion pruning.
const DRAW_PHASE: u64 = 1;
const PRUNE_PHASE: u64 = 2;

/// Everything the loop carries from step to step: one rank's, when the run is data
/// parallel (each rank holds a replica of the policy, its own engine and the same loop
/// state).
pub struct Trainer {
    pub cfg: RunConfig,
    /// RL steps done.
    pub step: u64,
    prompts: Prompts,
    rollouts: Rollouts,
    pub learner: Learner,
    held_out: HeldOut,
    ranks: Ranks,
    nonfinite: NonFinite,
    tokenizer: TextTokenizer,
    eos: Vec<u32>,
}

impl Trainer {
    /// Builds the engine and the learner over `policy`, whose weights are on `device`: the
    /// process's one handle of it, shared by both.
    pub fn new(
        cfg: RunConfig,
        policy: &Policy,
        device: &Device,
        train: Vec<Problem>,
        eval: Vec<Problem>,
    ) -> Result<Self, TrainError> {
        Self::with_collective(cfg, policy, device, train, eval, Arc::new(Single))
    }

    /// [`Trainer::new`] for one rank of a data-parallel run over `collective`: every rank
    /// calls it with the same configuration and data; rank 0's weights are broadcast so
    /// that the replicas start from the same bits.
    pub fn with_collective(
        cfg: RunConfig,
        policy: &Policy,
        device: &Device,
        train: Vec<Problem>,
        eval: Vec<Problem>,
        collective: Arc<dyn Collective>,
    ) -> Result<Self, TrainError> {
        let learner_cfg = setup::learner_config(&cfg, device);
        // (An empty set is Prompts::new's error.)
        let no_demos = !train.is_empty() && !train.iter().any(|p| p.solution.is_some());
        if cfg.warmup.steps > 0 && no_demos {
            return Err(crate::data::DataError::NoDemonstrations {
                data: cfg.data.train.to_string(),
                steps: cfg.warmup.steps,
            }
            .into());
        }
        let prompts = Prompts::new(&cfg, &policy.tokenizer, train)?;
        let eval = EvalSet::new(&policy.tokenizer, eval, cfg.data.max_prompt_length)?;
        let longest = prompts.longest().max(eval.longest_prompt());
        setup::check_lengths(&cfg, longest, policy.config.max_position_embeddings)?;
        let seq_len = longest + cfg.rollout.max_response_len;
        let engine_cfg =
            setup::engine_config(&cfg, policy, device, learner_cfg.compute_dtype, seq_len)?;
        let ranks = Ranks::new(collective.clone());
        let replica;
        let policy = if collective.world_size() > 1 {
            let weights = broadcast_weights(collective.as_ref(), &policy.config, &policy.weights)?;
            replica = Policy::new(policy.config.clone(), weights, policy.tokenizer.clone())?;
            &replica
        } else {
            policy
        };
        let mut learner = Learner::new(&policy.config, &policy.weights, learner_cfg)?;
        learner.set_collective(collective);
        // The engine generates on a stream of its own while the learner trains on
        // `device`'s (see `dppo_model::streams`).
        let engine_device = dppo_model::streams::own_stream(device)?;
        let engine = Arc::new(Engine::new(policy, engine_cfg, engine_device)?);
        let scorer = Scorer::new(&cfg.reward, crate::reward::spec(&cfg))?;
        let scorer = Arc::new(scorer);
        let rollouts = Rollouts::new(&cfg, engine, policy.tokenizer.clone(), scorer.clone());
        Ok(Self {
            held_out: HeldOut::new(eval, &ranks, cfg.rollout.max_response_len, scorer),
            nonfinite: NonFinite::new(cfg.train.max_nonfinite_steps),
            prompts,
            rollouts,
            learner,
            ranks,
            tokenizer: policy.tokenizer.clone(),
            eos: policy.eos_token_ids().to_vec(),
            step: 0,
            cfg,
        })
    }

    /// The engine, to share with a server (`dppo run --serve`).
    pub fn engine(&self) -> Arc<Engine> {
        self.rollouts.engine().clone()
    }

    /// The newest published policy version: one per optimizer step that moved the weights.
    pub fn policy_version(&self) -> u64 {
        self.rollouts.policy_version()
    }

    /// The tokenizer of the policy being trained.
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// This rank's place in a data-parallel run: (rank, world size).
    pub fn rank(&self) -> (usize, usize) {
        self.ranks.rank()
    }

    /// Whether any rank asks to stop (`interrupted` is this rank's wish: Ctrl-C): every
    /// rank gets the same answer at the same step, so that all stop together. A collective
    /// when there are several ranks.
    pub fn any_rank(&self, interrupted: bool) -> Result<bool, TrainError> {
        self.ranks.any(interrupted)
    }

    /// Fails with [`TrainError::Diverged`] unless every rank holds the same weights.
    pub fn check_replicas(&self) -> Result<(), TrainError> {
        self.ranks.check_replicas(&self.learner, self.step)
    }

    /// The error that ends the run once `train.max_nonfinite_steps` steps in a row were
    /// skipped for a NaN or infinite loss or gradient norm (the weights and optimizer are
    /// still those of the last finite step: checkpoint them, then stop).
    pub fn nonfinite_limit(&self) -> Option<TrainError> {
        self.nonfinite.limit(self.step)
    }

    /// Greedy accuracy of the current policy on the held-out problems.
    pub fn evaluate(&mut self) -> Result<f64, TrainError> {
        Ok(self.evaluate_by_source()?.0)
    }

    /// [`Trainer::evaluate`], and each data source's score when the held-out set has
    /// several.
    pub fn evaluate_by_source(&mut self) -> Result<(f64, BTreeMap<String, f64>), TrainError> {
        self.rollouts.settle()?;
        let engine = self.rollouts.engine();
        self.held_out.accuracy(engine, &self.tokenizer, &self.ranks)
    }

    /// One supervised warm-up step on a batch of demonstrations; returns the mean NLL.
    pub fn warmup_step(&mut self) -> Result<f64, TrainError> {
        let eos = self.eos.first().copied();
        let seqs = self
            .prompts
            .demo_batch(self.cfg.warmup.batch_size, &self.tokenizer, eos)?;
        let m = self.learner.sft_step(&seqs, self.cfg.warmup.lr)?;
        if self.nonfinite.count(m.is_nonfinite) {
            self.rollouts.publish(&self.learner)?;
        }
        Ok(m.pg_loss)
    }

    /// Ends the supervised warm-up: the KL term (if on) is measured against this policy.
    pub fn finish_warmup(&mut self) -> Result<(), TrainError> {
        let weights = self.learner.weights()?;
        self.learner.set_reference(&weights)
    }

    /// One RL step; returns its metrics line.
    pub fn step(&mut self) -> Result<Map<String, Value>, TrainError> {
        let mut timings = BTreeMap::new();
        let start = Instant::now();
        let mut prune_s = 0.0;
        let (pending, settle_wait_s) = self.rollouts.take_pending();
        let pending = match pending {
            Some(p) => p,
            None => {
                let t = Instant::now();
                let inflight = self.submit(self.step)?;
                prune_s += t.elapsed().as_secs_f64();
                inflight
            }
        };
        let t = Instant::now();
        let rollout = self.rollouts.finish(pending)?;
        let (version, num_drawn) = (rollout.version, rollout.drawn.problems.len());
        let staleness = self.policy_version() - version;
        let gen_s = t.elapsed().as_secs_f64() + settle_wait_s;
        // Every rank's rollout: this rank's groups, the others' rewards and lengths.
        let shard::BatchView {
            mut groups,
            own,
            gen_tokens,
            gen_busy_s,
            tally,
        } = self.ranks.batch_view(rollout, &self.prompts)?;
        timings.insert("timing_s/gen".to_string(), gen_s);
        let mut timed = |name: &str, since: Instant| {
            timings.insert(format!("timing_s/{name}"), since.elapsed().as_secs_f64());
        };
        let t = Instant::now();
        compute_advantages(&mut groups, self.cfg.actor.scale_rewards);
        self.prompts.update(&groups, self.step);
        let algorithm = self.prompts.algorithm();
        let (batch, kept) = prune_and_build(
            algorithm,
            &groups,
            own.clone(),
            num_drawn,
            algorithm.completion_rate(),
            &mut self.step_rng(self.step, PRUNE_PHASE),
        );
        let num_trained = kept.len();
        if let Some(dir) = &self.cfg.rollout.dump_dir {
            let dump = dump::RolloutDump {
                step: self.step + 1,
                rank: self.rank().0,
                groups: &groups,
                own: own.clone(),
                kept: &kept,
                prompts: &self.prompts,
            };
            dump.write(Path::new(dir), &self.tokenizer)?;
        }
        // `timing_s/reward`: the work on the scored rollout (scoring itself overlaps
        // generation and is in `timing_s/gen`).
        timed("reward", t);
        if self.cfg.rollout.one_step_off_policy {
            let t = Instant::now();
            let next = self.submit(self.step + 1)?;
            self.rollouts.set_pending(next);
            prune_s += t.elapsed().as_secs_f64();
        }
        let t = Instant::now();
        let draws = self.cfg.eval.grad_variance_draws;
        let variance = if draws > 0 && self.cfg.eval.due(self.step + 1) {
            let inputs = variance::VarianceInputs {
                algorithm: self.prompts.algorithm(),
                learner: &self.learner,
                groups: &groups,
                own,
                num_drawn,
                draws,
            };
            Some(variance::pruning_variance(&inputs, |phase| {
                self.step_rng(self.step, phase)
            })?)
        } else {
            None
        };
        let variance_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let m = self.learner.step(&batch)?;
        timed("train", t);
        let t = Instant::now();
        if self.nonfinite.count(m.is_nonfinite) {
            self.rollouts.publish(&self.learner)?;
        }
        timed("sync", t);
        timings.insert("timing_s/prune".into(), prune_s);
        timings.insert(
            "timing_s/step".into(),
            start.elapsed().as_secs_f64() - variance_s,
        );
        self.step += 1;
        if self.step.is_multiple_of(REPLICA_CHECK_EVERY) {
            self.check_replicas()?;
        }
        Ok(StepReport {
            step: self.step,
            policy_version: self.policy_version(),
            staleness,
            groups: &groups,
            num_drawn,
            num_trained,
            samples_per_prompt: self.cfg.rollout.n,
            max_response_len: self.cfg.rollout.max_response_len,
            correction_on: self.cfg.rollout_correction.is_on(),
            tally,
            gen_tokens,
            gen_busy_s,
            learner: &m,
            num_nonfinite_steps: self.nonfinite.num_steps(),
            grad_rel_mse: variance,
            timings,
        }
        .into_line())
    }

    /// Draws and prunes `step`'s prompts and submits this rank's share of the kept ones.
    fn submit(&mut self, step: u64) -> Result<Pending, TrainError> {
        let drawn = self.prompts.draw(&mut self.step_rng(step, DRAW_PHASE));
        let kept = kept_prompts(&drawn);
        let own = self.ranks.own_groups(kept.len());
        let inflight = self
            .rollouts
            .submit(step, drawn, &kept, own, &self.prompts)?;
        Ok(Pending::InFlight(inflight))
    }

    /// The random stream of one phase of `step`: a function of (seed, step, phase) only,
    /// so that a resumed run draws exactly what the uninterrupted run drew.
    fn step_rng(&self, step: u64, phase: u64) -> StdRng {
        StdRng::seed_from_u64(mix(self.cfg.seed, step, phase))
    }
}

#[cfg(test)]
mod tests;
