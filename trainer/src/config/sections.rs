//! The configuration's tables (`[data]`, `[rollout]`, `[actor]`, `[dppo]`, ...), each a
//! serde struct whose field names are the TOML keys.

use candle_core::{DType, Device};
use dppo_engine::{AttentionMode, FusedKernels, SamplingPlace};
use serde::{Deserialize, Serialize};

use crate::advantages::ScaleRewards;
use crate::correction::RolloutCorrection;
use crate::loss::{LossAgg, LossConfig, RatioLevel};
use crate::prune::{CandidateRule, CompletionScope, LevelConfig, PromptPredictor, PruneMode};

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
    pub num_train: usize,
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
    pub allocation: bool,
    /// Which items of a scope (a group, the batch, or the step's seen prompts) may be
    /// dropped, at both levels: the keys `candidates` and `candidate_frac`.
    #[serde(flatten, with = "candidate_keys")]
    pub candidates: CandidateRule,
    /// How candidates are dropped: `fixed_count` (default; exactly unbiased, fixed count),
    /// `poisson` (unbiased, random count) or `deterministic` (biased ablation, weight 1).
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
    /// The attention backend: `auto` (the CPU kernel for f32 on the CPU, the paged CUDA
    /// kernels on a GPU where they take the model's heads, the device-generic path
    /// elsewhere), `cpu`, `generic` or `cuda`.
    pub attention: AttentionMode,
    /// Dtype of the engine's weights and KV cache (`auto`: f32 on the CPU, bf16 on a GPU).
    pub dtype: DtypeChoice,
    /// Where tokens are drawn: `auto` (the device kernel on a GPU, the host elsewhere),
    /// `host`, or `device` (one GPU kernel; on the CPU its host reference).
    pub sampling: SamplingPlace,
    /// With sampling on a GPU, each score's exact Gumbel noise only where it could win: the
    /// same draws (on: checked and faster on an H200; host sampling ignores it).
    pub lazy_noise: bool,
    /// With sampling on a GPU, each untruncated draw's row split over several blocks: the
    /// same draws (off: not yet checked on a GPU; host sampling ignores it).
    pub split_draws: bool,
    /// candle-nn's fused kernels for RMSNorm, rotary embedding, SiLU and the attention
    /// softmax in the engine: `auto` (on a GPU, where they are checked and faster; not on
    /// the CPU), `true` or `false`.
    pub fused_kernels: FusedKernels,
    /// With the paged CUDA kernels, the q/k/v projection's bias and rotary embedding by one
    /// kernel of dppo's own (on; checked on an H200).
    pub rope_kernel: bool,
    /// With `rope_kernel`, that kernel also writes k and v into their slots of the KV pool
    /// (off: not yet checked on a GPU).
    pub rope_writes_kv: bool,
    /// With `rope_kernel`, models with q/k norms (Qwen3) take that kernel too, which applies
    /// the norms itself (on; checked and faster on an H200; ignored without `rope_kernel`).
    pub rope_qk_norm: bool,
    /// With the paged CUDA kernels, the residual add with its RMSNorm and the gated MLP's
    /// product by kernels of dppo's own (on; checked on an H200).
    pub layer_kernels: bool,
    /// With the paged CUDA kernels, decode steps padded to a bucket of batch sizes and
    /// replayed from captured CUDA graphs (off: not yet checked on a GPU).
    pub cuda_graphs: bool,
}

impl Default for EngineSettings {
    fn default() -> Self {
        Self {
            gpu_memory_utilization: 0.5,
            attention: AttentionMode::Auto,
            dtype: DtypeChoice::Auto,
            sampling: SamplingPlace::Auto,
            lazy_noise: true,
            split_draws: false,
            fused_kernels: FusedKernels::Auto,
            rope_kernel: true,
            rope_writes_kv: false,
            rope_qk_norm: true,
            layer_kernels: true,
            cuda_graphs: false,
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

fn default_question() -> String {
    "question".into()
}
fn default_answer() -> String {
    "answer".into()
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
