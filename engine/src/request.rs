//! What callers send to the engine and what comes back.

use crate::sampler::SamplingParams;
use crate::sequence::{FinishReason, Priority};

/// One prompt to complete `n` times.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    /// Samples of this prompt (GRPO's G); they share the prompt's KV blocks.
    pub n: usize,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Strings that end a sample when they appear in its output text.
    pub stop: Vec<String>,
    /// Keep generating past EOS tokens (benchmarks with a fixed token count).
    pub ignore_eos: bool,
    pub priority: Priority,
    /// Every token from one policy version: weights published while it runs wait until
    /// it finishes (a training step's rollout).
    pub pin_policy_version: bool,
}

impl GenerateRequest {
    /// A request with default sampling and no stop strings.
    pub fn new(prompt_ids: Vec<u32>, n: usize, max_tokens: usize) -> Self {
        Self {
            prompt_ids,
            n,
            max_tokens,
            sampling: SamplingParams::default(),
            stop: Vec::new(),
            ignore_eos: false,
            priority: Priority::Normal,
            pin_policy_version: false,
        }
    }
}

/// Streamed output of a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A new token of sample `sample_index`.
    Token {
        sample_index: usize,
        token_id: u32,
        logprob: f32,
        model_logprob: Option<f32>,
        /// The `top_logprobs` most likely tokens of the untempered distribution, when asked.
        top_logprobs: Vec<(u32, f32)>,
        policy_version: u64,
    },
    /// Sample `sample_index` is done.
    Finished {
        sample_index: usize,
        reason: FinishReason,
    },
}

/// One finished sample, assembled from its events.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub sample_index: usize,
    pub token_ids: Vec<u32>,
    /// Log-probability of each token under the distribution it was sampled from.
    pub logprobs: Vec<f32>,
    /// Untempered model log-probabilities, when requested.
    pub model_logprobs: Option<Vec<f32>>,
    /// Per token, the most likely alternatives (empty unless `top_logprobs` was asked).
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    pub finish_reason: FinishReason,
    /// Policy version of the first and of the last token (equal unless weights were
    /// swapped while this sample was generating).
    pub policy_version: u64,
    pub last_policy_version: u64,
}

impl Completion {
    /// A sample with no token yet; its finish reason stays `Cancelled` until it finishes.
    pub fn empty(sample_index: usize) -> Self {
        Self {
            sample_index,
            token_ids: Vec::new(),
            logprobs: Vec::new(),
            model_logprobs: None,
            top_logprobs: Vec::new(),
            finish_reason: FinishReason::Cancelled,
            policy_version: 0,
            last_policy_version: 0,
        }
    }

    /// Folds one request's events into its completions, ordered by sample index.
    pub fn from_events(n: usize, events: impl IntoIterator<Item = Event>) -> Vec<Completion> {
        let mut out: Vec<Completion> = (0..n).map(Completion::empty).collect();
        for event in events {
            match event {
                Event::Token {
                    sample_index,
                    token_id,
                    logprob,
                    model_logprob,
                    top_logprobs,
                    policy_version,
                } => {
                    let c = &mut out[sample_index];
                    if c.token_ids.is_empty() {
                        c.policy_version = policy_version;
                    }
                    c.last_policy_version = policy_version;
                    c.token_ids.push(token_id);
                    c.logprobs.push(logprob);
                    if let Some(lp) = model_logprob {
                        c.model_logprobs.get_or_insert_with(Vec::new).push(lp);
                    }
                    if !top_logprobs.is_empty() {
                        c.top_logprobs.push(top_logprobs);
                    }
                }
                Event::Finished {
                    sample_index,
                    reason,
                } => out[sample_index].finish_reason = reason,
            }
        }
        out
    }
}

/// Byte offset of the earliest stop-string match in `text`.
pub fn find_stop(text: &str, stop: &[String]) -> Option<usize> {
    stop.iter().filter_map(|s| text.find(s.as_str())).min()
}
