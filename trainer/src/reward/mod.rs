//! How completions are scored: the built-in math verifier, a reward server over HTTP
//! (`reward.url`) or a long-lived local process (`reward.command`), the last two speaking
//! OpenRLHF's remote reward protocol ([`protocol`]). A prompt's group is one request.

use std::collections::BTreeMap;
use std::time::Duration;

use dppo_rewards::{overlong_penalty, rule_name, verify, Answer, ExtractMode, RewardSpec, Rule};
use serde::{Deserialize, Serialize};

pub use crate::config::reward::{OnError, RewardSettings, Weights};
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

/// Why the run's reward cannot start (checked when the run starts); each names the config
/// key at fault.
#[derive(Debug, thiserror::Error)]
pub enum SetupError {
    #[error(
        "reward.url and reward.command are both set: choose one, or weigh both in \
         reward.combine"
    )]
    UrlAndCommand,
    /// A reward in `reward.combine` or `reward.routes` that no key defines.
    #[error(
        "reward.combine or reward.routes weighs a reward named {0:?}, which neither \
         reward.functions nor the built-in names (verifier, url, command) define"
    )]
    Unknown(String),
    #[error("reward.api_key_env names {0}, which is not set in the environment")]
    TokenUnset(String),
    /// The server or process that `key` sets cannot be used.
    #[error("{key}: {source}")]
    Start { key: String, source: StartError },
}

/// Why a reward server or process cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error(
        "{0}: https is not supported (dppo is built without TLS); reach the server over \
         http, through a local proxy or an SSH tunnel"
    )]
    Https(String),
    #[error("{0}: not an http:// address")]
    NotHttp(String),
    #[error("the command is empty: give the program and its arguments")]
    EmptyCommand,
    #[error("cannot start {command}: {source}")]
    Spawn {
        command: String,
        source: std::io::Error,
    },
    #[error("starting the reader of {command}: {source}")]
    Reader {
        command: String,
        source: std::io::Error,
    },
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
    Verifier(ExtractMode),
    Http(HttpReward),
    Command(CommandReward),
}

/// A weighted sum of named backends.
type Route = Vec<(String, f64)>;

/// The run's reward: its named backends, the weighted sum each data source gets, the
/// overlong penalty and `on_error`.
pub struct Scorer {
    backends: BTreeMap<String, Backend>,
    /// Every data source's reward, unless `routes` has one for it.
    default: Route,
    routes: BTreeMap<String, Route>,
    /// Whether rewards are composed (`reward.combine` or `reward.routes`): each part's mean
    /// is logged as `reward/<name>/mean`.
    composed: bool,
    spec: RewardSpec,
    on_error: OnError,
    concurrency: usize,
}

impl Scorer {
    /// The reward `settings` describe, scoring completions of at most `spec.max_tokens`:
    /// starts the reward processes and reads the servers' token.
    pub fn new(settings: &RewardSettings, spec: RewardSpec) -> Result<Self, SetupError> {
        let route = |w: &Weights| -> Route { w.iter().map(|(n, w)| (n.clone(), *w)).collect() };
        let default = match (&settings.combine, &settings.url, &settings.command) {
            (Some(weights), _, _) => route(weights),
            (None, Some(_), Some(_)) => return Err(SetupError::UrlAndCommand),
            (None, Some(_), None) => vec![("url".into(), 1.0)],
            (None, None, Some(_)) => vec![("command".into(), 1.0)],
            (None, None, None) => vec![("verifier".into(), 1.0)],
        };
        let routes: BTreeMap<String, Route> = settings
            .routes
            .iter()
            .map(|(source, w)| (source.clone(), route(w)))
            .collect();
        let mut backends = BTreeMap::new();
        for (name, _) in default.iter().chain(routes.values().flatten()) {
            if !backends.contains_key(name) {
                backends.insert(name.clone(), backend(settings, name, spec.mode)?);
            }
        }
        let concurrency = match backends.values().any(|b| matches!(b, Backend::Http(_))) {
            true => settings.concurrency.max(1),
            false => 1,
        };
        Ok(Self {
            backends,
            default,
            routes,
            composed: settings.combine.is_some() || !settings.routes.is_empty(),
            spec,
            on_error: settings.on_error,
            concurrency,
        })
    }

    /// Groups worth scoring at once (requests in flight to servers).
    pub fn concurrency(&self) -> usize {
        self.concurrency
    }

    /// Whether some completions go to an external reward (which needs the prompt's text).
    pub fn is_external(&self) -> bool {
        self.backends
            .values()
            .any(|b| !matches!(b, Backend::Verifier(_)))
    }

    /// Scores one prompt's completions `items` (of one data source) with that source's
    /// weighted sum (`gold`: the parsed answer, which the verifier needs; `what`: the
    /// prompt, for errors). `penalty`: add the overlong penalty (training), or not
    /// (evaluation measures the task's score).
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
        let route = items
            .first()
            .and_then(|i| self.routes.get(&i.data_source))
            .unwrap_or(&self.default);
        let n = items.len();
        let mut scored = ScoredGroup {
            rewards: vec![0.0; n],
            extracted_by: vec![None; n],
            tally: RewardTally::default(),
        };
        let mut verified = false;
        for (name, weight) in route {
            let part = match &self.backends[name] {
                Backend::Verifier(mode) => {
                    verified = true;
                    let part = self.verifier_scores(items, gold, *mode).map_err(fail)?;
                    scored.extracted_by = part.extracted_by;
                    scored.tally.merge(part.tally);
                    part.rewards
                }
                Backend::Http(http) => {
                    let exchange = |b: &str| http.exchange(b);
                    let part = self.external(http.url(), items, exchange).map_err(fail)?;
                    self.answer_rewards(part, n, &mut scored.tally)
                }
                Backend::Command(command) => {
                    let exchange = |b: &str| command.exchange(b);
                    let part = self.external(&command.describe(), items, exchange);
                    self.answer_rewards(part.map_err(fail)?, n, &mut scored.tally)
                }
            };
            if self.composed {
                let entry = scored.tally.logs.entry(name.clone()).or_default();
                entry.0 += part.iter().sum::<f64>();
                entry.1 += n;
            }
            for (total, r) in scored.rewards.iter_mut().zip(part) {
                *total += weight * r;
            }
        }
        if !verified {
            scored.tally.num_external = n;
        }
        if penalty {
            for (reward, item) in scored.rewards.iter_mut().zip(items) {
                *reward += overlong_penalty(item.num_tokens, &self.spec)
                    .map_err(|e| fail(("overlong penalty".into(), e.to_string())))?;
            }
        }
        Ok(scored)
    }

    /// An external answer's rewards (0s, counted as errors, when `on_error` forgave a
    /// failure), its `extra_logs` added to `tally`.
    fn answer_rewards(
        &self,
        answer: Option<protocol::Answer>,
        n: usize,
        tally: &mut RewardTally,
    ) -> Vec<f64> {
        match answer {
            Some(answer) => {
                for (name, values) in answer.extra_logs {
                    let entry = tally.logs.entry(name).or_default();
                    entry.0 += values.iter().sum::<f64>();
                    entry.1 += values.len();
                }
                answer.rewards
            }
            None => {
                tally.errors = n;
                vec![0.0; n]
            }
        }
    }

    /// The verifier's verdicts in extraction `mode` (1 when correct, else 0).
    fn verifier_scores(
        &self,
        items: &[RewardItem],
        gold: Option<&Answer>,
        mode: ExtractMode,
    ) -> Result<ScoredGroup, (String, String)> {
        let fail = |reason: String| ("verifier".to_string(), reason);
        let gold = gold.ok_or_else(|| fail("no parseable gold answer to verify against".into()))?;
        let mut tally = RewardTally::default();
        let mut rewards = Vec::with_capacity(items.len());
        let mut extracted_by = Vec::with_capacity(items.len());
        for item in items {
            let verdict = verify(&item.completion, item.is_truncated, gold, mode);
            let rule = rule_name(verdict.extracted_by).to_string();
            *tally.extracted_by.entry(rule).or_default() += 1;
            tally.num_correct += usize::from(verdict.is_correct);
            extracted_by.push(verdict.extracted_by);
            rewards.push(f64::from(u8::from(verdict.is_correct)));
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

/// The backend of the reward `name`: the verifier (in `mode`, or a function's own), the
/// server `reward.url` or the process `reward.command`, or a named function's.
fn backend(
    settings: &RewardSettings,
    name: &str,
    mode: ExtractMode,
) -> Result<Backend, SetupError> {
    let timeout = Duration::from_secs_f64(settings.timeout_s);
    let start = |key: &str| {
        let key = key.to_string();
        move |source| SetupError::Start { key, source }
    };
    let http = |url: &str, key: &str| {
        let token = match &settings.api_key_env {
            Some(var) => Some(std::env::var(var).map_err(|_| SetupError::TokenUnset(var.clone()))?),
            None => None,
        };
        HttpReward::new(url, token, timeout, settings.max_retries)
            .map(Backend::Http)
            .map_err(start(key))
    };
    let command = |argv: &[String], key: &str| {
        CommandReward::start(argv, timeout)
            .map(Backend::Command)
            .map_err(start(key))
    };
    match (name, settings.functions.get(name)) {
        ("verifier", _) => Ok(Backend::Verifier(mode)),
        ("url", _) => http(settings.url.as_deref().unwrap_or_default(), "reward.url"),
        ("command", _) => command(
            settings.command.as_deref().unwrap_or_default(),
            "reward.command",
        ),
        (_, Some(f)) => {
            let key = format!("reward.functions.{name}");
            match (&f.url, &f.command) {
                (Some(url), _) => http(url, &key),
                (None, Some(argv)) => command(argv, &key),
                (None, None) => Ok(Backend::Verifier(f.extract.unwrap_or(mode))),
            }
        }
        (_, None) => Err(SetupError::Unknown(name.to_string())),
    }
}
