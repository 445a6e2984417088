//! How completions are scored: the built-in math verifier, a reward server over HTTP
//! (`reward.url`) or a long-lived local process (`reward.command`), the last two speaking
//! OpenRLHF's remote reward protocol ([`protocol`]). A prompt's group is one request.

use std::collections::BTreeMap;
use std::time::Duration;

use dppo_rewards::{overlong_penalty, rule_name, verify, Answer, RewardSpec, Rule};
use serde::{Deserialize, Serialize};

pub use crate::config::reward::{OnError, RewardSettings};
use crate::config::RunConfig;
use crate::data::default_extract_mode;

mod command;
mod http;
pub mod protocol;

pub use protocol::RewardItem;

use command::CommandReward;
use http::HttpReward;

/// How the verifier scores `cfg`'s completions: `[reward]`, with the data set's default
/// extraction mode.
pub fn spec(cfg: &RunConfig) -> RewardSpec {
    let verifier = &cfg.reward.verifier;
    RewardSpec {
        mode: verifier
            .extract
            .unwrap_or_else(|| default_extract_mode(cfg.data.train.first())),
        max_tokens: cfg.rollout.max_response_len,
        overlong_buffer: verifier.overlong_buffer,
        overlong_penalty: verifier.overlong_penalty,
    }
}

/// Why an external reward gave no usable answer.
#[derive(Debug)]
pub enum Failure {
    /// This request failed (after its retries); `on_error` decides.
    Failed(String),
    /// The reward is gone (its process exited or hung): the run stops whatever `on_error`
    /// says.
    Fatal(String),
}

/// A reward that could not score a group.
#[derive(Debug, thiserror::Error)]
#[error("reward {backend}: {what}: {reason}")]
pub struct RewardFailure {
    /// The server or command.
    pub backend: String,
    /// The prompt whose group it was scoring.
    pub what: String,
    pub reason: String,
}

/// Counts over scored completions, summed across groups and ranks for the metrics line.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RewardTally {
    /// Completions whose answer each extraction rule found (`none`: no rule found one).
    #[serde(default)]
    pub extracted_by: BTreeMap<String, usize>,
    /// Completions the verifier found correct.
    #[serde(default)]
    pub num_correct: usize,
    /// Completions an external reward scored (they have no verdict).
    #[serde(default)]
    pub num_external: usize,
    /// Completions scored 0 because their reward failed (`on_error = "zero"`).
    #[serde(default)]
    pub errors: usize,
    /// Sum and count of each `extra_logs` value an external reward sent.
    #[serde(default)]
    pub logs: BTreeMap<String, (f64, usize)>,
}

impl RewardTally {
    /// Adds `other`'s counts.
    pub fn merge(&mut self, other: RewardTally) {
        for (rule, count) in other.extracted_by {
            *self.extracted_by.entry(rule).or_default() += count;
        }
        self.num_correct += other.num_correct;
        self.num_external += other.num_external;
        self.errors += other.errors;
        for (name, (sum, count)) in other.logs {
            let entry = self.logs.entry(name).or_default();
            entry.0 += sum;
            entry.1 += count;
        }
    }
}

/// One group's scores.
#[derive(Debug, Clone, PartialEq)]
pub struct ScoredGroup {
    /// One per completion.
    pub rewards: Vec<f64>,
    /// The rule that found each completion's answer (the verifier; `None` for an external
    /// reward, or where no rule found one).
    pub extracted_by: Vec<Option<Rule>>,
    pub tally: RewardTally,
}

/// What scores completions.
enum Backend {
    Verifier,
    Http(HttpReward),
    Command(CommandReward),
}

/// The run's reward: its backend, the overlong penalty and `on_error`.
pub struct Scorer {
    backend: Backend,
    spec: RewardSpec,
    on_error: OnError,
    concurrency: usize,
}

impl Scorer {
    /// The reward `settings` describe, scoring completions of at most `spec.max_tokens`:
    /// starts the reward process or reads the server's token.
    pub fn new(settings: &RewardSettings, spec: RewardSpec) -> Result<Self, String> {
        let timeout = Duration::from_secs_f64(settings.timeout_s);
        let (backend, concurrency) = match (&settings.url, &settings.command) {
            (Some(_), Some(_)) => {
                return Err("reward.url and reward.command are both set: choose one".into())
            }
            (Some(url), None) => {
                let token = match &settings.api_key_env {
                    Some(var) => Some(std::env::var(var).map_err(|_| {
                        format!(
                            "reward.api_key_env names {var}, which is not set in the \
                             environment"
                        )
                    })?),
                    None => None,
                };
                let http = HttpReward::new(url, token, timeout, settings.max_retries)
                    .map_err(|e| format!("reward.url: {e}"))?;
                (Backend::Http(http), settings.concurrency.max(1))
            }
            (None, Some(argv)) => {
                let command = CommandReward::start(argv, timeout)
                    .map_err(|e| format!("reward.command: {e}"))?;
                (Backend::Command(command), 1)
            }
            (None, None) => (Backend::Verifier, 1),
        };
        Ok(Self {
            backend,
            spec,
            on_error: settings.on_error,
            concurrency,
        })
    }

    /// The built-in verifier with `spec`.
    pub fn verifier(spec: RewardSpec) -> Self {
        Self {
            backend: Backend::Verifier,
            spec,
            on_error: OnError::Fail,
            concurrency: 1,
        }
    }

    /// Groups worth scoring at once (requests in flight to a server).
    pub fn concurrency(&self) -> usize {
        self.concurrency
    }

    /// Whether completions go to an external reward (which needs no parsed gold answer).
    pub fn is_external(&self) -> bool {
        !matches!(self.backend, Backend::Verifier)
    }

    /// The verifier's settings.
    pub fn spec(&self) -> &RewardSpec {
        &self.spec
    }

    /// Scores one prompt's completions `items` (`gold`: its parsed answer, which the
    /// verifier needs; `what`: the prompt, for errors). `penalty`: add the overlong
    /// penalty (training), or not (evaluation measures the task's score).
    pub fn score(
        &self,
        items: &[RewardItem],
        gold: Option<&Answer>,
        what: &str,
        penalty: bool,
    ) -> Result<ScoredGroup, RewardFailure> {
        let fail = |(backend, reason): (String, String)| RewardFailure {
            backend,
            what: what.to_string(),
            reason,
        };
        let answer = match &self.backend {
            Backend::Verifier => return self.verifier_scores(items, gold, penalty).map_err(fail),
            Backend::Http(http) => self.external(http.url(), items, |b| http.exchange(b)),
            Backend::Command(command) => {
                self.external(&command.describe(), items, |b| command.exchange(b))
            }
        }
        .map_err(fail)?;
        let mut tally = RewardTally {
            num_external: items.len(),
            ..RewardTally::default()
        };
        let mut rewards = match answer {
            Some(answer) => {
                for (name, values) in answer.extra_logs {
                    let entry = tally.logs.entry(name).or_default();
                    entry.0 += values.iter().sum::<f64>();
                    entry.1 += values.len();
                }
                answer.rewards
            }
            None => {
                tally.errors = items.len();
                vec![0.0; items.len()]
            }
        };
        if penalty {
            for (reward, item) in rewards.iter_mut().zip(items) {
                *reward += overlong_penalty(item.num_tokens, &self.spec)
                    .map_err(|e| fail(("overlong penalty".into(), e.to_string())))?;
            }
        }
        Ok(ScoredGroup {
            extracted_by: vec![None; rewards.len()],
            rewards,
            tally,
        })
    }

    /// The verifier's rewards (with the overlong penalty when `penalty`, else the verdict).
    fn verifier_scores(
        &self,
        items: &[RewardItem],
        gold: Option<&Answer>,
        penalty: bool,
    ) -> Result<ScoredGroup, (String, String)> {
        let fail = |reason: String| ("verifier".to_string(), reason);
        let gold = gold.ok_or_else(|| fail("no parseable gold answer to verify against".into()))?;
        let mut tally = RewardTally::default();
        let mut rewards = Vec::with_capacity(items.len());
        let mut extracted_by = Vec::with_capacity(items.len());
        for item in items {
            let verdict = verify(&item.completion, item.is_truncated, gold, self.spec.mode);
            let correct = f64::from(u8::from(verdict.is_correct));
            let rule = rule_name(verdict.extracted_by).to_string();
            *tally.extracted_by.entry(rule).or_default() += 1;
            tally.num_correct += usize::from(verdict.is_correct);
            extracted_by.push(verdict.extracted_by);
            rewards.push(match penalty {
                true => {
                    correct
                        + overlong_penalty(item.num_tokens, &self.spec)
                            .map_err(|e| fail(e.to_string()))?
                }
                false => correct,
            });
        }
        Ok(ScoredGroup {
            rewards,
            extracted_by,
            tally,
        })
    }

    /// One request to an external reward: its checked answer, `None` when it failed and
    /// `on_error = "zero"` forgives it, or (backend, reason) of the error that stops the run.
    fn external(
        &self,
        backend: &str,
        items: &[RewardItem],
        exchange: impl Fn(&str) -> Result<String, Failure>,
    ) -> Result<Option<protocol::Answer>, (String, String)> {
        let body = protocol::Request::new(items).to_line();
        let answer = exchange(&body)
            .and_then(|text| protocol::parse_answer(&text, items.len()).map_err(Failure::Failed));
        match answer {
            Ok(answer) => Ok(Some(answer)),
            Err(Failure::Failed(reason)) if self.on_error == OnError::Zero => {
                tracing::warn!("reward {backend}: {reason}; scoring the group 0 (on_error)");
                Ok(None)
            }
            Err(Failure::Failed(reason) | Failure::Fatal(reason)) => {
                Err((backend.to_string(), reason))
            }
        }
    }
}
