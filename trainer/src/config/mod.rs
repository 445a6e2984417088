//! The run configuration: TOML in the verl/TRL vocabulary, `--set key=value` overrides,
//! checked once against the key table ([`keys::KEYS`]) into a [`RunConfig`]
//! the loop trusts.

use candle_core::{DType, Device};
use dppo_engine::{AttentionMode, SamplingPlace};

use crate::correction::RolloutCorrection;
use dppo_model::DeviceSpec;
use serde::{Deserialize, Serialize};

use crate::advantages::ScaleRewards;
mod check;
pub mod keys;
pub mod reward;

use crate::loss::{LossAgg, LossConfig, RatioLevel};
use crate::prune::{
    Algorithm, CandidateRule, CompletionScope, LevelConfig, PromptPredictor, PruneMode,
};
use crate::report::metrics_log::Logger;
use check::{check_keys, check_rules, Origins};
use reward::RewardSettings;

/// The configuration compiled into the binary (`dppo run` with no arguments).
pub const DEFAULT_TOML: &str = include_str!("../../../configs/default.toml");

/// A configuration that cannot run, naming where the fault came from: the file (at the
/// key's line) or the `--set` that wrote it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The config file cannot be read.
    #[error("reading config {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    /// Not TOML, or a required key is missing.
    #[error("{origin}: {reason}")]
    Parse { origin: String, reason: String },
    /// An override that is not `key=value`.
    #[error("--set {0:?}: expected key=value with a dotted key such as dppo.r_o=0.5")]
    BadOverride(String),
    /// A key the table does not have.
    #[error("{origin}: unknown key {key} (known here: {known}; `dppo config` lists every key)")]
    UnknownKey {
        origin: String,
        key: String,
        known: String,
    },
    /// A value outside the key's allowed values.
    #[error("{origin}: invalid value for {key}: got {value}, allowed: {allowed}")]
    Invalid {
        origin: String,
        key: &'static str,
        value: String,
        allowed: String,
    },
    /// A value that breaks a rule relating it to other keys.
    #[error("{origin}: invalid value for {key}: {reason}")]
    Rule {
        origin: String,
        key: &'static str,
        reason: String,
    },
}

/// Everything a run needs; field names are the TOML keys, whose docs and allowed values are
/// in [`keys::KEYS`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunConfig {
    /// The policy: a built-in preset, a random-weight model of a real shape
    /// (`random:qwen2.5-0.5b`), an HF directory, a `.gguf` file, a checkpoint or a Hugging
    /// Face id.
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
    /// `[reward]`: the verifier's extraction mode, the overlong penalty and an external
    /// reward (see [`RewardSettings`]).
    #[serde(default)]
    pub reward: RewardSettings,
    /// Importance weights and masks for the learner-rollout mismatch (verl's names).
    #[serde(default)]
    pub rollout_correction: RolloutCorrection,
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
    /// Checkpoints kept, newest first (at least one).
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

/// `data.train`: a built-in task or one file, or several files to mix.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TrainFiles {
    One(String),
    Many(Vec<String>),
}

impl TrainFiles {
    /// Every file (or the built-in task), in order.
    pub fn paths(&self) -> Vec<&str> {
        match self {
            Self::One(path) => vec![path],
            Self::Many(paths) => paths.iter().map(String::as_str).collect(),
        }
    }

    /// The first file, or the built-in task (what sets the default extraction mode).
    pub fn first(&self) -> &str {
        self.paths().first().copied().unwrap_or("")
    }
}

impl std::fmt::Display for TrainFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.paths().join(", "))
    }
}

/// `[data]`
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataConfig {
    /// `builtin:arithmetic`, or one or several JSONL/parquet files.
    pub train: TrainFiles,
    /// One weight per `train` file: each draw picks a file with probability proportional
    /// to its weight (unset: the files are one set, every problem equally likely).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub train_weights: Option<Vec<f64>>,
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
    /// A system message put before every prompt that has none (chat template applied once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    /// Prompts longer than this many tokens (chat template applied) are left out, counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_prompt_length: Option<usize>,
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
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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
    /// Each step's rollout is written here as `step-NNNNNN.jsonl` (unset: not written).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dump_dir: Option<String>,
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
    /// The ratio's denominator is the learner's logprobs before the update (verl's
    /// decoupled PPO) instead of the rollout's, which then only weigh the correction.
    #[serde(default)]
    pub recompute_old_logprobs: bool,
}

/// `[dppo]`: pruning rates (also the CPPO rate `r_o`).
///
/// Unknown keys are left to the key table, which rejects them before serde runs: serde
/// cannot deny unknown fields of a struct with a flattened field.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
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
    /// dropped, at both levels: the keys `candidates` and `candidate_frac`.
    #[serde(flatten, with = "candidate_keys")]
    pub candidates: CandidateRule,
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

impl DppoConfig {
    /// The pruning design at `rate` (`r_q` or `r_o`): both levels share candidates and mode.
    pub fn level(&self, rate: f64) -> LevelConfig {
        LevelConfig {
            rate,
            candidates: self.candidates,
            mode: self.mode,
        }
    }
}

/// `dppo.candidates` (`below_mean` when absent) and `dppo.candidate_frac` (0.5 when absent,
/// written only with `lowest_fraction`) as a [`CandidateRule`] (docs/algorithm.md §2).
mod candidate_keys {
    use serde::de::Error as _;
    use serde::ser::Error as _;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use crate::prune::CandidateRule;

    const RULES: &[&str] = &["below_mean", "lowest_fraction"];

    #[derive(Serialize, Deserialize)]
    struct Keys {
        candidates: Option<String>,
        #[serde(skip_serializing_if = "Option::is_none")]
        candidate_frac: Option<f64>,
    }

    pub fn serialize<S: Serializer>(rule: &CandidateRule, s: S) -> Result<S::Ok, S::Error> {
        let (name, fraction) = match *rule {
            CandidateRule::BelowMean => (RULES[0], None),
            CandidateRule::LowestFraction { fraction } => (RULES[1], Some(fraction)),
            CandidateRule::BelowMeanFraction { .. } => {
                return Err(S::Error::custom(
                    "below_mean_fraction is no dppo.candidates",
                ))
            }
        };
        Keys {
            candidates: Some(name.to_string()),
            candidate_frac: fraction,
        }
        .serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<CandidateRule, D::Error> {
        let keys = Keys::deserialize(d)?;
        match keys.candidates.as_deref().unwrap_or(RULES[0]) {
            "below_mean" => Ok(CandidateRule::BelowMean),
            "lowest_fraction" => Ok(CandidateRule::LowestFraction {
                fraction: keys.candidate_frac.unwrap_or(0.5),
            }),
            other => Err(D::Error::unknown_variant(other, RULES)),
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
    /// path elsewhere), `cpu`, `generic` or `cuda` (the paged CUDA kernels).
    pub attention: AttentionMode,
    /// Dtype of the engine's weights and KV cache (`auto`: f32 on the CPU, bf16 on a GPU).
    pub dtype: DtypeChoice,
    /// Where tokens are drawn: `host`, or `device` (a GPU kernel where the sampling options
    /// allow; on the CPU its host reference).
    pub sampling: SamplingPlace,
    /// candle-nn's fused kernels for RMSNorm, rotary embedding, SiLU and the attention
    /// softmax in the engine (off until checked on a GPU).
    pub fused_kernels: bool,
}

impl Default for EngineSettings {
    fn default() -> Self {
        Self {
            gpu_memory_utilization: 0.5,
            attention: AttentionMode::Auto,
            dtype: DtypeChoice::Auto,
            sampling: SamplingPlace::Host,
            fused_kernels: false,
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
    /// The learner's objective: `[actor]`'s, over logprobs of the distribution the rollout
    /// sampled from (its temperature and top-p).
    pub fn loss(&self) -> LossConfig {
        LossConfig {
            temperature: f64::from(self.rollout.temperature),
            top_p: f64::from(self.rollout.top_p),
            correction: self.rollout_correction,
            ..self.actor.loss()
        }
    }

    /// Why this run's gradient estimate is only approximately unbiased, when it is: DPPO
    /// with prompt pruning under `token-mean`, whose token count is itself estimated from
    /// the rolled-out prompts (a ratio estimator, bias O(1/B)). `None` for the exact designs.
    pub fn bias_note(&self) -> Option<String> {
        let prompt_pruning = self.algorithm == Algorithm::Dppo && self.dppo.r_q > 0.0;
        (prompt_pruning && self.actor.loss_agg == LossAgg::TokenMean).then(|| {
            format!(
                "actor.loss_agg = \"token-mean\" with prompt pruning (dppo.r_q = {}) is only \
                 approximately unbiased: its token count is estimated from the rolled-out \
                 prompts (bias O(1/batch)); \"seq-mean-token-sum-norm\" (the default) and \
                 \"seq-mean-token-mean\" are exactly unbiased",
                self.dppo.r_q
            )
        })
    }

    /// Parses `text` (from `origin`), applies `overrides` (`a.b=value`, values in TOML
    /// syntax, bare words taken as strings) and validates; an error names the file (at
    /// the key's line) or the `--set` that wrote the bad value.
    pub fn from_toml(text: &str, origin: &str, overrides: &[String]) -> Result<Self, ConfigError> {
        let parse_err = |reason: String| ConfigError::Parse {
            origin: origin.to_string(),
            reason,
        };
        let mut doc: toml::Table = toml::from_str(text).map_err(|e| parse_err(e.to_string()))?;
        for o in overrides {
            apply_override(&mut doc, o)?;
        }
        let origins = Origins::new(origin, text, overrides);
        check_keys(&doc, &origins)?;
        // Every key present is known and allowed: what serde can still reject is a key the
        // file lacks.
        let cfg: RunConfig = toml::Value::Table(doc)
            .try_into()
            .map_err(|e: toml::de::Error| parse_err(e.message().to_string()))?;
        check_rules(&cfg, &origins)?;
        Ok(cfg)
    }

    /// Reads the config file at `path` and applies `overrides`, as [`RunConfig::from_toml`].
    pub fn from_file(path: &std::path::Path, overrides: &[String]) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_toml(&text, &path.display().to_string(), overrides)
    }

    /// The config file `path` with `overrides`, or the built-in default with them.
    pub fn load(path: Option<&std::path::Path>, overrides: &[String]) -> Result<Self, ConfigError> {
        match path {
            Some(path) => Self::from_file(path, overrides),
            None => Self::default_with(overrides),
        }
    }

    /// The built-in default with `overrides`.
    pub fn default_with(overrides: &[String]) -> Result<Self, ConfigError> {
        Self::from_toml(DEFAULT_TOML, "configs/default.toml (built in)", overrides)
    }

    /// The effective configuration as TOML (written to the run directory).
    pub fn to_toml(&self) -> String {
        toml::to_string(self).unwrap_or_else(|e| format!("# cannot serialise: {e}"))
    }
}

impl ActorConfig {
    /// The clipped objective these settings define, over untempered logprobs (the run's
    /// learner takes `rollout.temperature` too: `RunConfig::loss`).
    pub fn loss(&self) -> LossConfig {
        LossConfig {
            eps_low: self.eps_low,
            eps_high: self.eps_high,
            loss_agg: self.loss_agg,
            ratio_level: self.ratio_level,
            beta: self.beta,
            temperature: 1.0,
            top_p: 1.0,
            recompute_old_logprobs: self.recompute_old_logprobs,
            correction: RolloutCorrection::default(),
        }
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
    fn config_files_load_with_overrides_and_are_named_in_errors() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("run.toml");
        std::fs::write(&path, DEFAULT_TOML).unwrap();
        let cfg = RunConfig::load(Some(&path), &["steps=7".to_string()]).unwrap();
        assert_eq!(
            cfg,
            RunConfig::default_with(&["steps=7".to_string()]).unwrap()
        );
        let missing = dir.path().join("missing.toml");
        let err = RunConfig::from_file(&missing, &[]).unwrap_err().to_string();
        assert!(
            err.starts_with(&format!("reading config {}: ", missing.display())),
            "{err}"
        );
        std::fs::write(&path, "steps = [").unwrap();
        let err = RunConfig::from_file(&path, &[]).unwrap_err().to_string();
        assert!(err.starts_with(&path.display().to_string()), "{err}");
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
    fn only_token_mean_under_prompt_pruning_is_noted_as_approximately_unbiased() {
        let note = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(ToString::to_string).collect();
            RunConfig::default_with(&sets).unwrap().bias_note()
        };
        assert_eq!(note(&[]), None, "the default is exactly unbiased");
        let token_mean = note(&["actor.loss_agg=token-mean"]).expect("a note");
        assert!(token_mean.contains("dppo.r_q = 0.3"), "{token_mean}");
        assert_eq!(note(&["actor.loss_agg=token-mean", "dppo.r_q=0"]), None);
        assert_eq!(note(&["actor.loss_agg=token-mean", "algorithm=grpo"]), None);
        assert_eq!(note(&["actor.loss_agg=seq-mean-token-mean"]), None);
    }

    #[test]
    fn a_config_file_that_cannot_be_read_is_an_io_error() {
        let err =
            RunConfig::from_file(std::path::Path::new("/nonexistent/my.toml"), &[]).unwrap_err();
        assert!(matches!(err, ConfigError::Io { .. }), "{err}");
        assert!(err
            .to_string()
            .starts_with("reading config /nonexistent/my.toml: "));
    }
}
