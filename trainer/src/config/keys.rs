//! The one table of configuration keys: each key's doc, the values it accepts and the name
//! of the same setting in verl or TRL. Validation checks a configuration against it, and
//! `dppo config` prints it as comments ([`super::annotated`]).

use std::fmt;

use dppo_model::DeviceSpec;

use super::rules::RULES;

/// One key of the configuration.
pub struct KeyDoc {
    /// The dotted key, as `--set` takes it (`dppo.r_o`).
    pub key: &'static str,
    /// What it sets, in a line.
    pub doc: &'static str,
    /// The values it accepts.
    pub allowed: Allowed,
    /// The same setting in verl or TRL, where one exists.
    pub peer: Option<&'static str>,
    /// Whether the key may be absent (then it is printed commented out).
    pub optional: bool,
}

/// The values one key accepts: printed as its "Allowed" text and checked by validation.
#[derive(Debug, Clone, Copy)]
pub enum Allowed {
    /// `true` or `false`.
    Bool,
    /// `true`, `false` or `"auto"`.
    BoolOrAuto,
    /// An integer of at least `min`.
    Int { min: i64 },
    /// A finite number (integers included) within both bounds.
    Float { low: Bound, high: Bound },
    /// One of these strings.
    OneOf(&'static [&'static str]),
    /// Any string; the text says what it names.
    Text(&'static str),
    /// A device name: `cpu`, `cuda` or `cuda:N`.
    Device,
    /// A list of device names.
    Devices,
    /// A list of strings, each one of these.
    ListOf(&'static [&'static str]),
    /// A non-empty list of any strings; the text says what they are.
    Strings(&'static str),
    /// A string, or a non-empty list of strings; the text says what they are.
    TextOrStrings(&'static str),
    /// A non-empty list of numbers above 0.
    PositiveFloats,
    /// A table, checked by `admits`; the text says what it holds.
    Table {
        what: &'static str,
        admits: fn(&toml::Table) -> bool,
    },
}

/// One end of a float range.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Bound {
    /// No limit on this side.
    None,
    /// The limit itself is excluded.
    Open(f64),
    /// The limit itself is allowed.
    Closed(f64),
}

impl Allowed {
    /// Whether `value` is one of the allowed values.
    pub fn admits(&self, value: &toml::Value) -> bool {
        use toml::Value as V;
        let is_device = |v: &V| v.as_str().is_some_and(|s| s.parse::<DeviceSpec>().is_ok());
        match (self, value) {
            (Self::Bool | Self::BoolOrAuto, V::Boolean(_)) => true,
            (Self::BoolOrAuto, V::String(s)) => s == "auto",
            (Self::Int { min }, V::Integer(i)) => i >= min,
            (Self::Float { low, high }, V::Integer(i)) => in_range(*i as f64, *low, *high),
            (Self::Float { low, high }, V::Float(x)) => in_range(*x, *low, *high),
            (Self::OneOf(choices), V::String(s)) => choices.contains(&s.as_str()),
            (Self::Text(_), V::String(_)) => true,
            (Self::Device, v) => is_device(v),
            (Self::Devices, V::Array(items)) => items.iter().all(is_device),
            (Self::ListOf(choices), V::Array(items)) => items
                .iter()
                .all(|v| v.as_str().is_some_and(|s| choices.contains(&s))),
            (Self::Strings(_) | Self::TextOrStrings(_), V::Array(items)) => {
                !items.is_empty() && items.iter().all(V::is_str)
            }
            (Self::TextOrStrings(_), V::String(_)) => true,
            (Self::Table { admits, .. }, V::Table(table)) => admits(table),
            (Self::PositiveFloats, V::Array(items)) => {
                let positive = |v: &V| match v {
                    V::Integer(i) => *i > 0,
                    V::Float(x) => x.is_finite() && *x > 0.0,
                    _ => false,
                };
                !items.is_empty() && items.iter().all(positive)
            }
            _ => false,
        }
    }
}

fn in_range(x: f64, low: Bound, high: Bound) -> bool {
    let above = match low {
        Bound::None => true,
        Bound::Open(l) => x > l,
        Bound::Closed(l) => x >= l,
    };
    let below = match high {
        Bound::None => true,
        Bound::Open(h) => x < h,
        Bound::Closed(h) => x <= h,
    };
    x.is_finite() && above && below
}

impl fmt::Display for Allowed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Bool => f.write_str("true | false"),
            Self::BoolOrAuto => f.write_str("auto | true | false"),
            Self::Int { min: 1 } => f.write_str("integer > 0"),
            Self::Int { min } => write!(f, "integer >= {min}"),
            Self::Float { low, high } => {
                let low = match *low {
                    Bound::None => None,
                    Bound::Open(l) => Some(('(', ">", l)),
                    Bound::Closed(l) => Some(('[', ">=", l)),
                };
                let high = match *high {
                    Bound::None => None,
                    Bound::Open(h) => Some((')', "<", h)),
                    Bound::Closed(h) => Some((']', "<=", h)),
                };
                match (low, high) {
                    (None, None) => f.write_str("float"),
                    (Some((_, op, l)), None) => write!(f, "float {op} {l}"),
                    (None, Some((_, op, h))) => write!(f, "float {op} {h}"),
                    (Some((open, _, l)), Some((close, _, h))) => {
                        write!(f, "float in {open}{l}, {h}{close}")
                    }
                }
            }
            Self::OneOf(choices) => f.write_str(&choices.join(" | ")),
            Self::Text(what) => f.write_str(what),
            Self::Device => f.write_str("cpu | cuda | cuda:N"),
            Self::Devices => f.write_str("[] | [\"cpu\", \"cpu\"] | [\"cuda:0\", \"cuda:1\", ...]"),
            Self::ListOf(choices) => {
                let quoted: Vec<String> = choices.iter().map(|c| format!("{c:?}")).collect();
                write!(f, "a list of {}", quoted.join(", "))
            }
            Self::Strings(what) | Self::TextOrStrings(what) => f.write_str(what),
            Self::PositiveFloats => f.write_str("a list of numbers > 0"),
            Self::Table { what, .. } => f.write_str(what),
        }
    }
}

impl KeyDoc {
    /// The allowed values in words: the key's own, then the rules relating it to others.
    pub fn allowed_text(&self) -> String {
        let mut text = self.allowed.to_string();
        for rule in RULES.iter().filter(|r| r.key == self.key) {
            text.push_str(", ");
            text.push_str(rule.says);
        }
        text
    }
}

/// `reward.functions`: each entry a table of `url` (a string), `command` (strings) and
/// `extract` (a mode), at most one of `url` and `command` (serde checks the values).
fn functions_table(table: &toml::Table) -> bool {
    table.values().all(|f| {
        f.as_table().is_some_and(|f| {
            let known = f
                .keys()
                .all(|k| ["url", "command", "extract"].contains(&k.as_str()));
            known && !(f.contains_key("url") && f.contains_key("command"))
        })
    })
}

/// `reward.combine`: names to finite weights, at least one.
fn weights_table(table: &toml::Table) -> bool {
    let finite = |v: &toml::Value| match v {
        toml::Value::Integer(_) => true,
        toml::Value::Float(x) => x.is_finite(),
        _ => false,
    };
    !table.is_empty() && table.values().all(finite)
}

/// `reward.routes`: data sources to weight tables.
fn routes_table(table: &toml::Table) -> bool {
    table
        .values()
        .all(|w| w.as_table().is_some_and(weights_table))
}

/// The entry of dotted `key`.
pub fn find(key: &str) -> Option<&'static KeyDoc> {
    KEYS.iter().find(|d| d.key == key)
}

const fn key(
    key: &'static str,
    doc: &'static str,
    allowed: Allowed,
    peer: Option<&'static str>,
) -> KeyDoc {
    KeyDoc {
        key,
        doc,
        allowed,
        peer,
        optional: false,
    }
}

const fn optional(
    name: &'static str,
    doc: &'static str,
    allowed: Allowed,
    peer: Option<&'static str>,
) -> KeyDoc {
    KeyDoc {
        optional: true,
        ..key(name, doc, allowed, peer)
    }
}

const fn int(min: i64) -> Allowed {
    Allowed::Int { min }
}

const fn float(low: Bound, high: Bound) -> Allowed {
    Allowed::Float { low, high }
}

/// `[0, 1)`: a pruning rate or a decay.
const RATE: Allowed = float(Bound::Closed(0.0), Bound::Open(1.0));
/// `(0, 1]`: a fraction of something that must not be empty.
const FRACTION: Allowed = float(Bound::Open(0.0), Bound::Closed(1.0));
const POSITIVE: Allowed = float(Bound::Open(0.0), Bound::None);
const NON_NEGATIVE: Allowed = float(Bound::Closed(0.0), Bound::None);

/// Every key, in the order `dppo config` prints them (top-level keys, then each table).
#[rustfmt::skip]
pub const KEYS: &[KeyDoc] = &[
    key("model", "the policy: a built-in preset, a random-weight model of a real shape, an HF model directory, a .gguf file, a dppo checkpoint directory or a Hugging Face id in the local hub cache", Allowed::Text("builtin:tiny | random:SHAPE[@seed=N] | an HF model directory | a .gguf file | a checkpoint directory | Org/Name"), Some("verl actor_rollout_ref.model.path; TRL model")),
    key("algorithm", "what trains: GRPO, DPPO (unbiased pruning) or the biased baselines CPPO and GRESO", Allowed::OneOf(&["grpo", "dppo", "cppo", "greso"]), Some("verl algorithm.adv_estimator")),
    key("seed", "seed of every random draw (data split, prompts, sampling, pruning); a run is a function of it", int(0), Some("TRL seed")),
    key("steps", "RL optimizer steps", int(0), Some("verl trainer.total_training_steps; TRL max_steps")),
    key("deterministic", "rollouts run alone in the engine so serving never changes what is trained (bit-reproducible)", Allowed::Bool, None),
    key("threads", "CPU threads for tensor work (0: one per core, or RAYON_NUM_THREADS)", int(0), None),
    key("device", "where the engine and the learner run (cuda needs a build with the cuda feature)", Allowed::Device, Some("verl trainer.device")),
    key("devices", "data-parallel ranks, one process per device, each with a replica of the policy and its own engine (empty: one process on device)", Allowed::Devices, Some("torchrun --nproc-per-node; verl trainer.n_gpus_per_node")),
    key("rank_timeout_s", "seconds a rank waits for the others before the run fails naming the rank that stopped answering", int(1), Some("torch.distributed timeout")),
    key("resume", "auto: continue from the newest complete checkpoint in the run directory, or start when there is none", Allowed::OneOf(&["disable", "auto"]), Some("verl trainer.resume_mode")),
    key("logger", "metrics sinks: metrics.jsonl and TensorBoard event files under tensorboard/", Allowed::ListOf(&["jsonl", "tensorboard"]), Some("verl trainer.logger; TRL report_to")),
    key("data.train", "training prompts: a built-in task, or one or several JSONL or parquet files (parquet by its .parquet name)", Allowed::TextOrStrings("builtin:arithmetic | path.jsonl | path.parquet | [\"a.jsonl\", \"b.parquet\", ...]"), Some("verl data.train_files")),
    optional("data.train_weights", "one weight per data.train file: each draw picks a file in proportion, in that file's own shuffled epochs (unset: the files are one set, each problem equally likely)", Allowed::PositiveFloats, Some("OpenRLHF --prompt_data_probs")),
    optional("data.eval", "held-out JSONL or parquet file, required with a file training set (built-in tasks bring their own held-out split)", Allowed::Text("path.jsonl | path.parquet"), Some("verl data.val_files")),
    key("data.question_field", "field (a dotted path) holding the question: a string, or a list of {role, content} chat messages (verl's prompt; a trailing assistant message is the demonstration, not the prompt)", Allowed::Text("a field name or dotted path"), Some("verl data.prompt_key")),
    key("data.answer_field", "field (a dotted path) holding the gold answer, a string or a number for the verifier, any JSON for an external reward (verl: reward_model.ground_truth)", Allowed::Text("a field name or dotted path"), None),
    key("data.num_train", "size of a built-in task's training split", int(1), None),
    key("data.num_eval", "size of a built-in task's held-out split; also caps a held-out file", int(1), None),
    optional("data.system_prompt", "a system message put before every training and held-out prompt that has none", Allowed::Text("text"), Some("TRL system_prompt; verl: in the data")),
    optional("data.max_prompt_length", "training and held-out prompts longer than this many tokens (chat template applied) are left out, and counted in the log", int(1), Some("verl data.max_prompt_length with filter_overlong_prompts")),
    key("warmup.steps", "supervised steps on demonstrations before RL (0: no warm-up)", int(0), None),
    key("warmup.examples", "demonstrations: the first this many training problems (0: all)", int(0), None),
    key("warmup.batch_size", "demonstrations per warm-up step", int(1), None),
    key("warmup.lr", "warm-up learning rate", POSITIVE, None),
    key("rollout.n", "samples per prompt (G)", int(2), Some("verl actor_rollout_ref.rollout.n; TRL num_generations")),
    key("rollout.prompts_per_step", "prompts per RL step (before DPPO's over-draw)", int(1), Some("verl data.train_batch_size")),
    key("rollout.temperature", "sampling temperature of rollouts", POSITIVE, Some("verl actor_rollout_ref.rollout.temperature; TRL temperature")),
    key("rollout.top_p", "nucleus sampling of rollouts", FRACTION, Some("verl actor_rollout_ref.rollout.top_p; TRL top_p")),
    key("rollout.max_response_len", "new tokens per completion at most", int(1), Some("verl data.max_response_length; TRL max_completion_length")),
    optional("rollout.dump_dir", "each step's rollout written here as step-NNNNNN.jsonl, one line per completion: prompt, completion, reward, advantage, kept by pruning and its weight (unset: not written)", Allowed::Text("a directory"), Some("verl trainer.rollout_data_dir")),
    key("rollout.one_step_off_policy", "generate step t+1's rollouts while step t trains", Allowed::Bool, Some("verl recipe one_step_off_policy")),
    key("actor.lr", "AdamW learning rate", POSITIVE, Some("verl actor.optim.lr; TRL learning_rate")),
    key("actor.grad_clip", "global gradient-norm clip (0: off)", NON_NEGATIVE, Some("verl actor.grad_clip; TRL max_grad_norm")),
    key("actor.eps_low", "lower clip range of the ratio: 1 - eps_low", RATE, Some("verl actor.clip_ratio_low; TRL epsilon")),
    key("actor.eps_high", "upper clip range of the ratio: 1 + eps_high", NON_NEGATIVE, Some("verl actor.clip_ratio_high; TRL epsilon_high")),
    key("actor.beta", "KL (k3) penalty against the reference policy (0: no reference model)", NON_NEGATIVE, Some("verl actor.kl_loss_coef; TRL beta")),
    key("actor.loss_agg", "how token losses aggregate, over the full unpruned batch (token-mean: DAPO, approximately unbiased under prompt pruning; seq-mean-token-mean: GRPO; seq-mean-token-sum-norm: Dr. GRPO, every token over all completions x max_response_len)", Allowed::OneOf(&["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]), Some("verl actor.loss_agg_mode; TRL loss_type")),
    key("actor.scale_rewards", "advantage scaling: group std (GRPO), batch std, or none (Dr. GRPO)", Allowed::OneOf(&["group", "batch", "none"]), Some("TRL scale_rewards; verl algorithm.norm_adv_by_std_in_grpo")),
    key("actor.ratio_level", "importance ratio per token, or per sequence (GSPO)", Allowed::OneOf(&["token", "sequence"]), Some("TRL importance_sampling_level")),
    key("actor.warmup_steps", "linear learning-rate warm-up steps", int(0), Some("verl actor.optim.lr_warmup_steps; TRL warmup_steps")),
    key("actor.weight_decay", "AdamW weight decay", NON_NEGATIVE, Some("verl actor.optim.weight_decay; TRL weight_decay")),
    key("actor.recompute_old_logprobs", "the ratio's denominator is the learner's logprobs before the update (decoupled PPO), the rollout's only weigh the correction; false: the rollout's (bypass)", Allowed::Bool, Some("verl algorithm.rollout_correction.bypass_mode (inverted)")),
    key("dppo.r_q", "prompt-level pruning rate (DPPO); GRESO's skip rate", RATE, None),
    key("dppo.r_o", "completion-level pruning rate (DPPO); CPPO's batch-wide rate", RATE, None),
    key("dppo.scope", "where completions compete for pruning: within a group or across the batch", Allowed::OneOf(&["group", "batch"]), None),
    key("dppo.history_decay", "EMA decay of a prompt's |advantage| history", RATE, None),
    key("dppo.allocation", "over-draw prompts so the rollout batch stays full despite prompt pruning", Allowed::Bool, None),
    key("dppo.candidates", "which items may be dropped, at both levels", Allowed::OneOf(&["below_mean", "lowest_fraction"]), None),
    optional("dppo.candidate_frac", "the lowest fraction that lowest_fraction makes candidates (unset: 0.5; below_mean ignores it)", FRACTION, None),
    key("dppo.prompt_predictor", "how prompt histories score prompts: EMA of |advantage|, or the chance of signal now from the prompt's difficulty and the policy's progress since its visit (candidates: below half the mean)", Allowed::OneOf(&["signal_ema", "difficulty"]), None),
    key("dppo.mode", "how candidates are dropped: exactly unbiased fixed count, unbiased random count, or biased", Allowed::OneOf(&["fixed_count", "poisson", "deterministic"]), None),
    key("pack.tokens", "tokens per packed training buffer; the run checks at start that the longest prompt plus rollout.max_response_len fits one", int(1), Some("verl actor.ppo_max_token_len_per_gpu")),
    key("pack.window", "sequences per first-fit-decreasing packing window", int(1), None),
    key("engine.gpu_memory_utilization", "fraction of the GPU's memory the run may use; the KV cache gets what weights, learner state and activations leave (dppo memory)", FRACTION, Some("verl actor_rollout_ref.rollout.gpu_memory_utilization")),
    key("engine.attention", "the engine's attention backend: the CPU kernel (f32 on the CPU only), the device-generic tensor-op path, the paged CUDA kernels (GPU, CUDA build), or auto (the CPU kernel where it runs, the CUDA kernels on a GPU where they take the model's heads, generic elsewhere)", Allowed::OneOf(&["auto", "cpu", "generic", "cuda"]), Some("vLLM attention_backend")),
    key("engine.sampling", "where tokens are drawn: auto (the device kernel on a GPU, checked there against the host reference; the host elsewhere), host (from the logits rows copied there), or device (one GPU kernel for every row: temperature, top-k, top-p, min-p and top logprobs; on the CPU the kernel's host reference)", Allowed::OneOf(&["auto", "host", "device"]), None),
    key("engine.lazy_noise", "with sampling on a GPU, the kernel computes a score's exact Gumbel noise (two logs) only where one fast exp cannot show that the score stays below the best so far: the same draws, bit for bit, with far fewer logs where many scores are close, as an untrained model's are; held to the exact noise on the CPU's emulation of the kernel and by `dppo doctor` on an H200, where it sped the full rollout 7%; host sampling, which draws without the kernel, ignores it", Allowed::Bool, None),
    key("engine.split_draws", "with sampling on a GPU, each draw that truncates nothing (no top-k, top-p or min-p: RL's usual temperature-1 draw) has its row split over several blocks, about four waves of the GPU's blocks in all, and the last of a draw's blocks to finish merges their best scores and log-sum-exps, where one block a draw leaves a decode batch of a few hundred draws too few blocks for the GPU: the same tokens, logprobs within 1e-4; held to one block a draw on the CPU's emulation of the kernel, off until `dppo doctor` has passed it on a GPU; host sampling ignores it", Allowed::Bool, None),
    key("engine.fused_kernels", "candle-nn's fused kernels for RMSNorm, rotary embedding, SiLU and the attention softmax in the engine, one launch each instead of five to nine (where the CPU's own fused f32 ops do not apply), and q/k/v and gate/up as one GEMM each where the engine keeps its own weight buffers (another dtype or device than the learner's): auto (on a GPU, where `dppo doctor` checks them and they made the paged kernels' decode step 1.6x faster on an H100, measured before the attention kernel's rework; not on the CPU), true or false", Allowed::BoolOrAuto, None),
    key("engine.rope_kernel", "with the paged CUDA kernels, one kernel of dppo's own adds the q/k/v projection's bias, rotates q and k and hands q, k and v to the attention in one launch a layer, where candle takes five or six ops (models with q/k/v projections concatenated by the fused kernels and no q/k norms, such as Qwen2.5); held to the model's ops on the CPU's emulation of the kernel and checked by `dppo doctor` on an H200, where it took 9% off a decode step's device time at batch 256; other paths ignore it", Allowed::Bool, None),
    key("engine.rope_writes_kv", "with engine.rope_kernel, that kernel also writes k and v straight into their slots of the KV pool, in place of two slot-writing launches a layer (about 48 of a decode step's 306 on Qwen2.5-0.5B); held bit for bit to the separate writes on the CPU's emulation of the kernels; passed by `dppo doctor` on an H200 but off, since its one timed row there (eager) was slower; other paths ignore it", Allowed::Bool, None),
    key("engine.rope_qk_norm", "with engine.rope_kernel, models with q/k norms (Qwen3) take that kernel too: it applies each q and k head's RMSNorm itself, where candle takes about six more ops a layer (two norms, two rotations, copies); held to the model's ops on the CPU's emulation of the kernel and by `dppo doctor` on an H200, where it sped a Qwen3-1.7B-shaped rollout at batch 256 by a fifth or more; other paths, and engine.rope_kernel = false, ignore it", Allowed::Bool, None),
    key("engine.layer_kernels", "with the paged CUDA kernels, kernels of dppo's own take the layer's residual add with the RMSNorm after it (one launch where candle takes two) and the gated MLP's SiLU product straight from the concatenated gate/up projection (one launch where candle takes two over strided halves); held to the model's ops on the CPU's emulation of the kernels and checked by `dppo doctor` on an H200, where they took a quarter off a decode step's device time at batch 256 and raised the full 128 x 8 x 512 rollout's tokens/s by a third; other paths ignore it", Allowed::Bool, None),
    key("engine.cuda_graphs", "with the paged CUDA kernels, each decode step is padded to a bucket of batch sizes (1, 2, 4, 8, 16, then steps of at most a half up to 1,024; pad rows write into a KV block of their own) and replayed from a CUDA graph captured at the first step of its shape and context bucket, so the host queues a step in a few calls instead of some twenty candle ops a layer; graphs are dropped at each new policy version; the padding is held to the unpadded steps on the CPU's emulation of the kernels, off until `dppo doctor` has passed it on a GPU; other paths ignore it", Allowed::Bool, Some("vLLM enforce_eager = false")),
    key("engine.dtype", "dtype of the engine's weights and KV cache (auto: f32 on the CPU, bf16 on a GPU)", Allowed::OneOf(&["auto", "f32", "bf16", "f16"]), Some("verl actor_rollout_ref.rollout.dtype")),
    key("eval.every", "held-out evaluation every this many steps (0: before and after only)", int(0), Some("verl trainer.test_freq; TRL eval_steps")),
    key("eval.grad_variance_draws", "pruning draws measuring the pruned gradient's scatter at evaluation steps (0: off)", int(0), None),
    optional("reward.extract", "how the final answer is extracted (unset: strict for JSONL data, answer for built-in tasks)", Allowed::OneOf(&["boxed", "strict", "flexible", "answer"]), Some("verl's GSM8K reward modes")),
    key("reward.overlong_buffer", "DAPO soft overlong penalty over the last this many tokens before max_response_len (0: off)", int(0), Some("verl reward_model.overlong_buffer.len")),
    key("reward.overlong_penalty", "the penalty at the token limit, reached linearly over the buffer", NON_NEGATIVE, Some("verl reward_model.overlong_buffer.penalty_factor")),
    optional("reward.url", "a reward server speaking OpenRLHF's remote reward protocol, sent each prompt's group as it finishes (unset: the built-in verifier)", Allowed::Text("http://host:port/path"), Some("OpenRLHF --remote_rm_url; verl custom_reward_function")),
    optional("reward.command", "a reward process speaking the same JSON as lines on stdin/stdout, started once per run (unset: the built-in verifier)", Allowed::Strings("[\"program\", \"arg\", ...]"), Some("verl custom_reward_function; TRL reward_funcs")),
    optional("reward.api_key_env", "the environment variable holding reward.url's bearer token (never written to config.toml or logs)", Allowed::Text("a variable name"), None),
    key("reward.timeout_s", "seconds one reward request may take (each attempt)", POSITIVE, None),
    key("reward.max_retries", "retries of a reward server request that failed in a way that may pass (no connection, timeout, HTTP 429 or 5xx), with exponential backoff", int(0), None),
    key("reward.concurrency", "reward server requests in flight at once", int(1), None),
    optional("reward.functions", "named rewards beyond the verifier, reward.url and reward.command, for reward.combine and reward.routes: each a server (url), a process (command) or the verifier with its own extract mode", Allowed::Table { what: "{ name = { url = \"http://...\" } | { command = [\"program\", ...] } | { extract = \"boxed\" } }", admits: functions_table }, Some("verl custom_reward_function; TRL reward_funcs")),
    optional("reward.combine", "every data source's reward as a weighted sum of named rewards (verifier, url, command or reward.functions), each logged as reward/<name>/mean (unset: the one of reward.url, reward.command or the verifier)", Allowed::Table { what: "{ name = weight, ... }", admits: weights_table }, Some("TRL reward_weights")),
    optional("reward.routes", "a data source's reward as a weighted sum of named rewards, in place of reward.combine", Allowed::Table { what: "{ \"data_source\" = { name = weight, ... }, ... }", admits: routes_table }, Some("verl default_compute_score by data_source")),
    key("reward.on_error", "a failed or malformed reward answer stops the run naming the prompt and reason (fail), or scores the group 0 and counts in reward/errors (zero); a reward process that exits always stops the run, after a checkpoint", Allowed::OneOf(&["fail", "zero"]), None),
    key("rollout_correction.rollout_is", "importance weights from the learner-rollout ratio: none, per token, or per sequence (the product of its ratios), capped at rollout_is_threshold (TIS)", Allowed::OneOf(&["none", "token", "sequence"]), Some("verl algorithm.rollout_correction.rollout_is; TRL vllm_importance_sampling_correction")),
    key("rollout_correction.rollout_is_threshold", "the importance weight's cap", POSITIVE, Some("verl algorithm.rollout_correction.rollout_is_threshold; TRL vllm_importance_sampling_cap")),
    key("rollout_correction.rollout_rs", "rejection: mask tokens (token), sequences (sequence: the product of ratios; geometric: their geometric mean) whose ratio leaves [rollout_rs_threshold_lower, rollout_rs_threshold]", Allowed::OneOf(&["none", "token", "sequence", "geometric"]), Some("verl algorithm.rollout_correction.rollout_rs")),
    key("rollout_correction.rollout_rs_threshold", "upper end of the kept band of ratios", POSITIVE, Some("verl algorithm.rollout_correction.rollout_rs_threshold")),
    key("rollout_correction.rollout_rs_threshold_lower", "lower end of the kept band of ratios", POSITIVE, Some("verl algorithm.rollout_correction.rollout_rs_threshold_lower")),
    key("train.compute_dtype", "dtype of the learner's forward and backward (auto: f32 on the CPU, bf16 on a GPU; f16's range overflows in the backward pass); master weights and AdamW state stay f32", Allowed::OneOf(&["auto", "f32", "bf16"]), Some("verl actor.fsdp_config.mixed_precision.param_dtype")),
    key("train.max_nonfinite_steps", "NaN/inf steps in a row (each skipped, changing nothing) before the run checkpoints its last good state and stops (0: never stop)", int(0), None),
    key("checkpoint.every", "save every this many RL steps (0: at the end only)", int(0), Some("verl trainer.save_freq; TRL save_steps")),
    key("checkpoint.keep", "checkpoints kept, newest first", int(1), Some("verl trainer.max_actor_ckpt_to_keep; TRL save_total_limit")),
];

/// The value at a dotted key of a TOML table.
pub(super) fn lookup<'a>(table: &'a toml::Table, key: &str) -> Option<&'a toml::Value> {
    let mut parts = key.split('.');
    let mut value = table.get(parts.next()?)?;
    for part in parts {
        value = value.as_table()?.get(part)?;
    }
    Some(value)
}

#[cfg(test)]
mod tests {
    use super::super::RunConfig;
    use super::*;

    /// Every dotted key of scalar (non-table) values in `table`.
    fn leaf_keys(table: &toml::Table, prefix: &str, out: &mut Vec<String>) {
        for (k, v) in table {
            let key = if prefix.is_empty() {
                k.clone()
            } else {
                format!("{prefix}.{k}")
            };
            match v.as_table() {
                Some(sub) => leaf_keys(sub, &key, out),
                None => out.push(key),
            }
        }
    }

    #[test]
    fn every_key_of_the_config_is_documented_once_and_no_other() {
        let cfg = RunConfig::default_with(&[]).unwrap();
        let table = toml::Table::try_from(&cfg).unwrap();
        let mut serialised = Vec::new();
        leaf_keys(&table, "", &mut serialised);
        let mut documented: Vec<String> = KEYS
            .iter()
            .filter(|d| !d.optional)
            .map(|d| d.key.to_string())
            .collect();
        serialised.sort();
        documented.sort();
        assert_eq!(documented, serialised, "KEYS and RunConfig disagree");
        let mut all: Vec<_> = KEYS.iter().map(|d| d.key).collect();
        all.sort();
        all.dedup();
        assert_eq!(all.len(), KEYS.len(), "a key is documented twice");
        for rule in RULES {
            assert!(find(rule.key).is_some(), "rule on unknown key {}", rule.key);
        }
    }

    /// Each key's default satisfies its constraint, and every value the table allows for a
    /// key of choices or a bool parses to itself (on the synchronous loop, so that no rule
    /// refuses it): the table and serde's spelling agree.
    #[test]
    fn the_table_and_the_config_types_agree() {
        let cfg = RunConfig::default_with(&[]).unwrap();
        let table = toml::Table::try_from(&cfg).unwrap();
        for doc in KEYS {
            if let Some(value) = lookup(&table, doc.key) {
                assert!(doc.allowed.admits(value), "{} = {value}", doc.key);
            }
            let choices: Vec<String> = match doc.allowed {
                Allowed::OneOf(choices) => choices.iter().map(|c| format!("{c:?}")).collect(),
                Allowed::Bool => vec!["true".into(), "false".into()],
                Allowed::BoolOrAuto => vec!["\"auto\"".into(), "true".into(), "false".into()],
                _ => continue,
            };
            for choice in choices {
                let set = format!("{}={choice}", doc.key);
                // The synchronous loop, which `engine.cuda_graphs = true` requires (a rule).
                let sync = "rollout.one_step_off_policy=false".to_string();
                let cfg = RunConfig::default_with(&[sync, set.clone()]).unwrap();
                let table = toml::Table::try_from(&cfg).unwrap();
                let got = lookup(&table, doc.key).map(ToString::to_string);
                assert_eq!(got.as_deref(), Some(choice.as_str()), "--set {set}");
            }
        }
    }

    #[test]
    fn allowed_values_read_as_written() {
        let text = |key: &str| find(key).unwrap().allowed_text();
        assert_eq!(text("dppo.r_o"), "float in [0, 1)");
        assert_eq!(text("rollout.top_p"), "float in (0, 1]");
        assert_eq!(text("actor.grad_clip"), "float >= 0");
        assert_eq!(text("actor.lr"), "float > 0");
        assert_eq!(text("checkpoint.keep"), "integer > 0");
        assert_eq!(text("rollout.n"), "integer >= 2");
        assert_eq!(
            text("reward.overlong_buffer"),
            "integer >= 0, less than rollout.max_response_len"
        );
        let value = |s: &str| s.parse::<toml::Table>().unwrap()["v"].clone();
        let rate = find("dppo.r_o").unwrap().allowed;
        assert!(rate.admits(&value("v = 0")) && rate.admits(&value("v = 0.5")));
        for bad in ["v = 1", "v = -0.1", "v = nan", "v = \"0.5\""] {
            assert!(!rate.admits(&value(bad)), "{bad}");
        }
        let devices = find("devices").unwrap().allowed;
        assert!(devices.admits(&value("v = [\"cpu\", \"cuda:1\"]")));
        assert!(!devices.admits(&value("v = [\"tpu\"]")));
    }
}
