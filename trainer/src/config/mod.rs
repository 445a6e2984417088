//! The run configuration: TOML in the verl/TRL vocabulary, `--set key=value` overrides,
//! checked once against the key table ([`keys::KEYS`]) into a [`RunConfig`]
//! the loop trusts.

use dppo_model::DeviceSpec;
use serde::{Deserialize, Serialize};

pub mod annotated;
mod check;
pub mod keys;
pub mod reward;
pub mod rules;
mod sections;

use crate::correction::RolloutCorrection;
use crate::loss::{LossAgg, LossConfig};
use crate::prune::Algorithm;
use crate::report::metrics_log::Logger;
use check::{check_keys, check_rules, Origins};
use reward::RewardSettings;
pub use sections::*;

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
    /// A value where the key names a table of keys.
    #[error("{origin}: {key} is a table of keys ([{key}], or {key}.NAME = VALUE), not {value}")]
    NotATable {
        origin: String,
        key: String,
        value: String,
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

fn default_logger() -> Vec<Logger> {
    vec![Logger::Jsonl]
}

fn default_deterministic() -> bool {
    true
}

fn default_rank_timeout() -> u64 {
    600
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

    /// Parses `text` (from `origin`) over the built-in default, so that a key the text
    /// leaves out keeps the default `dppo config` prints, applies `overrides` (`a.b=value`,
    /// values in TOML syntax, bare words taken as strings) and validates; an error names the
    /// file (at the key's line) or the `--set` that wrote the bad value.
    pub fn from_toml(text: &str, origin: &str, overrides: &[String]) -> Result<Self, ConfigError> {
        let parse_err = |reason: String| ConfigError::Parse {
            origin: origin.to_string(),
            reason,
        };
        let written: toml::Table = toml::from_str(text).map_err(|e| parse_err(e.to_string()))?;
        let mut doc: toml::Table =
            toml::from_str(DEFAULT_TOML).expect("the built-in default is valid TOML");
        layer(&mut doc, written);
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

/// Writes `over` onto `base`: a table into the table of its name, any other value in place
/// of the one there.
fn layer(base: &mut toml::Table, over: toml::Table) {
    for (name, value) in over {
        match (base.get_mut(&name), value) {
            (Some(toml::Value::Table(below)), toml::Value::Table(above)) => layer(below, above),
            (_, value) => {
                base.insert(name, value);
            }
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
    use crate::prune::{CandidateRule, PruneMode};

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
