//! The step loop of docs/design.md: draw -> prune prompts -> rollout -> reward -> advantages ->
//! prune completions -> pack + learn -> publish -> metrics. [`Trainer::step`] reads as that
//! loop; each concern around it lives in its own module: the supervised warm-up
//! (`warmup`), the rollout staged ahead of its step (`staging`), publishing weights to the
//! engine (`publish`), the gradient-variance study (`variance`), the metrics line
//! (`report`) and the step's batch across data-parallel ranks (`shard`); checkpoints and
//! resume are in [`crate::checkpoint`].

mod publish;
mod report;
mod shard;
mod staging;
mod variance;
mod warmup;

use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device};
use dppo_engine::{Engine, EngineConfig, SamplingParams};
use dppo_model::{Policy, TextTokenizer};
use dppo_sync::PolicyStore;
use rand::{rngs::StdRng, SeedableRng};
use serde_json::{Map, Value};

use crate::advantages::compute_advantages;
use crate::config::RunConfig;
use crate::data::{
    default_extract_mode, mix, problem_prompts, Problem, ProblemOrder, DEMO_STREAM, TRAIN_STREAM,
};
use crate::dist::{broadcast_weights, shard_range, sum_f64, weights_checksum, Collective, Single};
use crate::eval::{evaluate, EvalSet, EvalSpec};
use crate::group::Group;
use crate::learner::{Learner, LearnerConfig};
use crate::loss::LossConfig;
use crate::memory_budget::{
    self, BudgetInputs, LearnerInputs, MemoryBudget, ModelShape, Precision,
};
use crate::optim::{AdamWConfig, LrSchedule};
use crate::prune::{select_completions, Greso, LevelConfig, PromptHistory};
use crate::rewards::RewardSpec;
use crate::train_batch::{build_train_shard, TrainBatch};
use crate::TrainError;

use report::StepReport;
pub(crate) use staging::Pending;
pub use staging::{Drawn, StepRollout};

/// Steps between two checks that every rank holds the same weights (also checked before
/// every checkpoint).
const REPLICA_CHECK_EVERY: u64 = 10;

/// Everything the loop carries from step to step: one rank's, when the run is data
/// parallel (each rank holds a replica of the policy, its own engine and the same loop
/// state).
pub struct Trainer {
    pub cfg: RunConfig,
    pub learner: Learner,
    engine: Arc<Engine>,
    tokenizer: TextTokenizer,
    eos: Vec<u32>,
    train: Vec<Problem>,
    /// Prompt ids of every training problem (chat-formatted when the model has a
    /// template), tokenized once.
    train_prompts: Vec<Vec<u32>>,
    /// This rank's share of the held-out problems (all of them on one rank).
    eval: EvalSet,
    /// Held-out problems over all ranks.
    num_eval: usize,
    /// The ranks of a data-parallel run ([`Single`] on one).
    collective: Arc<dyn Collective>,
    pub(crate) history: PromptHistory,
    pub(crate) greso: Greso,
    /// The RL data position: training problems drawn so far, epochs reshuffled by seed.
    pub(crate) order: ProblemOrder,
    /// The warm-up's own position over the demonstrations (`warmup.examples`).
    demo_order: ProblemOrder,
    store: PolicyStore,
    pub step: u64,
    pub policy_version: u64,
    /// The policy version the engine generates with (behind `policy_version` while a
    /// one-step off-policy rollout is in flight).
    engine_version: u64,
    /// The next step's rollout, when it was started before that step
    /// (`rollout.one_step_off_policy`).
    pub(crate) pending: Option<Pending>,
    /// Seconds spent outside `step` waiting for the pending rollout (before an evaluation
    /// or a checkpoint); the next step counts them as its generation time.
    settle_wait_s: f64,
    /// Optimizer steps skipped for a NaN or infinite loss or gradient norm: in all, and
    /// since the last finite one.
    pub(crate) num_nonfinite_steps: u64,
    num_nonfinite_in_a_row: u64,
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
        let learner_cfg = LearnerConfig {
            loss: LossConfig {
                eps_low: cfg.actor.eps_low,
                eps_high: cfg.actor.eps_high,
                loss_agg: cfg.actor.loss_agg,
                ratio_level: cfg.actor.ratio_level,
                beta: cfg.actor.beta,
            },
            adamw: AdamWConfig {
                weight_decay: cfg.actor.weight_decay,
                ..AdamWConfig::default()
            },
            schedule: LrSchedule {
                lr: cfg.actor.lr,
                warmup_steps: cfg.actor.warmup_steps,
                cosine_total_steps: None,
                min_lr: 0.0,
            },
            grad_clip: cfg.actor.grad_clip,
            pack_tokens: cfg.pack.tokens,
            pack_window: cfg.pack.window,
            compute_dtype: cfg.train.compute_dtype.resolve(device),
        };
        if train.is_empty() {
            return Err(TrainError::Config(
                "the training set is empty (data.train, data.num_train)".into(),
            ));
        }
        let train_prompts = problem_prompts(&policy.tokenizer, &train)?;
        let num_eval = eval.len();
        let eval = EvalSet::new(&policy.tokenizer, eval)?;
        let longest = train_prompts
            .iter()
            .map(Vec::len)
            .fold(eval.longest_prompt(), usize::max);
        check_pack_tokens(&cfg, longest)?;
        let engine_dtype = cfg.engine.dtype.resolve(device);
        let mut engine_cfg = EngineConfig {
            kv_cache_bytes: 1 << 30,
            isolate_high_priority: cfg.deterministic,
            attention: cfg.engine.attention,
            dtype: Some(engine_dtype),
            ..EngineConfig::default()
        };
        // On a GPU the KV cache gets what the memory plan leaves; the CPU keeps its size.
        if let Some((free, total)) = dppo_model::device::memory_info(device)? {
            let seq_len = longest + cfg.rollout.max_response_len;
            let plan = gpu_plan(
                &cfg,
                policy,
                &engine_cfg,
                learner_cfg.compute_dtype,
                (free, total),
                seq_len,
            )?;
            tracing::info!("GPU memory plan:\n{plan}");
            engine_cfg.kv_cache_tokens = Some(plan.kv_tokens as usize);
        }
        let eval = eval.shard(shard_range(
            num_eval,
            collective.rank(),
            collective.world_size(),
        ));
        let replica;
        let policy = if collective.world_size() > 1 {
            let weights = broadcast_weights(collective.as_ref(), &policy.config, &policy.weights)?;
            replica = Policy::new(policy.config.clone(), weights, policy.tokenizer.clone())?;
            &replica
        } else {
            policy
        };
        let mut learner = Learner::new(&policy.config, &policy.weights, learner_cfg)?;
        learner.set_collective(collective.clone());
        let engine = Arc::new(Engine::new(policy, engine_cfg, device.clone())?);
        let store = PolicyStore::new(&policy.weights, device.clone(), engine_dtype)?;
        let num_demos = match cfg.warmup.examples {
            0 => train.len(),
            n => n.min(train.len()),
        };
        Ok(Self {
            history: PromptHistory::new(cfg.dppo.history_decay),
            greso: Greso::default(),
            learner,
            engine,
            tokenizer: policy.tokenizer.clone(),
            eos: policy.eos_token_ids().to_vec(),
            order: ProblemOrder::new(cfg.seed, TRAIN_STREAM, train.len()),
            train,
            train_prompts,
            eval,
            num_eval,
            collective,
            demo_order: ProblemOrder::new(cfg.seed, DEMO_STREAM, num_demos),
            store,
            step: 0,
            policy_version: 0,
            engine_version: 0,
            pending: None,
            settle_wait_s: 0.0,
            num_nonfinite_steps: 0,
            num_nonfinite_in_a_row: 0,
            cfg,
        })
    }

    /// The engine, to share with a server (`dppo run --serve`).
    pub fn engine(&self) -> Arc<Engine> {
        self.engine.clone()
    }

    /// The tokenizer of the policy being trained.
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// Counts a skipped (non-finite) step or resets the streak; returns whether the
    /// weights moved.
    fn count_nonfinite(&mut self, is_nonfinite: bool) -> bool {
        if is_nonfinite {
            self.num_nonfinite_steps += 1;
            self.num_nonfinite_in_a_row += 1;
        } else {
            self.num_nonfinite_in_a_row = 0;
        }
        !is_nonfinite
    }

    /// The error that ends the run once `train.max_nonfinite_steps` steps in a row were
    /// skipped for a NaN or infinite loss or gradient norm (the weights and optimizer are
    /// still those of the last finite step: checkpoint them, then stop).
    pub fn nonfinite_limit(&self) -> Option<TrainError> {
        let max = self.cfg.train.max_nonfinite_steps;
        (max > 0 && self.num_nonfinite_in_a_row >= max).then_some(TrainError::NonFinite {
            in_a_row: self.num_nonfinite_in_a_row,
            step: self.step,
        })
    }

    /// How this run scores completions (`[reward]`, with the data set's default mode).
    fn reward_spec(&self) -> RewardSpec {
        let reward = &self.cfg.reward;
        RewardSpec {
            mode: reward
                .extract
                .unwrap_or_else(|| default_extract_mode(&self.cfg.data.train)),
            max_tokens: self.cfg.rollout.max_response_len,
            overlong_buffer: reward.overlong_buffer,
            overlong_penalty: reward.overlong_penalty,
        }
    }

    /// Greedy accuracy of the current policy on the held-out problems.
    pub fn evaluate(&mut self) -> Result<f64, TrainError> {
        self.settle()?;
        let spec = EvalSpec {
            sampling: SamplingParams {
                temperature: 0.0,
                ..SamplingParams::default()
            },
            n: 1,
            k: 1,
            max_tokens: self.cfg.rollout.max_response_len,
            mode: self.reward_spec().mode,
        };
        let (result, samples) = evaluate(&self.engine, &self.tokenizer, &self.eval, &spec)?;
        if self.collective.world_size() == 1 {
            return Ok(result.avg);
        }
        // Each rank evaluated its share: the accuracy of all of them is the sum of rewards
        // over all ranks (whole numbers: exact in any order) over the sample count.
        let total: f64 = samples.iter().flatten().map(|g| g.reward).sum();
        let total = sum_f64(self.collective.as_ref(), &[total])?[0];
        Ok(total / (self.num_eval.max(1) * spec.n) as f64)
    }

    /// This rank's place in a data-parallel run: (rank, world size).
    pub fn rank(&self) -> (usize, usize) {
        (self.collective.rank(), self.collective.world_size())
    }

    /// Whether any rank asks to stop (`interrupted` is this rank's wish: Ctrl-C): every
    /// rank gets the same answer at the same step, so that all stop together. A collective
    /// when there are several ranks.
    pub fn any_rank(&self, interrupted: bool) -> Result<bool, TrainError> {
        Ok(sum_f64(
            self.collective.as_ref(),
            &[f64::from(u8::from(interrupted))],
        )?[0]
            > 0.0)
    }

    /// Fails with [`TrainError::Diverged`] unless every rank's weights have the same
    /// checksum: silent divergence of the replicas (a non-deterministic kernel, a bad
    /// collective) becomes an error. A collective; free on one rank.
    pub fn check_replicas(&self) -> Result<(), TrainError> {
        if self.collective.world_size() == 1 {
            return Ok(());
        }
        let tensors: BTreeMap<String, candle_core::Tensor> = self
            .learner
            .vars
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        let sum = weights_checksum(&tensors)?;
        let all = self
            .collective
            .all_gather_f64(&[f64::from(sum), self.learner.optimizer.step as f64])?;
        if all.iter().all(|x| *x == all[0]) {
            return Ok(());
        }
        let checksums = all
            .iter()
            .enumerate()
            .map(|(rank, x)| format!("rank {rank}: {:08x} after {} updates", x[0] as u32, x[1]))
            .collect::<Vec<_>>()
            .join(", ");
        Err(TrainError::Diverged {
            step: self.step,
            checksums,
        })
    }

    /// One RL step; returns its metrics line.
    pub fn step(&mut self) -> Result<Map<String, Value>, TrainError> {
        let mut timings = BTreeMap::new();
        let start = Instant::now();
        let mut prune_s = 0.0;
        let pending = match self.pending.take() {
            Some(p) => p,
            None => {
                let t = Instant::now();
                let inflight = self.submit(self.step)?;
                prune_s += t.elapsed().as_secs_f64();
                Pending::InFlight(inflight)
            }
        };
        let t = Instant::now();
        let rollout = self.finish(pending)?;
        let (version, num_drawn) = (rollout.version, rollout.drawn.problems.len());
        let staleness = self.policy_version - version;
        let gen_s = t.elapsed().as_secs_f64() + std::mem::take(&mut self.settle_wait_s);
        // Every rank's rollout: this rank's groups, the others' rewards and lengths.
        let shard::BatchView {
            mut groups,
            own,
            gen_tokens,
            gen_busy_s,
            extracted_by,
            num_correct,
        } = self.batch_view(rollout)?;
        timings.insert("timing_s/gen".to_string(), gen_s);
        let mut timed = |name: &str, since: Instant| {
            timings.insert(format!("timing_s/{name}"), since.elapsed().as_secs_f64());
        };
        let t = Instant::now();
        compute_advantages(&mut groups, self.cfg.actor.scale_rewards);
        self.history.update(&groups, self.step);
        self.greso.update(&groups);
        let level = self.cfg.dppo.level(self.cfg.dppo.r_o);
        let (batch, num_trained) = self.train_batch(
            &groups,
            own.clone(),
            num_drawn,
            &level,
            &mut self.phase_rng(2),
        );
        timed("reward", t);
        if self.cfg.rollout.one_step_off_policy {
            let t = Instant::now();
            self.sync_engine()?;
            self.pending = Some(Pending::InFlight(self.submit(self.step + 1)?));
            prune_s += t.elapsed().as_secs_f64();
        }
        let t = Instant::now();
        let draws = self.cfg.eval.grad_variance_draws;
        let variance = if draws > 0 && self.cfg.eval.due(self.step + 1) {
            Some(self.pruning_variance(&groups, own, num_drawn, &level, draws)?)
        } else {
            None
        };
        let variance_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let m = self.learner.step(&batch)?;
        timed("train", t);
        let t = Instant::now();
        if self.count_nonfinite(m.is_nonfinite) {
            self.publish()?;
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
            policy_version: self.policy_version,
            staleness,
            groups: &groups,
            num_drawn,
            num_trained,
            samples_per_prompt: self.cfg.rollout.n,
            num_correct,
            extracted_by,
            gen_tokens,
            gen_busy_s,
            learner: &m,
            num_nonfinite_steps: self.num_nonfinite_steps,
            grad_rel_mse: variance,
            timings,
        }
        .into_line())
    }

    /// Completion pruning of the step's `groups` at `level` (every rank prunes the whole
    /// batch alike) and the learner's batch of the survivors among this rank's `own`
    /// groups, with the whole batch's normalisers; also returns how many completions
    /// survived in all. `num_drawn` counts every prompt drawn for the step.
    fn train_batch(
        &self,
        groups: &[Group],
        own: Range<usize>,
        num_drawn: usize,
        level: &LevelConfig,
        rng: &mut StdRng,
    ) -> (TrainBatch, usize) {
        let kept = select_completions(
            groups,
            self.cfg.algorithm,
            level,
            self.cfg.dppo.scope,
            self.cfg.actor.beta,
            rng,
        );
        let batch = build_train_shard(
            groups,
            &kept,
            own,
            num_drawn,
            self.cfg.rollout.n,
            self.cfg.rollout.max_response_len,
            self.cfg.algorithm,
        );
        (batch, kept.len())
    }

    /// The random stream of one phase of the current step (see `step_rng`).
    fn phase_rng(&self, phase: u64) -> StdRng {
        self.step_rng(self.step, phase)
    }

    /// The random stream of one phase of `step`: a function of (seed, step, phase) only,
    /// so that a resumed run draws exactly what the uninterrupted run drew.
    fn step_rng(&self, step: u64, phase: u64) -> StdRng {
        StdRng::seed_from_u64(mix(self.cfg.seed, step, phase))
    }
}

/// Start-up check: the `longest` prompt plus `max_response_len` must fit one packed buffer.
fn check_pack_tokens(cfg: &RunConfig, longest: usize) -> Result<(), TrainError> {
    let needed = longest + cfg.rollout.max_response_len;
    if needed > cfg.pack.tokens {
        return Err(TrainError::Config(format!(
            "pack.tokens = {} is smaller than the longest prompt ({longest} tokens) plus \
             rollout.max_response_len ({}); set pack.tokens >= {needed}",
            cfg.pack.tokens, cfg.rollout.max_response_len
        )));
    }
    Ok(())
}

/// The memory plan of a co-located run on a GPU with `free` of `total` bytes, in the
/// engine's and the learner's dtypes.
fn gpu_plan(
    cfg: &RunConfig,
    policy: &Policy,
    engine: &EngineConfig,
    learner_dtype: DType,
    (free, total): (u64, u64),
    seq_len: usize,
) -> Result<MemoryBudget, TrainError> {
    Ok(memory_budget::budget(&BudgetInputs {
        model: ModelShape::from(&policy.config),
        engine_dtype: precision(engine.dtype.unwrap_or(DType::F32)),
        learner: Some(LearnerInputs {
            compute_dtype: precision(learner_dtype),
            pack_tokens: cfg.pack.tokens as u64,
        }),
        total_memory: total,
        free_memory: free,
        gpu_memory_utilization: cfg.engine.gpu_memory_utilization,
        block_size: engine.block_size as u64,
        max_batched_tokens: engine.max_batched_tokens as u64,
        seq_len: seq_len as u64,
    })?)
}

/// The memory plan's name of a floating-point dtype.
fn precision(dtype: DType) -> Precision {
    match dtype {
        DType::BF16 => Precision::Bf16,
        DType::F16 => Precision::F16,
        _ => Precision::F32,
    }
}

#[cfg(test)]
mod tests;
