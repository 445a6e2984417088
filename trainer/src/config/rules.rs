//! The requirements that relate keys (or a list's items), checked once every key's own
//! constraint holds; `dppo config` prints each beside the key it names.

use dppo_model::DeviceSpec;

use super::reward::BUILT_IN_NAMES;
use super::RunConfig;
use crate::report::metrics_log::Logger;

/// A requirement that no single key's constraint states: it relates keys, or a list's items.
pub struct Rule {
    /// The key an error names.
    pub key: &'static str,
    /// What it requires, printed after the key's allowed values.
    pub says: &'static str,
    /// Why `cfg` breaks it, if it does.
    pub broken: fn(&RunConfig) -> Option<String>,
}

/// Every rule, checked in order once the keys' own constraints hold.
pub const RULES: &[Rule] = &[
    Rule {
        key: "engine.rope_writes_kv",
        says: "only with engine.rope_kernel, whose kernel it changes",
        broken: |cfg| without_rope_kernel(cfg.engine.rope_writes_kv, cfg.engine.rope_kernel),
    },
    Rule {
        key: "engine.cuda_graphs",
        says: "only with rollout.one_step_off_policy = false: a capture turns cudarc's event \
               tracking off for the GPU's whole context, which a learner training beside the \
               engine shares",
        broken: |cfg| {
            (cfg.engine.cuda_graphs && cfg.rollout.one_step_off_policy).then(|| {
                "is true with rollout.one_step_off_policy = true: while a decode step is \
                 captured cudarc's event tracking is off for the whole GPU context, so a \
                 learner training beside the engine could make buffers it never tracks; set \
                 rollout.one_step_off_policy = false"
                    .into()
            })
        },
    },
    Rule {
        key: "logger",
        says: "including \"jsonl\" (the plot, dppo compare and resume read metrics.jsonl)",
        broken: |cfg| {
            (!cfg.logger.contains(&Logger::Jsonl)).then(|| {
                format!(
                    "must include \"jsonl\" (the plot, dppo compare and resume read \
                     metrics.jsonl), got {:?}",
                    cfg.logger
                )
            })
        },
    },
    Rule {
        key: "devices",
        says: "all cpu or all GPUs (NCCL), each GPU once",
        broken: |cfg| {
            let gpus: Vec<_> = cfg
                .devices
                .iter()
                .filter(|d| **d != DeviceSpec::Cpu)
                .collect();
            if !gpus.is_empty() && gpus.len() != cfg.devices.len() {
                return Some(
                    "mixes cpu and cuda ranks: every rank must be a GPU (NCCL) or every rank \
                     the CPU"
                        .into(),
                );
            }
            let listed: Vec<_> = cfg.devices.iter().map(ToString::to_string).collect();
            (1..gpus.len())
                .any(|i| gpus[..i].contains(&gpus[i]))
                .then(|| {
                    format!(
                        "lists a GPU twice ({}): one rank per GPU (CPU ranks may repeat `cpu`)",
                        listed.join(", ")
                    )
                })
        },
    },
    Rule {
        key: "rollout_correction.rollout_rs_threshold_lower",
        says: "below rollout_rs_threshold",
        broken: |cfg| {
            let c = &cfg.rollout_correction;
            (c.rollout_rs_threshold_lower >= c.rollout_rs_threshold).then(|| {
                format!(
                    "must be below rollout_correction.rollout_rs_threshold ({}), got {}",
                    c.rollout_rs_threshold, c.rollout_rs_threshold_lower
                )
            })
        },
    },
    Rule {
        key: "actor.weight_decay",
        says: "with actor.lr * weight_decay < 1 and warmup.lr * weight_decay < 1",
        broken: |cfg| {
            let wd = cfg.actor.weight_decay;
            (cfg.actor.lr * wd >= 1.0 || cfg.warmup.lr * wd >= 1.0).then(|| {
                format!(
                    "must have actor.lr * weight_decay < 1 and warmup.lr * weight_decay < 1 \
                     (decoupled decay would flip the weights' sign), got {wd} with actor.lr {} \
                     and warmup.lr {}",
                    cfg.actor.lr, cfg.warmup.lr
                )
            })
        },
    },
    Rule {
        key: "data.train_weights",
        says: "one per data.train file",
        broken: |cfg| {
            let files = cfg.data.train.paths();
            let weights = cfg.data.train_weights.as_ref()?;
            (weights.len() != files.len()).then(|| {
                format!(
                    "must have one weight per data.train file ({}), got {}",
                    files.len(),
                    weights.len()
                )
            })
        },
    },
    Rule {
        key: "data.train",
        says: "a built-in task alone",
        broken: |cfg| {
            let files = cfg.data.train.paths();
            (files.len() > 1 && files.iter().any(|f| f.starts_with("builtin:"))).then(|| {
                format!(
                    "a built-in task cannot be mixed with files, got {}",
                    cfg.data.train
                )
            })
        },
    },
    Rule {
        key: "reward.combine",
        says: "naming only defined rewards",
        broken: |cfg| unknown_reward(cfg, cfg.reward.combine.iter()),
    },
    Rule {
        key: "reward.routes",
        says: "naming only defined rewards",
        broken: |cfg| unknown_reward(cfg, cfg.reward.routes.values()),
    },
    Rule {
        key: "reward.functions",
        says: "not named verifier, url or command",
        broken: |cfg| {
            let taken = cfg
                .reward
                .functions
                .keys()
                .find(|n| BUILT_IN_NAMES.contains(&n.as_str()))?;
            Some(format!(
                "{taken:?} is a built-in name (verifier, url, command): name it otherwise"
            ))
        },
    },
    Rule {
        key: "reward.url",
        says:
            "with no credentials in the address (user:password@), which is logged and \
               written to config.toml: a bearer token goes in the variable reward.api_key_env names",
        broken: |cfg| {
            let url = cfg.reward.url.as_deref()?;
            has_credentials(url).then(|| credentials("reward.url"))
        },
    },
    Rule {
        key: "reward.functions",
        says: "each url with no credentials in the address (user:password@)",
        broken: |cfg| {
            let (name, _) = cfg
                .reward
                .functions
                .iter()
                .find(|(_, f)| f.url.as_deref().is_some_and(has_credentials))?;
            Some(credentials(&format!("reward.functions.{name}.url")))
        },
    },
    Rule {
        key: "reward.overlong_buffer",
        says: "less than rollout.max_response_len",
        broken: |cfg| {
            let (buffer, max_len) = (
                cfg.reward.verifier.overlong_buffer,
                cfg.rollout.max_response_len,
            );
            (buffer >= max_len).then(|| {
                format!("must be less than rollout.max_response_len ({max_len}), got {buffer}")
            })
        },
    },
];

/// Whether `url`'s authority (after any scheme and slashes, up to the path) holds
/// userinfo; malformed addresses such as `http:/u:p@h` are read the same way.
fn has_credentials(url: &str) -> bool {
    let is_scheme = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric());
    let rest = match url.split_once(':') {
        Some((scheme, rest)) if is_scheme(scheme) => rest,
        _ => url,
    };
    let authority = rest.trim_start_matches('/').split(['/', '?', '#']).next();
    authority.is_some_and(|a| a.contains('@'))
}

/// Why an address with credentials (at `key`) is refused.
fn credentials(key: &str) -> String {
    format!(
        "{key} carries credentials (user:password@) that would be logged and written to \
         config.toml; put a bearer token in an environment variable and name it in \
         reward.api_key_env"
    )
}

/// Why `weights` name a reward `cfg` does not define, if they do.
fn unknown_reward<'a>(
    cfg: &RunConfig,
    mut weights: impl Iterator<Item = &'a super::reward::Weights>,
) -> Option<String> {
    let names = cfg.reward.names();
    let unknown = weights.find_map(|w| w.keys().find(|n| !names.contains(&n.as_str())))?;
    Some(format!(
        "names {unknown:?}, which is not defined (defined: {})",
        names.join(", ")
    ))
}

/// Why a switch of the rope kernel is on (`on`) while the kernel is not, if it is.
fn without_rope_kernel(on: bool, rope_kernel: bool) -> Option<String> {
    (on && !rope_kernel).then(|| {
        "is true with engine.rope_kernel = false: it changes what that kernel does, so it \
         needs engine.rope_kernel = true"
            .into()
    })
}
