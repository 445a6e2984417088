//! Validation of a configuration against the key table ([`super::keys::KEYS`]) and
//! the few rules that relate keys, naming where each bad value came from.

use std::collections::BTreeMap;

use super::keys::{self, KEYS};
use super::rules::RULES;
use super::{ConfigError, RunConfig, DEFAULT_TOML};

/// Where the values of a configuration came from: the `--set` overrides, else the file.
pub(crate) struct Origins<'a> {
    /// The file, as errors name it.
    file: &'a str,
    /// The line of every dotted key written in the file.
    lines: BTreeMap<String, usize>,
    /// Each override's dotted key, and the override as given.
    overrides: Vec<(&'a str, &'a str)>,
    /// Whether the file was written over the built-in default, whose values the keys it
    /// leaves out keep.
    over_default: bool,
}

impl<'a> Origins<'a> {
    /// The origins of `text` (read from `file`; written over the built-in default unless it
    /// is that default) with `overrides` applied in order.
    pub(crate) fn new(file: &'a str, text: &str, overrides: &'a [String]) -> Self {
        let mut lines = BTreeMap::new();
        if let Ok(doc) = toml::de::DeTable::parse(text) {
            key_lines(text, doc.get_ref(), "", &mut lines);
        }
        let overrides = overrides
            .iter()
            .map(|o| {
                (
                    o.split_once('=').map_or(o.as_str(), |(k, _)| k.trim()),
                    o.as_str(),
                )
            })
            .collect();
        Self {
            file,
            lines,
            overrides,
            over_default: text != DEFAULT_TOML,
        }
    }

    /// Where `key`'s value came from: the last `--set` of it or of a table holding it,
    /// else the file, at the key's line when it is written there (the built-in default when
    /// the file leaves it out). A `--set` whose value
    /// holds an `@` (it may carry credentials) is named by its key alone.
    pub(crate) fn of(&self, key: &str) -> String {
        let set_by = |path: &str| key == path || key.starts_with(&format!("{path}."));
        let set = self.overrides.iter().rev().find(|(path, _)| set_by(path));
        if let Some((path, spec)) = set {
            return match spec.split_once('=') {
                Some((_, value)) if value.contains('@') => {
                    format!("--set {path}=(value not shown)")
                }
                _ => format!("--set {spec}"),
            };
        }
        match self.lines.get(key) {
            Some(line) => format!("{}:{line}", self.file),
            None if self.over_default && !self.lines.keys().any(|k| set_by(k)) => {
                format!("{} (not set there: the built-in default)", self.file)
            }
            None => self.file.to_string(),
        }
    }
}

/// Records the line of each key of `table` (and of its sub-tables) in `out`.
fn key_lines(
    text: &str,
    table: &toml::de::DeTable<'_>,
    prefix: &str,
    out: &mut BTreeMap<String, usize>,
) {
    for (name, value) in table.iter() {
        let key = dotted(prefix, name.get_ref());
        let line = text[..name.span().start].matches('\n').count() + 1;
        if let Some(sub) = value.get_ref().as_table() {
            key_lines(text, sub, &key, out);
        }
        out.insert(key, line);
    }
}

fn dotted(prefix: &str, name: &str) -> String {
    if prefix.is_empty() {
        name.to_string()
    } else {
        format!("{prefix}.{name}")
    }
}

/// Checks every key of `doc` against the table: known, and its value allowed.
pub(crate) fn check_keys(doc: &toml::Table, origins: &Origins<'_>) -> Result<(), ConfigError> {
    check_table(doc, "", origins)
}

fn check_table(
    table: &toml::Table,
    prefix: &str,
    origins: &Origins<'_>,
) -> Result<(), ConfigError> {
    for (name, value) in table {
        let key = dotted(prefix, name);
        if let Some(doc) = keys::find(&key) {
            if !doc.allowed.admits(value) {
                return Err(ConfigError::Invalid {
                    origin: origins.of(&key),
                    key: doc.key,
                    value: value.to_string(),
                    allowed: doc.allowed_text(),
                });
            }
            continue;
        }
        let within = format!("{key}.");
        let is_table = KEYS.iter().any(|d| d.key.starts_with(&within));
        match value.as_table() {
            Some(sub) if is_table => check_table(sub, &key, origins)?,
            None if is_table => {
                return Err(ConfigError::NotATable {
                    origin: origins.of(&key),
                    key,
                    value: value.to_string(),
                })
            }
            _ => {
                return Err(ConfigError::UnknownKey {
                    origin: origins.of(&key),
                    key,
                    known: siblings(prefix),
                })
            }
        }
    }
    Ok(())
}

/// The keys and tables directly under `prefix` (the top level when empty).
fn siblings(prefix: &str) -> String {
    let mut names: Vec<&str> = KEYS
        .iter()
        .filter_map(|d| match prefix {
            "" => Some(d.key),
            p => d.key.strip_prefix(p)?.strip_prefix('.'),
        })
        .map(|rest| rest.split('.').next().unwrap_or(rest))
        .collect();
    names.dedup();
    names.join(", ")
}

/// Checks the rules that relate keys.
pub(crate) fn check_rules(cfg: &RunConfig, origins: &Origins<'_>) -> Result<(), ConfigError> {
    for rule in RULES {
        if let Some(reason) = (rule.broken)(cfg) {
            return Err(ConfigError::Rule {
                origin: origins.of(rule.key),
                key: rule.key,
                reason,
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::config::{RunConfig, DEFAULT_TOML};

    fn error(text: &str, sets: &[&str]) -> String {
        let sets: Vec<String> = sets.iter().map(ToString::to_string).collect();
        RunConfig::from_toml(text, "my.toml", &sets)
            .unwrap_err()
            .to_string()
    }

    /// `DEFAULT_TOML` with `key = value` in place of the line setting `key` in `table`.
    fn with_line(table: &str, key: &str, value: &str) -> (String, usize) {
        let mut section = "";
        let mut at = 0;
        let lines: Vec<String> = DEFAULT_TOML
            .lines()
            .enumerate()
            .map(|(i, line)| {
                if line.starts_with('[') {
                    section = line;
                }
                if section == format!("[{table}]") && line.starts_with(&format!("{key} =")) {
                    at = i + 1;
                    return format!("{key} = {value}");
                }
                line.to_string()
            })
            .collect();
        assert!(at > 0, "{table}.{key} is in the default");
        (lines.join("\n"), at)
    }

    #[test]
    fn bad_configs_name_the_key() {
        let cases = [
            (
                "threads=-1",
                "invalid value for threads: got -1, allowed: integer >= 0",
            ),
            (
                "dppo.r_o=1",
                "invalid value for dppo.r_o: got 1, allowed: float in [0, 1)",
            ),
            ("dppo.r_0=0.5", "--set dppo.r_0=0.5: unknown key dppo.r_0"),
            (
                "rollout.n=\"eight\"",
                "rollout.n: got \"eight\", allowed: integer >= 2",
            ),
            (
                "actor.loss_agg=\"mean\"",
                "actor.loss_agg: got \"mean\", allowed: token-mean |",
            ),
            ("rollout.n=1", "invalid value for rollout.n: got 1"),
            ("bogus", "expected key=value"),
            (
                "dppo.candidate_frac=0",
                "dppo.candidate_frac: got 0, allowed: float in (0, 1]",
            ),
            ("dppo.mode=\"random\"", "dppo.mode: got \"random\""),
            (
                "dppo.candidates=\"lowest\"",
                "dppo.candidates: got \"lowest\"",
            ),
            ("logger=[\"tensorboard\"]", "logger: must include \"jsonl\""),
            ("logger=[\"wandb\"]", "logger: got [\"wandb\"]"),
            ("actor.lr=inf", "actor.lr: got inf, allowed: float > 0"),
            ("warmup.lr=nan", "warmup.lr: got nan, allowed: float > 0"),
            ("actor.weight_decay=nan", "actor.weight_decay"),
            (
                "actor.grad_clip=nan",
                "actor.grad_clip: got nan, allowed: float >= 0",
            ),
            (
                "resume=\"always\"",
                "resume: got \"always\", allowed: disable | auto",
            ),
            (
                "reward.overlong_buffer=8",
                "reward.overlong_buffer: must be less than rollout.max_response_len (8), got 8",
            ),
            (
                "reward.overlong_penalty=-1",
                "reward.overlong_penalty: got -1, allowed: float >= 0",
            ),
            (
                "reward.extract=\"lenient\"",
                "reward.extract: got \"lenient\"",
            ),
            ("reward.overlong=1", "unknown key reward.overlong"),
            (
                "device=\"gpu\"",
                "device: got \"gpu\", allowed: cpu | cuda | cuda:N",
            ),
            (
                "engine.gpu_memory_utilization=1.5",
                "engine.gpu_memory_utilization: got 1.5, allowed: float in (0, 1]",
            ),
            ("train.compute_dtype=f16", "allowed: auto | f32 | bf16"),
            (
                "checkpoint.keep=0",
                "checkpoint.keep: got 0, allowed: integer > 0",
            ),
            (
                "warmup.batch_size=0",
                "warmup.batch_size: got 0, allowed: integer > 0",
            ),
        ];
        for (set, want) in cases {
            let err = RunConfig::default_with(&[set.to_string()])
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "--set {set}: {err}");
            if set != "bogus" {
                assert!(err.starts_with(&format!("--set {set}: ")), "{err}");
            }
        }
        // A switch of the rope kernel without the kernel, named where it was set; the q/k
        // norms' switch, on by default, is ignored without it.
        let sets = [
            "engine.rope_kernel=false".to_string(),
            "engine.rope_writes_kv=true".to_string(),
        ];
        let err = RunConfig::default_with(&sets).unwrap_err().to_string();
        let want = "--set engine.rope_writes_kv=true: invalid value for engine.rope_writes_kv: \
                    is true with engine.rope_kernel";
        assert!(err.starts_with(want), "{err}");
        assert!(RunConfig::default_with(&sets[1..]).is_ok());
        assert!(RunConfig::default_with(&sets[..1]).is_ok());
        // Captured decode steps need the synchronous loop: no learner beside the capture.
        let graphs = ["engine.cuda_graphs=true".to_string()];
        let err = RunConfig::default_with(&graphs).unwrap_err().to_string();
        assert!(
            err.contains("set rollout.one_step_off_policy = false"),
            "{err}"
        );
        let sync = [
            graphs[0].clone(),
            "rollout.one_step_off_policy=false".to_string(),
        ];
        assert!(RunConfig::default_with(&sync).is_ok());
        let err = RunConfig::from_toml("model = ", "my.toml", &[])
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("my.toml:"), "{err}");
    }

    /// A file that leaves keys out gets the built-in default's values for them, those that
    /// `dppo config` prints; an error about such a key says where its value came from.
    #[test]
    fn a_partial_file_keeps_the_built_in_defaults() {
        let default = RunConfig::default_with(&[]).unwrap();
        let text = "model = \"builtin:tiny\"\n[rollout]\nn = 4\n[data]\nnum_train = 50\n";
        let partial = RunConfig::from_toml(text, "my.toml", &[]).unwrap();
        let mut want = default.clone();
        want.rollout.n = 4;
        want.data.num_train = 50;
        assert_eq!(partial, want);
        assert_ne!(partial, default);
        let err = error(
            "[rollout]\nmax_response_len = 4\n",
            &["reward.overlong_buffer=6"],
        );
        assert!(
            err.contains("must be less than rollout.max_response_len (4)"),
            "{err}"
        );
        let text = "[rollout]\nn = 4\n";
        let origins = super::Origins::new("my.toml", text, &[]);
        assert_eq!(origins.of("rollout.n"), "my.toml:2");
        assert_eq!(
            origins.of("actor.lr"),
            "my.toml (not set there: the built-in default)"
        );
        let default = super::Origins::new("configs/default.toml", DEFAULT_TOML, &[]);
        assert_eq!(default.of("engine.cuda_graphs"), "configs/default.toml");
    }

    #[test]
    fn a_value_where_a_table_belongs_is_named_as_such() {
        let err = error("rollout = 5\n", &[]);
        assert_eq!(
            err,
            "my.toml:1: rollout is a table of keys ([rollout], or rollout.NAME = VALUE), not 5"
        );
        let err = error("", &["data=1"]);
        assert!(
            err.starts_with("--set data=1: data is a table of keys"),
            "{err}"
        );
    }

    #[test]
    fn an_unknown_key_in_a_set_names_the_set() {
        let err = RunConfig::default_with(&["rollout.nn=3".to_string()])
            .unwrap_err()
            .to_string();
        assert!(
            err.starts_with("--set rollout.nn=3: unknown key rollout.nn"),
            "{err}"
        );
        assert!(
            err.contains("max_response_len"),
            "the table's keys are listed: {err}"
        );
        assert!(!err.contains("configs/default.toml"), "{err}");
    }

    #[test]
    fn a_bad_value_names_its_origin_key_and_allowed_values() {
        let (text, line) = with_line("checkpoint", "keep", "0");
        let err = error(&text, &[]);
        assert_eq!(
            err,
            format!(
                "my.toml:{line}: invalid value for checkpoint.keep: got 0, allowed: integer > 0"
            )
        );
        let (text, line) = with_line("warmup", "batch_size", "0");
        assert_eq!(
            error(&text, &[]),
            format!(
                "my.toml:{line}: invalid value for warmup.batch_size: got 0, allowed: integer > 0"
            )
        );
        let err = error(DEFAULT_TOML, &["checkpoint.keep=3", "checkpoint.keep=0"]);
        assert!(
            err.starts_with("--set checkpoint.keep=0: invalid value"),
            "{err}"
        );
        let err = error(DEFAULT_TOML, &["checkpoint={every = 5, keep = 0}"]);
        assert!(
            err.starts_with("--set checkpoint={every = 5, keep = 0}: invalid"),
            "{err}"
        );
        let text = DEFAULT_TOML.replace("\nn = 8\n", "\nnn = 8\n");
        let line = text.lines().position(|l| l == "nn = 8").unwrap() + 1;
        let err = error(&text, &[]);
        assert!(
            err.starts_with(&format!("my.toml:{line}: unknown key rollout.nn")),
            "{err}"
        );
    }

    #[test]
    fn a_rule_names_the_key_it_constrains() {
        let err = error(DEFAULT_TOML, &["reward.overlong_buffer=8"]);
        assert_eq!(
            err,
            "--set reward.overlong_buffer=8: invalid value for reward.overlong_buffer: must be \
             less than rollout.max_response_len (8), got 8"
        );
        let err = error(DEFAULT_TOML, &["actor.weight_decay=2500"]);
        assert!(
            err.contains("invalid value for actor.weight_decay: must have"),
            "{err}"
        );
    }

    #[test]
    fn a_reward_address_with_credentials_is_refused_without_echoing_them() {
        let text =
            format!("{DEFAULT_TOML}\n[reward]\nurl = \"http://me:hunter2@host:8000/score\"\n");
        let err = error(&text, &[]);
        assert!(err.contains("reward.url carries credentials"), "{err}");
        assert!(err.starts_with("my.toml:"), "{err}");
        assert!(!err.contains("hunter2"), "{err}");
        let err = error(DEFAULT_TOML, &["reward.url=http://me:hunter2@h/"]);
        assert!(
            err.starts_with("--set reward.url=(value not shown): invalid value for reward.url"),
            "{err}"
        );
        assert!(!err.contains("hunter2"), "{err}");
        let err = error(DEFAULT_TOML, &["reward.url=http:/me:hunter2@h"]);
        assert!(err.contains("reward.url carries credentials"), "{err}");
        let text = format!("{DEFAULT_TOML}\n[reward.functions.judge]\nurl = \"//me:hunter2@h/\"\n");
        let err = error(&text, &[]);
        assert!(
            err.contains("invalid value for reward.functions: reward.functions.judge.url carries"),
            "{err}"
        );
        assert!(!err.contains("hunter2"), "{err}");
        // An `@` after the host is part of the path, not a credential.
        for url in ["http://host:8000/a@b?c=d@e", "http://[::1]:80/x"] {
            let fine = format!("{DEFAULT_TOML}\n[reward]\nurl = \"{url}\"\n");
            RunConfig::from_toml(&fine, "my.toml", &[]).unwrap();
        }
    }
}
