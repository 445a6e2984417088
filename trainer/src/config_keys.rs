//! The reference of every configuration key: a one-line doc, the allowed values and the
//! name of the same setting in verl or TRL. `dppo config` prints a configuration as TOML
//! with these as comments, and `docs/configuration.md` is that output for the default; a
//! test keeps this table and [`crate::config::RunConfig`] in step, key for key.

use crate::config::RunConfig;

/// One key of the configuration.
pub struct KeyDoc {
    /// The dotted key, as `--set` takes it (`dppo.r_o`).
    pub key: &'static str,
    /// What it sets, in a line.
    pub doc: &'static str,
    /// The values it accepts.
    pub allowed: &'static str,
    /// The same setting in verl or TRL, where one exists.
    pub peer: Option<&'static str>,
    /// Whether the key may be absent (then it is printed commented out).
    pub optional: bool,
}

const fn key(
    key: &'static str,
    doc: &'static str,
    allowed: &'static str,
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

/// Every key, in the order `dppo config` prints them (top-level keys, then each table).
pub const KEYS: &[KeyDoc] = &[
    key("model", "the policy: a built-in preset, an HF model directory or a .gguf file", "builtin:tiny | an HF model directory | a .gguf file", Some("verl actor_rollout_ref.model.path; TRL model")),
    key("algorithm", "what trains: GRPO, DPPO (unbiased pruning) or the biased baselines CPPO and GRESO", "grpo | dppo | cppo | greso", Some("verl algorithm.adv_estimator")),
    key("seed", "seed of every random draw (data split, prompts, sampling, pruning); a run is a function of it", "integer >= 0", Some("TRL seed")),
    key("steps", "RL optimizer steps", "integer >= 0", Some("verl trainer.total_training_steps; TRL max_steps")),
    key("deterministic", "rollouts run alone in the engine so serving never changes what is trained (bit-reproducible)", "true | false", None),
    key("threads", "CPU threads for tensor work (0: one per core, or RAYON_NUM_THREADS)", "integer >= 0", None),
    key("device", "where the engine and the learner run (cuda needs a build with the cuda feature)", "cpu | cuda | cuda:N", Some("verl trainer.device")),
    key("devices", "data-parallel ranks, one process per device, each with a replica of the policy and its own engine (empty: one process on device)", "[] | [\"cpu\", \"cpu\"] | [\"cuda:0\", \"cuda:1\", ...]", Some("torchrun --nproc-per-node; verl trainer.n_gpus_per_node")),
    key("rank_timeout_s", "seconds a rank waits for the others before the run fails naming the rank that stopped answering", "integer > 0", Some("torch.distributed timeout")),
    key("resume", "auto: continue from the newest complete checkpoint in the run directory, or start when there is none", "disable | auto", Some("verl trainer.resume_mode")),
    key("logger", "metrics sinks: metrics.jsonl (required) and TensorBoard event files under tensorboard/", "[\"jsonl\"] | [\"jsonl\", \"tensorboard\"]", Some("verl trainer.logger; TRL report_to")),
    key("data.train", "training prompts: a built-in task or a JSONL file", "builtin:arithmetic | path.jsonl", Some("verl data.train_files")),
    KeyDoc { optional: true, ..key("data.eval", "held-out JSONL file (built-in tasks bring their own held-out split)", "path.jsonl", Some("verl data.val_files")) },
    key("data.question_field", "JSONL field holding the question", "string", Some("verl data.prompt_key")),
    key("data.answer_field", "JSONL field holding the gold answer", "string", None),
    key("data.num_train", "size of a built-in task's training split", "integer > 0", None),
    key("data.num_eval", "size of a built-in task's held-out split; also caps a held-out file", "integer > 0", None),
    key("warmup.steps", "supervised steps on demonstrations before RL", "integer >= 0 (0: no warm-up)", None),
    key("warmup.examples", "demonstrations: the first this many training problems (0: all)", "integer >= 0", None),
    key("warmup.batch_size", "demonstrations per warm-up step", "integer > 0", None),
    key("warmup.lr", "warm-up learning rate", "float > 0", None),
    key("rollout.n", "samples per prompt (G)", "integer >= 2", Some("verl actor_rollout_ref.rollout.n; TRL num_generations")),
    key("rollout.prompts_per_step", "prompts per RL step (before DPPO's over-draw)", "integer > 0", Some("verl data.train_batch_size")),
    key("rollout.temperature", "sampling temperature of rollouts", "float > 0", Some("verl actor_rollout_ref.rollout.temperature; TRL temperature")),
    key("rollout.top_p", "nucleus sampling of rollouts", "float in (0, 1]", Some("verl actor_rollout_ref.rollout.top_p; TRL top_p")),
    key("rollout.max_response_len", "new tokens per completion at most", "integer > 0", Some("verl data.max_response_length; TRL max_completion_length")),
    key("rollout.one_step_off_policy", "generate step t+1's rollouts while step t trains", "true | false", Some("verl recipe one_step_off_policy")),
    key("actor.lr", "AdamW learning rate", "float > 0", Some("verl actor.optim.lr; TRL learning_rate")),
    key("actor.grad_clip", "global gradient-norm clip", "float > 0", Some("verl actor.grad_clip; TRL max_grad_norm")),
    key("actor.eps_low", "lower clip range of the ratio: 1 - eps_low", "float in [0, 1)", Some("verl actor.clip_ratio_low; TRL epsilon")),
    key("actor.eps_high", "upper clip range of the ratio: 1 + eps_high", "float >= 0", Some("verl actor.clip_ratio_high; TRL epsilon_high")),
    key("actor.beta", "KL (k3) penalty against the reference policy (0: no reference model)", "float >= 0", Some("verl actor.kl_loss_coef; TRL beta")),
    key("actor.loss_agg", "how token losses aggregate, over the full unpruned batch", "token-mean | seq-mean-token-mean | seq-mean-token-sum-norm", Some("verl actor.loss_agg_mode; TRL loss_type")),
    key("actor.scale_rewards", "advantage scaling: group std (GRPO), batch std, or none (Dr. GRPO)", "group | batch | none", Some("TRL scale_rewards; verl algorithm.norm_adv_by_std_in_grpo")),
    key("actor.ratio_level", "importance ratio per token, or per sequence (GSPO)", "token | sequence", Some("TRL importance_sampling_level")),
    key("actor.warmup_steps", "linear learning-rate warm-up steps", "integer >= 0", Some("verl actor.optim.lr_warmup_steps; TRL warmup_steps")),
    key("actor.weight_decay", "AdamW weight decay", "float >= 0", Some("verl actor.optim.weight_decay; TRL weight_decay")),
    key("dppo.r_q", "prompt-level pruning rate (DPPO); GRESO's skip rate", "float in [0, 1)", None),
    key("dppo.r_o", "completion-level pruning rate (DPPO); CPPO's batch-wide rate", "float in [0, 1)", None),
    key("dppo.scope", "where completions compete for pruning: within a group or across the batch", "group | batch", None),
    key("dppo.history_decay", "EMA decay of a prompt's |advantage| history", "float in [0, 1)", None),
    key("dppo.allocation", "over-draw prompts so the rollout batch stays full despite prompt pruning", "true | false", None),
    key("dppo.candidates", "which items may be dropped, at both levels", "below_mean | lowest_fraction", None),
    key("dppo.candidate_frac", "the lowest fraction that lowest_fraction makes candidates", "float in (0, 1]", None),
    key("dppo.prompt_predictor", "how prompt histories score prompts: EMA of |advantage|, or the chance of signal now from the prompt's difficulty and the policy's progress since its visit (candidates: below half the mean)", "signal_ema | difficulty", None),
    key("dppo.mode", "how candidates are dropped: exactly unbiased fixed count, unbiased random count, or biased", "fixed_count | poisson | deterministic", None),
    key("pack.tokens", "tokens per packed training buffer", "integer >= the longest prompt + max_response_len", Some("verl actor.ppo_max_token_len_per_gpu")),
    key("pack.window", "sequences per first-fit-decreasing packing window", "integer > 0", None),
    key("engine.gpu_memory_utilization", "fraction of the GPU's memory the run may use; the KV cache gets what weights, learner state and activations leave (dppo memory)", "float in (0, 1]", Some("verl actor_rollout_ref.rollout.gpu_memory_utilization")),
    key("engine.attention", "the engine's attention backend: the CPU kernel (f32 on the CPU only), the device-generic tensor-op path, or auto (the kernel where it runs)", "auto | cpu | generic", Some("vLLM attention_backend")),
    key("engine.dtype", "dtype of the engine's weights and KV cache (auto: f32 on the CPU, bf16 on a GPU)", "auto | f32 | bf16 | f16", Some("verl actor_rollout_ref.rollout.dtype")),
    key("eval.every", "held-out evaluation every this many steps (0: before and after only)", "integer >= 0", Some("verl trainer.test_freq; TRL eval_steps")),
    key("eval.grad_variance_draws", "pruning draws measuring the pruned gradient's scatter at evaluation steps (0: off)", "integer >= 0", None),
    KeyDoc { optional: true, ..key("reward.extract", "how the final answer is extracted (unset: strict for JSONL data, answer for built-in tasks)", "boxed | strict | flexible | answer", Some("verl's GSM8K reward modes")) },
    key("reward.overlong_buffer", "DAPO soft overlong penalty over the last this many tokens before max_response_len (0: off)", "integer < rollout.max_response_len", Some("verl reward_model.overlong_buffer.len")),
    key("reward.overlong_penalty", "the penalty at the token limit, reached linearly over the buffer", "float >= 0", Some("verl reward_model.overlong_buffer.penalty_factor")),
    key("train.compute_dtype", "dtype of the learner's forward and backward (auto: f32 on the CPU, bf16 on a GPU); master weights and AdamW state stay f32", "auto | f32 | bf16", Some("verl actor.fsdp_config.mixed_precision.param_dtype")),
    key("train.max_nonfinite_steps", "NaN/inf steps in a row (each skipped, changing nothing) before the run checkpoints its last good state and stops", "integer >= 0 (0: never stop)", None),
    key("checkpoint.every", "save every this many RL steps (0: at the end only)", "integer >= 0", Some("verl trainer.save_freq; TRL save_steps")),
    key("checkpoint.keep", "checkpoints kept, newest first", "integer > 0", Some("verl trainer.max_actor_ckpt_to_keep; TRL save_total_limit")),
];

/// `cfg` as TOML, every key preceded by its doc, allowed values and peer name; optional
/// keys that are unset appear commented out.
pub fn annotated_toml(cfg: &RunConfig) -> String {
    let table = toml::Table::try_from(cfg).expect("a RunConfig serialises to a TOML table");
    let mut out = String::new();
    let mut section = "";
    for doc in KEYS {
        let (parent, name) = doc.key.rsplit_once('.').unwrap_or(("", doc.key));
        if parent != section {
            out.push_str(&format!("\n[{parent}]\n"));
            section = parent;
        }
        out.push_str(&format!(
            "# {}. Allowed: {}.",
            capitalise(doc.doc),
            doc.allowed
        ));
        if let Some(peer) = doc.peer {
            out.push_str(&format!(" As {peer}."));
        }
        out.push('\n');
        match lookup(&table, doc.key) {
            Some(value) => out.push_str(&format!("{name} = {value}\n")),
            None => out.push_str(&format!("# {name} is unset\n")),
        }
    }
    out
}

/// `docs/configuration.md`: the default configuration, annotated.
pub fn reference_markdown() -> String {
    let cfg = RunConfig::default_with(&[]).expect("the built-in default is valid");
    format!(
        "# Configuration\n\n\
         Every key of a `dppo run` configuration, with the built-in default's values. This \
         page is the output of `dppo config` (regenerate it with \
         `cargo run --release -- config --markdown > docs/configuration.md`; a test fails \
         when it is stale). Override any key with `--set key=value`; `dppo config --config \
         my.toml --set key=value` prints what a run would use.\n\n\
         ```toml\n{}```\n",
        annotated_toml(&cfg).trim_start()
    )
}

fn capitalise(s: &str) -> String {
    let mut chars = s.chars();
    chars
        .next()
        .map(|c| c.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

/// The value at a dotted key of a TOML table.
fn lookup<'a>(table: &'a toml::Table, key: &str) -> Option<&'a toml::Value> {
    let mut parts = key.split('.');
    let mut value = table.get(parts.next()?)?;
    for part in parts {
        value = value.as_table()?.get(part)?;
    }
    Some(value)
}

#[cfg(test)]
mod tests {
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
        // Optional keys are real keys: setting one parses.
        for d in KEYS.iter().filter(|d| d.optional) {
            let err = RunConfig::default_with(&[format!("{}=x", d.key)]);
            assert!(
                !matches!(&err, Err(e) if e.to_string().contains("unknown field")),
                "{}: {err:?}",
                d.key
            );
        }
    }

    #[test]
    fn the_annotated_toml_parses_back_to_the_same_config() {
        let sets = ["dppo.r_o=0.7".to_string(), "data.eval=held.jsonl".into()];
        let cfg = RunConfig::default_with(&sets).unwrap();
        let text = annotated_toml(&cfg);
        assert!(text.contains("# Upper clip range"), "{text}");
        assert!(text.contains("TRL epsilon_high"), "{text}");
        let again = RunConfig::from_toml(&text, "annotated", &[]).unwrap();
        assert_eq!(again, cfg);
        let unset = annotated_toml(&RunConfig::default_with(&[]).unwrap());
        assert!(unset.contains("# eval is unset"), "{unset}");
    }
}
