//! A whole training run in its run directory: warm-up (or a checkpoint's state), held-out
//! evaluation before and after, the RL loop with its metrics, checkpoints and stops, then
//! the plot and the summary. Front ends drive it through [`RunHooks`].

mod start;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use dppo_engine::Engine;
use dppo_model::weights::write_atomic;
use dppo_model::Policy;
use serde_json::{json, Map, Value};

use crate::checkpoint::MODEL_DIR;
use crate::config::RunConfig;
use crate::data::run_problems;
use crate::dist::Collective;
use crate::prune::Algorithm;
use crate::report::metrics_log::{MetricsLog, METRICS_JSONL};
use crate::step::Trainer;
use crate::TrainError;

pub use start::{load_policy, Resume, Start, CHECKPOINTS};

/// The effective configuration, in the run directory.
pub const CONFIG_TOML: &str = "config.toml";
/// The run's outcome ([`RunSummary`]), in the run directory.
pub const SUMMARY_JSON: &str = "summary.json";
/// The charts of `metrics.jsonl`, in the run directory.
pub const METRICS_SVG: &str = "metrics.svg";

/// What a run reports as it goes, and whether it should stop early. Every method does
/// nothing by default.
pub trait RunHooks {
    /// Whether this rank asks the run to stop after the current step (Ctrl-C); every rank
    /// stops at the same step, the RL loop with a checkpoint.
    fn interrupted(&self) -> bool {
        false
    }
    /// The supervised warm-up starts: `steps` steps.
    fn on_warmup_start(&mut self, _steps: u64) {}
    /// A warm-up step ended with this NLL.
    fn on_warmup_step(&mut self, _nll: f64) {}
    /// The warm-up ended (done or interrupted).
    fn on_warmup_end(&mut self) {}
    /// The RL loop starts at step `done` of `steps`.
    fn on_rl_start(&mut self, _steps: u64, _done: u64) {}
    /// RL step `step` ended with this metrics line.
    fn on_step(&mut self, _step: u64, _line: &Map<String, Value>) {}
    /// An interruption stops the RL loop after step `step`.
    fn on_interrupted(&mut self, _step: u64) {}
    /// The RL loop ended.
    fn on_rl_end(&mut self) {}
}

/// Hooks that report nothing and never interrupt.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoHooks;

impl RunHooks for NoHooks {}

/// The outcome of a run (`summary.json`).
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    /// The algorithm trained with.
    pub algorithm: Algorithm,
    /// RL steps done.
    pub steps: u64,
    /// Held-out accuracy before RL (after the warm-up).
    pub eval_before: f64,
    /// Held-out accuracy after the last step.
    pub eval_after: f64,
    /// Seconds from building the trainer to the end.
    pub wall_s: f64,
    /// Weight publications so far (warm-up and RL steps).
    pub policy_version: u64,
    /// Data-parallel ranks.
    pub ranks: usize,
}

impl RunSummary {
    /// The summary as `summary.json` holds it.
    pub fn to_json(&self) -> Value {
        json!({
            "algorithm": self.algorithm,
            "steps": self.steps,
            "eval_before": self.eval_before,
            "eval_after": self.eval_after,
            "wall_s": self.wall_s,
            "policy_version": self.policy_version,
            "ranks": self.ranks,
        })
    }
}

/// One rank's run: rank 0 writes the run directory; every rank trains its share.
pub struct Run {
    cfg: RunConfig,
    out: PathBuf,
    checkpoint: Option<PathBuf>,
    /// What the policy was loaded from: the config's `model`, or the checkpoint's.
    model: String,
    policy: Policy,
    trainer: Trainer,
    rank: usize,
    world: usize,
    /// When the trainer was built (the summary's `wall_s`).
    started: Instant,
}

impl Run {
    /// Builds this rank's run in the run directory `out` over `collective`: checks that the
    /// ranks agree, opens the device, writes `config.toml` (rank 0), loads the policy (from
    /// the checkpoint when resuming; at hub `revision`) and the data, and builds the trainer.
    pub fn new(
        start: Start,
        out: &Path,
        revision: Option<&str>,
        collective: Arc<dyn Collective>,
    ) -> Result<Self, TrainError> {
        let (rank, world) = (collective.rank(), collective.world_size());
        if world > 1 {
            start::agree(collective.as_ref(), &start.cfg, start.checkpoint.as_deref())?;
        }
        // Before anything is written or loaded: a device that cannot open fails the run at once.
        let device = start.cfg.device.open()?;
        let collective = start::device_collective(collective, &device)?;
        if rank == 0 {
            start.log(out);
        }
        let Start {
            cfg, checkpoint, ..
        } = start;
        let model = match &checkpoint {
            Some(ckpt) => ckpt.join(MODEL_DIR).display().to_string(),
            None => cfg.model.clone(),
        };
        let policy = load_policy(&model, revision, &device)?;
        let (train, eval) = run_problems(&cfg.data, cfg.seed, !cfg.reward.is_external())?;
        // Written once the model and the data have loaded, so that a run failing on them
        // leaves no run directory behind.
        if rank == 0 {
            std::fs::create_dir_all(out).map_err(|error| TrainError::RunDir {
                action: "creating the run directory",
                path: out.display().to_string(),
                error,
            })?;
            write_atomic(&out.join(CONFIG_TOML), cfg.to_toml().as_bytes())?;
        }
        let started = Instant::now();
        let trainer =
            Trainer::with_collective(cfg.clone(), &policy, &device, train, eval, collective)?;
        Ok(Self {
            cfg,
            out: out.to_path_buf(),
            checkpoint,
            model,
            policy,
            trainer,
            rank,
            world,
            started,
        })
    }

    /// The run's configuration.
    pub fn config(&self) -> &RunConfig {
        &self.cfg
    }

    /// The engine, to serve the policy being trained from (`dppo run --serve`).
    pub fn engine(&self) -> Arc<Engine> {
        self.trainer.engine()
    }

    /// The policy as loaded (its tokenizer and end tokens serve requests).
    pub fn policy(&self) -> &Policy {
        &self.policy
    }

    /// What the policy was loaded from: the config's `model`, or the resumed checkpoint's.
    pub fn model(&self) -> &str {
        &self.model
    }

    /// Whether this is rank 0: the rank that writes the run directory (and serves).
    pub fn is_lead(&self) -> bool {
        self.rank == 0
    }

    /// Runs to `steps` (or an interruption): restores the checkpoint or warms up, evaluates,
    /// trains with metrics, periodic evaluations and checkpoints, evaluates again, and
    /// (rank 0) writes `metrics.svg` and `summary.json`. Too many non-finite steps in a row
    /// stop the run with an error, after a checkpoint of the last good state.
    pub fn run_to_end(&mut self, hooks: &mut dyn RunHooks) -> Result<RunSummary, TrainError> {
        let eval_before = self.eval_before(hooks)?;
        let measure = self.cfg.reward.held_out_measure();
        tracing::info!(eval_before, "{measure} before RL");
        self.rl_loop(eval_before, hooks)?;
        let eval_after = self.trainer.evaluate()?;
        if self.is_lead() {
            let lines = self.metrics_lines()?;
            write_atomic(
                &self.out.join(METRICS_SVG),
                crate::report::plot::render(&lines).as_bytes(),
            )?;
        }
        let summary = RunSummary {
            algorithm: self.cfg.algorithm,
            steps: self.trainer.step,
            eval_before,
            eval_after,
            wall_s: self.started.elapsed().as_secs_f64(),
            policy_version: self.trainer.policy_version(),
            ranks: self.world,
        };
        if self.is_lead() {
            let text = serde_json::to_string_pretty(&summary.to_json())
                .expect("a JSON value always serialises");
            write_atomic(&self.out.join(SUMMARY_JSON), text.as_bytes())?;
        }
        Ok(summary)
    }

    /// The held-out accuracy before RL: the checkpoint's (evaluated again when it has none),
    /// or that after the warm-up.
    fn eval_before(&mut self, hooks: &mut dyn RunHooks) -> Result<f64, TrainError> {
        match &self.checkpoint {
            Some(ckpt) => match self.trainer.restore(ckpt)?.eval_before {
                Some(acc) => Ok(acc),
                None => self.trainer.evaluate(),
            },
            None => {
                self.warm_up(hooks)?;
                self.trainer.finish_warmup()?;
                self.trainer.evaluate()
            }
        }
    }

    /// Supervised warm-up on demonstrations (cut short by an interruption).
    fn warm_up(&mut self, hooks: &mut dyn RunHooks) -> Result<(), TrainError> {
        hooks.on_warmup_start(self.cfg.warmup.steps);
        for _ in 0..self.cfg.warmup.steps {
            if self.trainer.any_rank(hooks.interrupted())? {
                break;
            }
            let nll = self.trainer.warmup_step()?;
            if let Some(e) = self.trainer.nonfinite_limit() {
                return Err(self.stop_after_checkpoint(None, e));
            }
            hooks.on_warmup_step(nll);
        }
        hooks.on_warmup_end();
        Ok(())
    }

    /// RL steps up to `steps`, each written to the metrics, with evaluations and
    /// checkpoints when due; an interruption ends the loop with a checkpoint.
    fn rl_loop(&mut self, eval_before: f64, hooks: &mut dyn RunHooks) -> Result<(), TrainError> {
        let resumed_at = self.checkpoint.as_ref().map(|_| self.trainer.step);
        let mut metrics = match self.is_lead() {
            true => Some(MetricsLog::open(&self.out, &self.cfg.logger, resumed_at)?),
            false => None,
        };
        hooks.on_rl_start(self.cfg.steps, self.trainer.step);
        while self.trainer.step < self.cfg.steps {
            if self.trainer.any_rank(hooks.interrupted())? {
                hooks.on_interrupted(self.trainer.step);
                self.save_checkpoint(eval_before)?;
                break;
            }
            let mut line = match self.trainer.step() {
                Ok(line) => line,
                Err(e) => return Err(self.stop_on_reward_failure(eval_before, e)),
            };
            if self.cfg.eval.due(self.trainer.step) {
                let (score, by_source) = match self.trainer.evaluate_by_source() {
                    Ok(scores) => scores,
                    Err(e) => return Err(self.stop_on_reward_failure(eval_before, e)),
                };
                line.insert("eval/acc".into(), json!(score));
                for (source, score) in by_source {
                    line.insert(format!("eval/{source}/acc"), json!(score));
                }
            }
            if let Some(metrics) = &mut metrics {
                metrics.write(&line)?;
            }
            if let Some(e) = self.trainer.nonfinite_limit() {
                return Err(self.stop_after_checkpoint(Some(eval_before), e));
            }
            hooks.on_step(self.trainer.step, &line);
            let every = self.cfg.checkpoint.every;
            let step = self.trainer.step;
            if (every > 0 && step.is_multiple_of(every)) || step == self.cfg.steps {
                self.save_checkpoint(eval_before)?;
            }
        }
        hooks.on_rl_end();
        Ok(())
    }

    /// Checkpoints the current step, naming it in the error.
    fn save_checkpoint(&mut self, eval_before: f64) -> Result<(), TrainError> {
        let (root, keep) = (self.out.join(CHECKPOINTS), self.cfg.checkpoint.keep);
        match self.trainer.save_checkpoint(&root, keep, Some(eval_before)) {
            Ok(_) => Ok(()),
            Err(error) => Err(TrainError::Checkpointing {
                step: self.trainer.step,
                error: Box::new(error),
            }),
        }
    }

    /// `error`, after a checkpoint of the last good state when an external reward failed
    /// (its process exited, or an answer was unusable with `on_error = "fail"`): the step
    /// it was scoring is not taken, and `--resume latest` continues from there. On several
    /// ranks the others are not at a checkpoint, so the error ends the run as it is.
    fn stop_on_reward_failure(&mut self, eval_before: f64, error: TrainError) -> TrainError {
        match error {
            TrainError::RewardBackend(_) if self.world == 1 => {
                self.stop_after_checkpoint(Some(eval_before), error)
            }
            error => error,
        }
    }

    /// The error that ends the run once the last good weights and optimizer are
    /// checkpointed: after too many non-finite steps in a row (the skipped steps changed
    /// nothing), or a failed reward.
    fn stop_after_checkpoint(&mut self, eval_before: Option<f64>, error: TrainError) -> TrainError {
        let (root, keep) = (self.out.join(CHECKPOINTS), self.cfg.checkpoint.keep);
        match self.trainer.save_checkpoint(&root, keep, eval_before) {
            Ok(dir) => TrainError::Stopped {
                dir: dir.display().to_string(),
                error: Box::new(error),
            },
            Err(e) => e,
        }
    }

    /// Every line of `metrics.jsonl` (those of earlier sessions of a resumed run too).
    fn metrics_lines(&self) -> Result<Vec<Value>, TrainError> {
        let path = self.out.join(METRICS_JSONL);
        let text = std::fs::read_to_string(&path).map_err(|error| TrainError::RunDir {
            action: "reading",
            path: path.display().to_string(),
            error,
        })?;
        Ok(text
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect())
    }
}
