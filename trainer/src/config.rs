//! The run configuration: TOML in the verl/TRL vocabulary, `--set key=value` overrides,
//! unknown keys rejected, then validated once into a [`RunConfig`] the loop trusts.

use candle_core::{DType, Device};
use dppo_engine::AttentionMode;
use dppo_model::DeviceSpec;
use serde::{Deserialize, Serialize};

use crate::advantages::ScaleRewards;
use crate::loss::{LossAgg, RatioLevel};
use crate::prune::{
    Algorithm, CandidateRule, CompletionScope, LevelConfig, PromptPredictor, PruneMode,
};
use crate::report::metrics_log::Logger;
use dppo_rewards::RewardConfig;

/// The configuration compiled into the binary (`dppo run` with no arguments).
pub const DEFAULT_TOML: &str = include_str!("../../configs/default.toml");

/// A configuration that cannot run, naming the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{origin}: {reason}")]
    Parse { origin: String, reason: String },
    #[error("--set {0:?}: expected key=value with a dotted key such as dppo.r_o=0.5")]
    BadOverride(String),
    #[error("invalid value for {key}: {reason}")]
    Invalid { key: &'static str, reason: String },
}

/// Everything a run needs; field names are the TOML keys.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// `builtin:tiny`, an HF directory, or a `.gguf` file.
    pub model: String,
    pub algorithm: Algorithm,
    pub seed: u64,
    /// RL optimizer steps.
    pub steps: u64,
    /// Rollouts run alone in the engine (served requests wait during them), so a run is
    /// bit-reproducible however much traffic `--serve` gets; `false` lets served requests
    /// share rollout batches (lower serving latency, not bit-reproducible under load).
    #[serde(default = "default_deterministic")]
    pub deterministic: bool,
    /// CPU threads for tensor work (0: one per core, or `RAYON_NUM_THREADS` when set). A
    /// model as small as `builtin:tiny` runs faster on one thread: its tensors are too small
    /// to repay splitting every op across cores.
    #[serde(default)]
    pub threads: usize,
    /// Where the engine and the learner run: `cpu` (default), `cuda` or `cuda:N` (a build
    /// with the `cuda` feature). `dppo run --device` overrides it.
    #[serde(default)]
    pub device: DeviceSpec,
    /// Data-parallel ranks, one per device (`["cpu", "cpu"]`, `["cuda:0", "cuda:1"]`):
    /// `dppo run` starts one process per device, each with a replica of the policy and its
    /// own engine, and shards every step's prompts over them. Empty (default): one process
    /// on `device`. `dppo run --devices` overrides it.
    #[serde(default)]
    pub devices: Vec<DeviceSpec>,
    /// Seconds a rank waits for the others (at the rendezvous and at every collective)
    /// before the run fails naming the rank that stopped answering. A rank that exits is
    /// noticed at once.
    #[serde(default = "default_rank_timeout")]
    pub rank_timeout_s: u64,
    /// `auto`: continue from the newest complete checkpoint in the run directory when there
    /// is one (verl's `resume_mode`), so the same command starts and resumes a run;
    /// `disable` (default): always start from the beginning.
    #[serde(default)]
    pub resume: ResumeMode,
    /// Metrics sinks: `jsonl` (required: the plot and resume read it) and `tensorboard`.
    #[serde(default = "default_logger")]
    pub logger: Vec<Logger>,
    pub data: DataConfig,
    pub warmup: WarmupConfig,
    pub rollout: RolloutConfig,
    pub actor: ActorConfig,
    pub dppo: DppoConfig,
    pub pack: PackConfig,
    #[serde(default)]
    pub engine: EngineSettings,
    pub eval: EvalConfig,
    #[serde(default)]
    pub checkpoint: CheckpointConfig,
    #[serde(default)]
    pub train: TrainConfig,
    /// `[reward]`: extraction mode and overlong penalty (see [`RewardConfig`]).
    #[serde(default)]
    pub reward: RewardConfig,
}

/// `[train]`: what the run does when things go wrong, and how it starts.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Optimizer steps in a row with a NaN or infinite loss or gradient norm (each skipped,
    /// changing nothing) after which the run writes a checkpoint of the last good state and
    /// stops with an error (0: never stop).
    pub max_nonfinite_steps: u64,
    /// Dtype of the learner's forward and backward passes (`auto`: f32 on the CPU, bf16 on
    /// a GPU); master weights and optimizer state stay f32.
    pub compute_dtype: DtypeChoice,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            max_nonfinite_steps: 3,
            compute_dtype: DtypeChoice::Auto,
        }
    }
}

/// A dtype as the configuration names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DtypeChoice {
    /// f32 on the CPU, bf16 on a GPU.
    #[default]
    Auto,
    F32,
    Bf16,
    F16,
}

impl DtypeChoice {
    /// The dtype on `device`.
    pub fn resolve(self, device: &Device) -> DType {
        match self {
            Self::Auto => dppo_engine::engine::default_dtype(device),
            Self::F32 => DType::F32,
            Self::Bf16 => DType::BF16,
            Self::F16 => DType::F16,
        }
    }
}

/// `resume`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResumeMode {
    #[default]
    Disable,
    Auto,
}

/// `[checkpoint]`
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckpointConfig {
    /// Save every this many RL steps (0: only at the end).
    pub every: u64,
    /// Checkpoints kept (the newest).
    pub keep: usize,
}

fn default_logger() -> Vec<Logger> {
    vec![Logger::Jsonl]
}

fn default_deterministic() -> bool {
    true
}

fn default_rank_timeout() -> u64 {
    600
}

impl Default for CheckpointConfig {
    fn default() -> Self {
        Self { every: 50, keep: 2 }
    }
}

/// `[data]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// `builtin:arithmetic` or a JSONL path.
    pub train: String,
    /// Held-out JSONL path; built-in tasks bring their own held-out split.
    #[serde(default)]
    pub eval: Option<String>,
    #[serde(default = "default_question")]
    pub question_field: String,
    #[serde(default = "default_answer")]
    pub answer_field: String,
    /// Sizes of a built-in task's splits; `num_eval` also caps a held-out file.
    #[serde(default = "default_num_train")]
    pub num_train: usize,
    #[serde(default = "default_num_eval")]
    pub num_eval: usize,
}

/// `[warmup]`: supervised steps on demonstrations before RL (0 to skip).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WarmupConfig {
    pub steps: u64,
    /// Demonstrations: the warm-up trains on the first `examples` training problems only
    /// (all of them when 0 or when there are fewer); RL draws from the whole training set,
    /// the usual SFT-then-RL split of a few demonstrations and many prompts.
    #[serde(default)]
    pub examples: usize,
    pub batch_size: usize,
    pub lr: f64,
}

/// `[rollout]`
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RolloutConfig {
    /// Samples per prompt (G).
    pub n: usize,
    pub prompts_per_step: usize,
    pub temperature: f32,
    pub top_p: f32,
    pub max_response_len: usize,
    /// Generate step `t + 1`'s rollouts while step `t` trains (verl's one-step off-policy):
    /// generation hides behind training, and each step trains on samples of the policy one
    /// update old (the clipped ratio against the engine's logprobs corrects for it).
    #[serde(default)]
    pub one_step_off_policy: bool,
}

/// `[actor]`
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActorConfig {
    pub lr: f64,
    pub grad_clip: f64,
    pub eps_low: f64,
    pub eps_high: f64,
    pub beta: f64,
    pub loss_agg: LossAgg,
    pub scale_rewards: ScaleRewards,
    pub ratio_level: RatioLevel,
    pub warmup_steps: u64,
    pub weight_decay: f64,
}

/// `[dppo]`: pruning rates (also the CPPO rate `r_o`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DppoConfig {
    pub r_q: f64,
    pub r_o: f64,
    pub scope: CompletionScope,
    pub history_decay: f64,
    /// DPPO over-draws prompts by `1/(1 - r_q * f)` so that the rollout batch stays full
    /// (docs/algorithm.md §2's "allocation"; default). `false`: draw `prompts_per_step`, so that
    /// prompt pruning saves their rollouts and the step estimates GRPO on those prompts.
    #[serde(default = "default_allocation")]
    pub allocation: bool,
    /// Which items of a scope (a group, the batch, or the step's seen prompts) may be
    /// dropped, at both levels: `below_mean` (default) or `lowest_fraction`.
    #[serde(default)]
    pub candidates: Candidates,
    /// The fraction of a scope, lowest scores first, that `lowest_fraction` makes candidates.
    #[serde(default = "default_candidate_frac")]
    pub candidate_frac: f64,
    /// How candidates are dropped: `fixed_count` (default; exactly unbiased, fixed count),
    /// `poisson` (unbiased, random count) or `deterministic` (biased ablation, weight 1).
    #[serde(default)]
    pub mode: PruneMode,
    /// How prompt histories score prompts: `signal_ema` (default; the EMA of |A|, candidates
    /// by `candidates`) or `difficulty` (the chance of signal now, given the prompt's
    /// difficulty and the policy's progress since its visit; candidates below half the mean).
    #[serde(default)]
    pub prompt_predictor: PromptPredictor,
}

/// `dppo.candidates` (docs/algorithm.md §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Candidates {
    #[default]
    BelowMean,
    LowestFraction,
}

impl DppoConfig {
    /// The pruning design at `rate` (`r_q` or `r_o`): both levels share candidates and mode.
    pub fn level(&self, rate: f64) -> LevelConfig {
        let candidates = match self.candidates {
            Candidates::BelowMean => CandidateRule::BelowMean,
            Candidates::LowestFraction => CandidateRule::LowestFraction {
                fraction: self.candidate_frac,
            },
        };
        LevelConfig {
            rate,
            candidates,
            mode: self.mode,
        }
    }
}

/// `[pack]`
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PackConfig {
    /// Tokens per packed buffer (`pack_tokens`).
    pub tokens: usize,
    /// Sequences per first-fit-decreasing window (`pack_window`).
    pub window: usize,
}

/// `[engine]`: the generation engine on a GPU.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineSettings {
    /// The fraction of the GPU's memory the process may use, as vLLM's; the KV cache gets
    /// what weights, learner state and activations leave of it (`dppo memory` shows the split).
    /// Default 0.5, the engine being co-located with the learner (`dppo serve` uses 0.9).
    pub gpu_memory_utilization: f64,
    /// The attention backend: `auto` (the CPU kernel for f32 on the CPU, the device-generic
    /// path elsewhere), `cpu` or `generic`.
    pub attention: AttentionMode,
    /// Dtype of the engine's weights and KV cache (`auto`: f32 on the CPU, bf16 on a GPU).
    pub dtype: DtypeChoice,
}

impl Default for EngineSettings {
    fn default() -> Self {
        Self {
            gpu_memory_utilization: 0.5,
            attention: AttentionMode::Auto,
            dtype: DtypeChoice::Auto,
        }
    }
}

/// `[eval]`
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EvalConfig {
    /// Held-out evaluation every this many steps (0: only before and after).
    pub every: u64,
    /// At those steps, also measure how far completion-pruned gradients scatter around the
    /// unpruned one: this many pruning draws (0: off). Outside `timing_s/step`.
    #[serde(default)]
    pub grad_variance_draws: usize,
}

impl EvalConfig {
    /// Whether the periodic evaluation runs once `step` steps are done.
    pub fn due(&self, step: u64) -> bool {
        self.every > 0 && step.is_multiple_of(self.every)
    }
}

fn default_allocation() -> bool {
    true
}
fn default_candidate_frac() -> f64 {
    0.5
}
fn default_question() -> String {
    "question".into()
}
fn default_answer() -> String {
    "answer".into()
}
fn default_num_train() -> usize {
    2000
}
fn default_num_eval() -> usize {
    200
}

impl RunConfig {
    /// Parses `text` (from `origin`), applies `overrides` (`a.b=value`, values in TOML
    /// syntax, bare words taken as strings) and validates.
    pub fn from_toml(text: &str, origin: &str, overrides: &[String]) -> Result<Self, ConfigError> {
        let parse_err = |reason: String| ConfigError::Parse {
            origin: origin.to_string(),
            reason,
        };
        let mut doc: toml::Table = toml::from_str(text).map_err(|e| parse_err(e.to_string()))?;
        for o in overrides {
            apply_override(&mut doc, o)?;
        }
        let cfg: RunConfig = toml::Value::Table(doc)
            .try_into()
            .map_err(|e: toml::de::Error| parse_err(e.to_string()))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The built-in default with `overrides`.
    pub fn default_with(overrides: &[String]) -> Result<Self, ConfigError> {
        Self::from_toml(DEFAULT_TOML, "configs/default.toml (built in)", overrides)
    }

    /// The effective configuration as TOML (written to the run directory).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# cannot serialise: {e}"))
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let check = |ok: bool, key: &'static str, reason: String| {
            if ok {
                Ok(())
            } else {
                Err(ConfigError::Invalid { key, reason })
            }
        };
        let rate = |r: f64| (0.0..1.0).contains(&r);
        check(
            self.logger.contains(&Logger::Jsonl),
            "logger",
            format!(
                "must include \"jsonl\" (the plot, dppo compare and resume read metrics.jsonl), got {:?}",
                self.logger
            ),
        )?;
        check(
            self.rank_timeout_s > 0,
            "rank_timeout_s",
            "must be positive".into(),
        )?;
        let gpus: Vec<_> = self
            .devices
            .iter()
            .filter(|d| **d != DeviceSpec::Cpu)
            .collect();
        check(
            gpus.is_empty() || gpus.len() == self.devices.len(),
            "devices",
            "mixes cpu and cuda ranks: every rank must be a GPU (NCCL) or every rank the CPU"
                .into(),
        )?;
        check(
            (1..gpus.len()).all(|i| !gpus[..i].contains(&gpus[i])),
            "devices",
            format!(
                "lists a GPU twice ({}): one rank per GPU (CPU ranks may repeat `cpu`)",
                self.devices
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )?;
        check(
            rate(self.dppo.r_q),
            "dppo.r_q",
            format!("must be in [0, 1), got {}", self.dppo.r_q),
        )?;
        check(
            rate(self.dppo.r_o),
            "dppo.r_o",
            format!("must be in [0, 1), got {}", self.dppo.r_o),
        )?;
        check(
            self.rollout.n >= 2,
            "rollout.n",
            format!("group advantages need n >= 2, got {}", self.rollout.n),
        )?;
        check(
            self.rollout.prompts_per_step > 0,
            "rollout.prompts_per_step",
            "must be positive".into(),
        )?;
        check(
            self.rollout.max_response_len > 0,
            "rollout.max_response_len",
            "must be positive".into(),
        )?;
        check(
            self.rollout.temperature > 0.0 && self.rollout.temperature.is_finite(),
            "rollout.temperature",
            format!(
                "must be positive for RL sampling, got {}",
                self.rollout.temperature
            ),
        )?;
        check(
            self.rollout.top_p > 0.0 && self.rollout.top_p <= 1.0,
            "rollout.top_p",
            format!("must be in (0, 1], got {}", self.rollout.top_p),
        )?;
        check(
            self.actor.lr > 0.0 && self.actor.lr.is_finite(),
            "actor.lr",
            format!("must be positive and finite, got {}", self.actor.lr),
        )?;
        check(
            self.warmup.lr > 0.0 && self.warmup.lr.is_finite(),
            "warmup.lr",
            format!("must be positive and finite, got {}", self.warmup.lr),
        )?;
        check(
            (0.0..1.0).contains(&(self.actor.lr * self.actor.weight_decay))
                && (0.0..1.0).contains(&(self.warmup.lr * self.actor.weight_decay)),
            "actor.weight_decay",
            format!(
                "must be >= 0 with lr * weight_decay < 1, got {}",
                self.actor.weight_decay
            ),
        )?;
        check(
            self.actor.grad_clip >= 0.0,
            "actor.grad_clip",
            format!("must be >= 0 (0: off), got {}", self.actor.grad_clip),
        )?;
        check(
            self.actor.eps_low >= 0.0 && self.actor.eps_low < 1.0,
            "actor.eps_low",
            format!("must be in [0, 1), got {}", self.actor.eps_low),
        )?;
        check(
            self.actor.eps_high >= 0.0,
            "actor.eps_high",
            format!("must be >= 0, got {}", self.actor.eps_high),
        )?;
        check(
            self.actor.beta >= 0.0,
            "actor.beta",
            format!("must be >= 0, got {}", self.actor.beta),
        )?;
        check(
            self.pack.window > 0,
            "pack.window",
            "must be positive".into(),
        )?;
        check(
            self.dppo.candidate_frac > 0.0 && self.dppo.candidate_frac <= 1.0,
            "dppo.candidate_frac",
            format!("must be in (0, 1], got {}", self.dppo.candidate_frac),
        )?;
        check(
            self.dppo.history_decay >= 0.0 && self.dppo.history_decay < 1.0,
            "dppo.history_decay",
            format!("must be in [0, 1), got {}", self.dppo.history_decay),
        )?;
        check(
            self.reward.overlong_buffer < self.rollout.max_response_len,
            "reward.overlong_buffer",
            format!(
                "must be less than rollout.max_response_len ({}), got {}",
                self.rollout.max_response_len, self.reward.overlong_buffer
            ),
        )?;
        check(
            self.reward.overlong_penalty >= 0.0 && self.reward.overlong_penalty.is_finite(),
            "reward.overlong_penalty",
            format!(
                "must be finite and >= 0, got {}",
                self.reward.overlong_penalty
            ),
        )?;
        let u = self.engine.gpu_memory_utilization;
        check(
            u > 0.0 && u <= 1.0,
            "engine.gpu_memory_utilization",
            format!("must be in (0, 1], got {u}"),
        )?;
        check(
            self.train.compute_dtype != DtypeChoice::F16,
            "train.compute_dtype",
            "f16 is not supported (its range overflows in the backward pass): use f32 or bf16"
                .into(),
        )?;
        Ok(())
    }
}

/// Sets `a.b.c = value` in `doc`; the value is parsed as TOML, or taken as a string.
fn apply_override(doc: &mut toml::Table, spec: &str) -> Result<(), ConfigError> {
    let bad = || ConfigError::BadOverride(spec.to_string());
    let (key, raw) = spec.split_once('=').ok_or_else(bad)?;
    let path: Vec<&str> = key.trim().split('.').collect();
    if path.iter().any(|p| p.is_empty()) {
        return Err(bad());
    }
    let value = toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.trim().to_string()));
    let (last, parents) = path.split_last().ok_or_else(bad)?;
    let mut table = doc;
    for p in parents {
        table = table
            .entry(p.to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            .as_table_mut()
            .ok_or_else(bad)?;
    }
    table.insert(last.to_string(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_built_in_default_parses_and_round_trips() {
        let cfg = RunConfig::default_with(&[]).unwrap();
        assert_eq!(cfg.model, "builtin:tiny");
        let again = RunConfig::from_toml(&cfg.to_toml(), "effective", &[]).unwrap();
        assert_eq!(again, cfg);
    }

    #[test]
    fn overrides_apply() {
        let sets = [
            "dppo.r_o=0.7".to_string(),
            "algorithm=grpo".into(),
            "model=builtin:tiny".into(),
        ];
        let cfg = RunConfig::default_with(&sets).unwrap();
        assert_eq!((cfg.dppo.r_o, cfg.algorithm), (0.7, Algorithm::Grpo));
        let cfg = RunConfig::default_with(&["threads=0".to_string()]).unwrap();
        assert_eq!(cfg.threads, 0);
    }

    #[test]
    fn the_pruning_design_keys_reach_both_levels() {
        let cfg = RunConfig::default_with(&[]).unwrap();
        let level = cfg.dppo.level(0.3);
        assert_eq!(
            (level.rate, level.candidates, level.mode),
            (0.3, CandidateRule::BelowMean, PruneMode::FixedCount),
            "the default is docs/algorithm.md's exactly unbiased design"
        );
        let sets = [
            "dppo.candidates=lowest_fraction".to_string(),
            "dppo.candidate_frac=0.25".into(),
            "dppo.mode=poisson".into(),
        ];
        let cfg = RunConfig::default_with(&sets).unwrap();
        for rate in [cfg.dppo.r_q, cfg.dppo.r_o] {
            let level = cfg.dppo.level(rate);
            assert_eq!(
                (level.rate, level.candidates, level.mode),
                (
                    rate,
                    CandidateRule::LowestFraction { fraction: 0.25 },
                    PruneMode::Poisson
                )
            );
        }
        let cfg = RunConfig::default_with(&["dppo.mode=deterministic".to_string()]).unwrap();
        assert_eq!(cfg.dppo.level(0.5).mode, PruneMode::Deterministic);
    }

    #[test]
    fn bad_configs_name_the_key() {
        let cases = [
            ("threads=-1", "threads"),
            ("dppo.r_o=1", "dppo.r_o: must be in [0, 1), got 1"),
            ("dppo.r_0=0.5", "unknown field `r_0`"),
            ("rollout.n=\"eight\"", "rollout.n"),
            ("actor.loss_agg=\"mean\"", "unknown variant `mean`"),
            ("rollout.n=1", "rollout.n"),
            ("bogus", "expected key=value"),
            (
                "dppo.candidate_frac=0",
                "dppo.candidate_frac: must be in (0, 1], got 0",
            ),
            ("dppo.mode=\"random\"", "unknown variant `random`"),
            ("dppo.candidates=\"lowest\"", "unknown variant `lowest`"),
            ("logger=[\"tensorboard\"]", "logger: must include \"jsonl\""),
            ("logger=[\"wandb\"]", "unknown variant `wandb`"),
            ("actor.lr=inf", "actor.lr: must be positive and finite"),
            ("warmup.lr=nan", "warmup.lr: must be positive and finite"),
            ("actor.weight_decay=nan", "actor.weight_decay"),
            ("actor.grad_clip=nan", "actor.grad_clip"),
            ("resume=\"always\"", "unknown variant `always`"),
            (
                "reward.overlong_buffer=8",
                "reward.overlong_buffer: must be less than rollout.max_response_len (8), got 8",
            ),
            (
                "reward.overlong_penalty=-1",
                "reward.overlong_penalty: must be finite and >= 0, got -1",
            ),
            ("reward.extract=\"lenient\"", "unknown variant `lenient`"),
            ("reward.overlong=1", "unknown field `overlong`"),
            ("device=\"gpu\"", "expected cpu, cuda or cuda:N"),
            (
                "engine.gpu_memory_utilization=1.5",
                "engine.gpu_memory_utilization: must be in (0, 1], got 1.5",
            ),
        ];
        for (set, want) in cases {
            let err = RunConfig::default_with(&[set.to_string()])
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "--set {set}: {err}");
        }
        let err = RunConfig::from_toml("model = ", "my.toml", &[])
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("my.toml:"), "{err}");
    }
}
