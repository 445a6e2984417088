//! `[reward]`: the verifier's settings and, optionally, an external reward (what
//! `crate::reward` builds its scorer from).

use dppo_rewards::RewardConfig;
use serde::{Deserialize, Serialize};

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
        }
    }
}

impl RewardSettings {
    /// Whether an external reward scores completions (the verifier does otherwise).
    pub fn is_external(&self) -> bool {
        self.url.is_some() || self.command.is_some()
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
