//! `[reward]`: the verifier's settings and, optionally, an external reward, named rewards,
//! a weighted sum of them and a choice by data source (what `crate::reward` builds its
//! scorer from).

use std::collections::BTreeMap;

use dppo_rewards::{ExtractMode, RewardConfig};
use serde::{Deserialize, Serialize};

/// Names that `reward.combine` and `reward.routes` may use without defining them: the
/// verifier with `[reward]`'s settings, and `reward.url` and `reward.command` when set.
pub const BUILT_IN_NAMES: [&str; 3] = ["verifier", "url", "command"];

/// One named reward of `reward.functions`: a server, a process, or the verifier with an
/// extraction mode of its own (the other settings are `[reward]`'s).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardFunction {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extract: Option<ExtractMode>,
}

/// A weighted sum of named rewards.
pub type Weights = BTreeMap<String, f64>;

/// `[reward]`: the verifier's settings and, optionally, an external reward.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RewardSettings {
    #[serde(flatten)]
    pub verifier: RewardConfig,
    /// A reward server speaking OpenRLHF's protocol (`http://host:port/path`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub url: Option<String>,
    /// A reward process: program and arguments, speaking the protocol as JSON lines.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub command: Option<Vec<String>>,
    /// The environment variable holding the server's bearer token (the token itself is
    /// never written to the config or the logs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api_key_env: Option<String>,
    /// Seconds one request may take (each attempt, for a server).
    #[serde(default = "default_timeout_s")]
    pub timeout_s: f64,
    /// Retries of a server request that failed in a way that may pass.
    #[serde(default = "default_max_retries")]
    pub max_retries: u32,
    /// Requests to a server in flight at once.
    #[serde(default = "default_concurrency")]
    pub concurrency: usize,
    /// What a failed or malformed answer does: stop the run, or score 0 and count it.
    #[serde(default)]
    pub on_error: OnError,
    /// Named rewards beyond the verifier, `url` and `command`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub functions: BTreeMap<String, RewardFunction>,
    /// Every data source's reward as a weighted sum of named rewards (unset: the one of
    /// `url`, `command` or the verifier).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub combine: Option<Weights>,
    /// A data source's reward as a weighted sum of named rewards, in place of `combine`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub routes: BTreeMap<String, Weights>,
}

fn default_timeout_s() -> f64 {
    60.0
}
fn default_max_retries() -> u32 {
    3
}
fn default_concurrency() -> usize {
    8
}

impl Default for RewardSettings {
    fn default() -> Self {
        Self {
            verifier: RewardConfig::default(),
            url: None,
            command: None,
            api_key_env: None,
            timeout_s: default_timeout_s(),
            max_retries: default_max_retries(),
            concurrency: default_concurrency(),
            on_error: OnError::default(),
            functions: BTreeMap::new(),
            combine: None,
            routes: BTreeMap::new(),
        }
    }
}

impl RewardSettings {
    /// Whether an external reward scores some completions (then a label need not be a
    /// math answer; where the verifier scores, an unparseable one is an error there).
    pub fn is_external(&self) -> bool {
        let named = |w: &Weights| {
            w.keys()
                .any(|n| n != "verifier" && self.is_named_external(n))
        };
        match &self.combine {
            Some(weights) => named(weights) || self.routes.values().any(named),
            None => self.url.is_some() || self.command.is_some() || self.routes.values().any(named),
        }
    }

    /// What the held-out evaluation's mean reward is: the verifier's is an accuracy, another
    /// reward's only its mean.
    pub fn held_out_measure(&self) -> &'static str {
        match self.is_external() {
            true => "held-out mean reward",
            false => "held-out accuracy",
        }
    }

    /// Whether the named reward `name` is a server or a process.
    fn is_named_external(&self, name: &str) -> bool {
        match name {
            "url" | "command" => true,
            other => self
                .functions
                .get(other)
                .is_some_and(|f| f.url.is_some() || f.command.is_some()),
        }
    }

    /// The names `combine` and `routes` may use: the built-in ones that are set, then
    /// `functions`.
    pub fn names(&self) -> Vec<&str> {
        let mut names = vec!["verifier"];
        names.extend(self.url.as_ref().map(|_| "url"));
        names.extend(self.command.as_ref().map(|_| "command"));
        names.extend(self.functions.keys().map(String::as_str));
        names
    }
}

/// `reward.on_error`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnError {
    /// The run stops, naming the prompt and the reason.
    #[default]
    Fail,
    /// The group scores 0 and counts in `reward/errors`.
    Zero,
}
