//! The step loop of DESIGN.md: draw -> prune prompts -> rollout -> reward -> advantages ->
//! prune completions -> pack + learn -> publish -> metrics. Each phase is a method that
//! takes and returns typed values and is timed into `timing_s/*`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device};
use dppo_engine::{Engine, EngineConfig, GenerateRequest, Priority, SamplingParams};
use dppo_model::{Policy, TextTokenizer};
use dppo_sync::PolicyStore;
use rand::{rngs::StdRng, SeedableRng};
use serde_json::{json, Map, Value};

use crate::advantages::compute_advantages;
use crate::config::RunConfig;
use crate::data::{mix, prompt_ids, Problem, ProblemOrder, DEMO_STREAM, TRAIN_STREAM};
use crate::eval::{evaluate, EvalSpec};
use crate::learner::{Learner, LearnerConfig};
use crate::loss::{LossConfig, TrainSeq};
use crate::optim::{squared_norm, AdamWConfig, LrSchedule};
use crate::prune::{select_completions, Algorithm, Greso, LevelConfig, PromptHistory};
use crate::rewards::score;
use crate::rollout::{Group, Sample};
use crate::train_batch::{build_train_batch, TrainBatch};
use crate::TrainError;

/// First random-stream phase of the gradient-variance draws (far from the training phases).
const VARIANCE_PHASE: u64 = 1 << 32;

/// `a - b` per parameter over the parameters of both; a gradient missing from one side (no
/// kept item reached that parameter) counts as zero.
fn difference(a: &Gradients, b: &Gradients) -> Result<Gradients, TrainError> {
    let names = a.keys().chain(b.keys().filter(|n| !a.contains_key(*n)));
    let mut out = Gradients::new();
    for name in names {
        let diff = match (a.get(name), b.get(name)) {
            (Some(x), Some(y)) => (x - y)?,
            (Some(x), None) => x.clone(),
            (None, Some(y)) => y.neg()?,
            (None, None) => unreachable!("every name comes from a or b"),
        };
        out.insert(name.clone(), diff);
    }
    Ok(out)
}

/// Gradients by parameter name, as the learner returns them.
type Gradients = BTreeMap<String, candle_core::Tensor>;

/// Everything the loop carries from step to step.
pub struct Trainer {
    pub cfg: RunConfig,
    pub learner: Learner,
    engine: Arc<Engine>,
    tokenizer: TextTokenizer,
    eos: Vec<u32>,
    train: Vec<Problem>,
    eval: Vec<Problem>,
    pub(crate) history: PromptHistory,
    pub(crate) greso: Greso,
    /// The RL data position: training problems drawn so far, epochs reshuffled by seed.
    pub(crate) order: ProblemOrder,
    /// The warm-up's own position over the demonstrations (`warmup.examples`).
    demo_order: ProblemOrder,
    store: PolicyStore,
    pub step: u64,
    pub policy_version: u64,
}

/// The prompts drawn for a step and what prompt pruning made of them.
struct Drawn {
    problems: Vec<usize>,
    /// `w_q` of each drawn prompt; `None` when it is not rolled out.
    w_q: Vec<Option<f64>>,
}

impl Trainer {
    /// Builds the engine and the learner over `policy`.
    pub fn new(
        cfg: RunConfig,
        policy: &Policy,
        train: Vec<Problem>,
        eval: Vec<Problem>,
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
        };
        if train.is_empty() {
            return Err(TrainError::Config(
                "the training set is empty (data.train, data.num_train)".into(),
            ));
        }
        let learner = Learner::new(&policy.config, &policy.weights, learner_cfg)?;
        let engine_cfg = EngineConfig {
            kv_cache_bytes: 1 << 30,
            isolate_high_priority: cfg.deterministic,
            ..EngineConfig::default()
        };
        let engine = Arc::new(Engine::new(policy, engine_cfg, Device::Cpu)?);
        let store = PolicyStore::new(&policy.weights, Device::Cpu, DType::F32)?;
        check_pack_tokens(&cfg, &policy.tokenizer, train.iter().chain(&eval))?;
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
            eval,
            demo_order: ProblemOrder::new(cfg.seed, DEMO_STREAM, num_demos),
            store,
            step: 0,
            policy_version: 0,
            cfg,
        })
    }

    /// The engine, to share with a server (`dppo run --serve`).
    pub fn engine(&self) -> Arc<Engine> {
        self.engine.clone()
    }

    /// Prompt ids of a problem, chat-formatted when the model has a template.
    fn prompt_ids(&self, p: &Problem) -> Result<Vec<u32>, TrainError> {
        Ok(prompt_ids(&self.tokenizer, &p.question)?)
    }

    /// One supervised warm-up step on a batch of demonstrations; returns the mean NLL.
    pub fn warmup_step(&mut self) -> Result<f64, TrainError> {
        let idx = self.demo_order.next(self.cfg.warmup.batch_size);
        let eos = self.eos.first().copied();
        let mut seqs = Vec::with_capacity(idx.len());
        for i in idx {
            let p = &self.train[i];
            let Some(solution) = &p.solution else {
                continue;
            };
            let mut tokens = self.prompt_ids(p)?;
            let num_prompt_tokens = tokens.len();
            tokens.extend(self.tokenizer.encode(solution, false)?);
            tokens.extend(eos);
            seqs.push(TrainSeq {
                num_prompt_tokens,
                rollout_logprobs: vec![0.0; tokens.len() - num_prompt_tokens],
                tokens,
                advantage: 0.0,
                weight: 1.0,
            });
        }
        let loss = self.learner.sft_step(&seqs, self.cfg.warmup.lr)?;
        self.publish()?;
        Ok(loss)
    }

    /// Ends the supervised warm-up: the KL term (if on) is measured against this policy.
    pub fn finish_warmup(&mut self) -> Result<(), TrainError> {
        let weights = self.learner.weights()?;
        self.learner.set_reference(&weights)
    }

    /// Greedy accuracy on the held-out problems.
    pub fn evaluate(&self) -> Result<f64, TrainError> {
        let spec = EvalSpec {
            sampling: SamplingParams {
                temperature: 0.0,
                ..SamplingParams::default()
            },
            n: 1,
            k: 1,
            max_tokens: self.cfg.rollout.max_response_len,
        };
        Ok(evaluate(&self.engine, &self.tokenizer, &self.eval, &spec)?
            .0
            .avg)
    }

    /// One RL step; returns its metrics line.
    pub fn step(&mut self) -> Result<Map<String, Value>, TrainError> {
        let mut timings = BTreeMap::new();
        let start = Instant::now();
        let mut timed = |name: &str, since: Instant| {
            timings.insert(format!("timing_s/{name}"), since.elapsed().as_secs_f64());
        };
        let t = Instant::now();
        let drawn = self.draw_and_prune_prompts();
        timed("prune", t);
        let t = Instant::now();
        let (mut groups, gen_tokens) = self.rollout(&drawn)?;
        timed("gen", t);
        let gen_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        compute_advantages(&mut groups, self.cfg.actor.scale_rewards);
        self.history.update(&groups, self.step);
        self.greso.update(&groups);
        let level = self.cfg.dppo.level(self.cfg.dppo.r_o);
        let batch = self.train_batch(
            &groups,
            drawn.problems.len(),
            &level,
            &mut self.phase_rng(2),
        );
        timed("reward", t);
        let t = Instant::now();
        let draws = self.cfg.eval.grad_variance_draws;
        let variance = if draws > 0 && self.cfg.eval.due(self.step + 1) {
            Some(self.pruning_variance(&groups, drawn.problems.len(), &level, draws)?)
        } else {
            None
        };
        let variance_s = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let m = self.learner.step(&batch)?;
        timed("train", t);
        let t = Instant::now();
        self.publish()?;
        timed("sync", t);
        timings.insert(
            "timing_s/step".into(),
            start.elapsed().as_secs_f64() - variance_s,
        );
        self.step += 1;
        let rewards: Vec<f64> = groups
            .iter()
            .flat_map(|g| g.samples.iter().map(|s| s.reward))
            .collect();
        let completions = (groups.len() * self.cfg.rollout.n).max(1);
        let mut line = Map::new();
        let mut put = |k: &str, v: Value| {
            line.insert(k.to_string(), v);
        };
        put("step", json!(self.step));
        put("policy_version", json!(self.policy_version));
        put(
            "reward/mean",
            json!(rewards.iter().sum::<f64>() / rewards.len().max(1) as f64),
        );
        put(
            "acc/mean",
            json!(
                rewards.iter().filter(|&&r| r >= 1.0).count() as f64 / rewards.len().max(1) as f64
            ),
        );
        put(
            "prune/prompts_kept",
            json!(groups.len() as f64 / drawn.problems.len().max(1) as f64),
        );
        put(
            "prune/completions_kept",
            json!(batch.seqs.len() as f64 / completions as f64),
        );
        put("pack/density", json!(m.pack_density));
        put("pack/buffers", json!(m.num_buffers));
        put("perf/gen_tokens_per_s", json!(gen_tokens as f64 / gen_s));
        put("perf/train_tokens_per_s", json!(m.train_tokens_per_s));
        put("actor/pg_loss", json!(m.pg_loss));
        put("actor/grad_norm", json!(m.grad_norm));
        put("actor/clipfrac", json!(m.clipfrac));
        put("actor/entropy", json!(m.entropy));
        put("actor/lr", json!(m.lr));
        if let Some(v) = variance {
            put("prune/grad_rel_mse", json!(v));
        }
        for (k, v) in timings {
            line.insert(k, json!(v));
        }
        Ok(line)
    }

    /// How far the completion-pruned gradient scatters around the unpruned one on this
    /// step's groups: the mean over `draws` pruning draws of `|g_draw - g_full|^2 /
    /// |g_full|^2` (ALGORITHM.md §5). For the unbiased DPPO this is the estimator's relative
    /// variance; for CPPO's deterministic cut it is its squared bias. Prompt-level pruning
    /// has already happened and is not part of it. Draws use their own random streams, so
    /// training is unchanged.
    fn pruning_variance(
        &self,
        groups: &[Group],
        num_drawn: usize,
        level: &LevelConfig,
        draws: usize,
    ) -> Result<f64, TrainError> {
        let gradient = |rate: f64, rng: &mut StdRng| {
            let level = LevelConfig { rate, ..*level };
            let batch = self.train_batch(groups, num_drawn, &level, rng);
            Ok::<_, TrainError>(self.learner.gradients(&batch)?.0)
        };
        let full = gradient(0.0, &mut self.phase_rng(VARIANCE_PHASE))?;
        let norm = squared_norm(&full)?;
        if norm == 0.0 {
            return Ok(0.0);
        }
        let mut total = 0.0;
        for d in 0..draws as u64 {
            let pruned = gradient(level.rate, &mut self.phase_rng(VARIANCE_PHASE + 1 + d))?;
            total += squared_norm(&difference(&pruned, &full)?)?;
        }
        Ok(total / draws as f64 / norm)
    }

    /// Completion pruning of `groups` at `level` and the learner's batch of the survivors;
    /// `num_drawn` counts every prompt drawn for the step.
    fn train_batch(
        &self,
        groups: &[Group],
        num_drawn: usize,
        level: &LevelConfig,
        rng: &mut StdRng,
    ) -> TrainBatch {
        let kept = select_completions(
            groups,
            self.cfg.algorithm,
            level,
            self.cfg.dppo.scope,
            self.cfg.actor.beta,
            rng,
        );
        build_train_batch(
            groups,
            &kept,
            num_drawn,
            self.cfg.rollout.n,
            self.cfg.rollout.max_response_len,
            self.cfg.algorithm,
        )
    }

    /// The random stream of one phase of the current step: a function of (seed, step,
    /// phase) only, so that a resumed run draws exactly what the uninterrupted run drew.
    fn phase_rng(&self, phase: u64) -> StdRng {
        StdRng::seed_from_u64(mix(self.cfg.seed, self.step, phase))
    }

    fn draw_and_prune_prompts(&mut self) -> Drawn {
        let p = self.cfg.rollout.prompts_per_step;
        let level = self.cfg.dppo.level(self.cfg.dppo.r_q);
        let count = match self.cfg.algorithm {
            Algorithm::Dppo if self.cfg.dppo.allocation => self.history.overdraw(p, level.rate),
            Algorithm::Greso => return self.draw_greso(p),
            Algorithm::Dppo | Algorithm::Grpo | Algorithm::Cppo => p,
        };
        let problems = self.order.next(count);
        let ids: Vec<u64> = problems.iter().map(|&i| self.train[i].prompt_id).collect();
        let w_q = match self.cfg.algorithm {
            Algorithm::Dppo => self.history.select(&ids, &level, &mut self.phase_rng(1)),
            _ => vec![Some(1.0); ids.len()],
        };
        Drawn { problems, w_q }
    }

    /// GRESO's selective rollout with its adaptive batch size: prompts are drawn until `p`
    /// of them are rolled out (at most one pass over the training set), so that skipping
    /// saves rollouts of uninformative prompts instead of shrinking the batch.
    fn draw_greso(&mut self, p: usize) -> Drawn {
        let mut rng = self.phase_rng(1);
        let (mut problems, mut w_q) = (Vec::new(), Vec::new());
        let mut kept = 0;
        while kept < p && problems.len() < self.train.len() {
            let next = self
                .order
                .next((p - kept).min(self.train.len() - problems.len()));
            let ids: Vec<u64> = next.iter().map(|&i| self.train[i].prompt_id).collect();
            for keep in self.greso.select(&ids, &mut rng) {
                kept += usize::from(keep);
                w_q.push(keep.then_some(1.0));
            }
            problems.extend(next);
        }
        Drawn { problems, w_q }
    }

    /// Generates `n` samples of every kept prompt and scores them; checks that every
    /// sample came from the policy version this step expects.
    fn rollout(&mut self, drawn: &Drawn) -> Result<(Vec<Group>, usize), TrainError> {
        let kept: Vec<(usize, f64)> = drawn
            .problems
            .iter()
            .zip(&drawn.w_q)
            .filter_map(|(&i, w)| w.map(|w| (i, w)))
            .collect();
        let mut prompts = Vec::with_capacity(kept.len());
        let mut reqs = Vec::with_capacity(kept.len());
        for (k, &(i, _)) in kept.iter().enumerate() {
            let ids = self.prompt_ids(&self.train[i])?;
            reqs.push(GenerateRequest {
                sampling: SamplingParams {
                    temperature: self.cfg.rollout.temperature,
                    top_p: self.cfg.rollout.top_p,
                    seed: Some(mix(self.cfg.seed, self.step, 1000 + k as u64)),
                    ..SamplingParams::default()
                },
                priority: Priority::High,
                ..GenerateRequest::new(
                    ids.clone(),
                    self.cfg.rollout.n,
                    self.cfg.rollout.max_response_len,
                )
            });
            prompts.push(ids);
        }
        let outs = self.engine.generate(reqs)?;
        let mut groups = Vec::with_capacity(kept.len());
        let mut gen_tokens = 0;
        for ((&(i, w_q), prompt), completions) in kept.iter().zip(prompts).zip(outs) {
            let problem = &self.train[i];
            let mut samples = Vec::with_capacity(completions.len());
            for c in completions {
                if c.policy_version != self.policy_version
                    || c.last_policy_version != self.policy_version
                {
                    return Err(TrainError::Version {
                        expected: self.policy_version,
                        got: c.last_policy_version,
                    });
                }
                gen_tokens += c.token_ids.len();
                let text = self.tokenizer.decode(&c.token_ids, true)?;
                samples.push(Sample {
                    prompt_ids: prompt.clone(),
                    reward: score(&text, &problem.answer),
                    completion_ids: c.token_ids,
                    rollout_logprobs: c.logprobs,
                    policy_version: c.policy_version,
                });
            }
            groups.push(Group {
                w_q,
                ..Group::new(problem.prompt_id, samples)
            });
        }
        Ok((groups, gen_tokens))
    }

    /// The tokenizer of the policy being trained.
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tokenizer
    }

    /// After a restore: the learner's weights become policy `version` in the store and the
    /// engine, so that the next rollout is checked against the right version.
    pub(crate) fn resume_version(&mut self, version: u64) -> Result<(), TrainError> {
        let weights = self.learner.weights()?;
        self.store.restore(&weights, version)?;
        self.policy_version = version;
        self.engine.swap_weights(&weights, version)?;
        Ok(())
    }

    /// Publishes the learner's weights as the next policy version and hands them to the
    /// engine, which swaps them in before its next iteration. Zero-copy on CPU f32: the
    /// loop is synchronous, so the optimizer never writes while the engine reads.
    fn publish(&mut self) -> Result<(), TrainError> {
        self.policy_version = self.store.publish(&self.learner.weights()?)?;
        let published = self.store.latest();
        self.engine
            .swap_weights(&published.weights, published.version)?;
        Ok(())
    }
}

/// Start-up check: every prompt plus `max_response_len` must fit one packed buffer.
fn check_pack_tokens<'a>(
    cfg: &RunConfig,
    tokenizer: &TextTokenizer,
    problems: impl Iterator<Item = &'a Problem>,
) -> Result<(), TrainError> {
    let mut longest = 0;
    for p in problems {
        longest = longest.max(prompt_ids(tokenizer, &p.question)?.len());
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::builtin_task;
    use crate::prune::PromptStats;

    #[test]
    fn the_warm_up_draws_only_demonstrations_and_leaves_the_rl_position() {
        let overrides = [
            "warmup.examples=8".to_string(),
            "warmup.batch_size=4".into(),
        ];
        let cfg = RunConfig::default_with(&overrides).unwrap();
        let policy = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
        let (train, eval) = builtin_task("arithmetic", 64, 4, 0).unwrap();
        let mut trainer = Trainer::new(cfg, &policy, train, eval).unwrap();
        let mut demos = trainer.demo_order.clone();
        for _ in 0..3 {
            trainer.warmup_step().unwrap();
        }
        assert_eq!(
            trainer.order.drawn, 0,
            "RL starts at the first training problem"
        );
        assert_eq!(trainer.demo_order.drawn, 12);
        assert!(demos.next(12).iter().all(|&i| i < 8));
        assert_eq!(trainer.policy_version, 3);
    }

    #[test]
    fn pruning_variance_is_zero_unpruned_and_grows_with_the_rate() {
        let cfg = RunConfig::default_with(&[]).unwrap();
        let policy = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
        let (train, eval) = builtin_task("arithmetic", 64, 4, 0).unwrap();
        let trainer = Trainer::new(cfg, &policy, train, eval).unwrap();
        // Four groups of 8 distinct completions; group g has g + 1 correct samples. The
        // rollout logprobs are those of a uniform policy, which the random tiny model is close
        // to, so that ratios stay inside the clip range and every completion has a gradient.
        let uniform = -(policy.config.vocab_size as f32).ln();
        let mut groups: Vec<Group> = (0..4u32)
            .map(|g| {
                let samples = (0..8u32)
                    .map(|i| Sample {
                        prompt_ids: vec![20, 21 + g],
                        completion_ids: vec![30 + i, 40 + (i + g) % 7],
                        reward: if i <= g { 1.0 } else { 0.0 },
                        rollout_logprobs: vec![uniform, uniform],
                        policy_version: 0,
                    })
                    .collect();
                Group::new(g as u64, samples)
            })
            .collect();
        compute_advantages(&mut groups, crate::advantages::ScaleRewards::Group);
        let variance = |rate: f64| {
            let level = trainer.cfg.dppo.level(rate);
            trainer.pruning_variance(&groups, 4, &level, 16).unwrap()
        };
        assert_eq!(variance(0.0), 0.0, "no pruning, no scatter");
        let (low, high) = (variance(0.25), variance(0.75));
        assert!(
            low > 0.0 && high > 2.0 * low,
            "r_o 0.25: {low}, r_o 0.75: {high}"
        );
    }

    #[test]
    fn greso_draws_until_the_rollout_batch_is_full() {
        let cfg = RunConfig::default_with(&["algorithm=greso".to_string()]).unwrap();
        let policy = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
        let (train, eval) = builtin_task("arithmetic", 256, 4, 0).unwrap();
        let mut trainer = Trainer::new(cfg, &policy, train, eval).unwrap();
        // Every even prompt was all-correct on its last 16 visits: skipped with probability
        // 0.99 (GRESO's floor keeps 1%).
        for p in trainer.train.iter().filter(|p| p.prompt_id % 2 == 0) {
            trainer.greso.visits.insert(p.prompt_id, vec![1.0; 16]);
        }
        let drawn = trainer.draw_and_prune_prompts();
        let kept = drawn.w_q.iter().filter(|w| w.is_some()).count();
        assert_eq!(kept, 32, "the rollout batch stays full");
        assert!(
            drawn.problems.len() > 50,
            "about half the drawn prompts are skipped"
        );
        assert_eq!(trainer.order.drawn, drawn.problems.len() as u64);
        // With fewer rollable prompts than a batch, one pass over the training set ends it.
        for p in &trainer.train {
            trainer.greso.visits.insert(p.prompt_id, vec![1.0; 16]);
        }
        let drawn = trainer.draw_and_prune_prompts();
        assert_eq!(drawn.problems.len(), 256);
    }

    #[test]
    fn allocation_decides_whether_prompt_pruning_refills_the_batch() {
        let policy = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
        let drawn_and_kept = |allocation: bool| {
            let cfg = RunConfig::default_with(&[
                "dppo.r_q=0.5".to_string(),
                format!("dppo.allocation={allocation}"),
            ])
            .unwrap();
            let (train, eval) = builtin_task("arithmetic", 256, 4, 0).unwrap();
            let mut trainer = Trainer::new(cfg, &policy, train, eval).unwrap();
            // Every prompt seen; the even ones carried no signal: they are the candidates.
            for p in &trainer.train {
                let stats = PromptStats {
                    score: if p.prompt_id % 2 == 0 { 0.0 } else { 1.0 },
                    last_step: 0,
                    visits: 1,
                    zero_var_streak: u64::from(p.prompt_id % 2 == 0),
                };
                trainer.history.entries.insert(p.prompt_id, stats);
            }
            // The first draw measures the candidate fraction that sizes the second.
            trainer.draw_and_prune_prompts();
            let drawn = trainer.draw_and_prune_prompts();
            let kept = drawn.w_q.iter().flatten().count();
            (drawn.problems.len(), kept)
        };
        let (drawn, kept) = drawn_and_kept(true);
        assert!(drawn > 32, "over-drawn: {drawn}");
        assert!(
            (28..=36).contains(&kept),
            "about a full batch rolled out: {kept}"
        );
        let (drawn, kept) = drawn_and_kept(false);
        assert_eq!(drawn, 32);
        assert!(
            (16..32).contains(&kept),
            "pruned prompts are not replaced: {kept}"
        );
    }

    #[test]
    fn an_empty_training_set_is_a_config_error() {
        let cfg = RunConfig::default_with(&[]).unwrap();
        let policy = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
        let (_, eval) = builtin_task("arithmetic", 0, 4, 0).unwrap();
        let err = Trainer::new(cfg, &policy, Vec::new(), eval).err().unwrap();
        assert!(err.to_string().contains("training set is empty"), "{err}");
    }
}
