//! OpenAI request and response bodies, the subset dppo serves. Parsing turns a request
//! into a [`Job`] or an [`ApiError`] naming the parameter; a parameter that would change
//! what is generated and that dppo does not implement is refused, never ignored.

use std::collections::BTreeMap;

use dppo_engine::{SamplingParams, MAX_TOP_LOGPROBS};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::ApiError;

/// Body of `/v1/completions` and `/v1/chat/completions` (one type: the endpoints share
/// most parameters; each reads its own).
#[derive(Debug, Deserialize)]
pub struct ApiRequest {
    /// Optional, as in vLLM: absent means the served model.
    pub model: Option<String>,
    /// Completions: a string, a list of strings, a list of token ids or of id lists.
    pub prompt: Option<Value>,
    /// Chat: the conversation.
    pub messages: Option<Vec<Message>>,
    pub n: Option<usize>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// vLLM's extension; 0 or -1 disable it.
    pub top_k: Option<i64>,
    /// vLLM's extension; 0 disables it.
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub stop: Option<Value>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Completions: how many alternatives per token (0 = just the token); chat: a bool.
    pub logprobs: Option<Value>,
    /// Chat: alternatives per token.
    pub top_logprobs: Option<usize>,
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<usize>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub logit_bias: Option<BTreeMap<String, f32>>,
    pub tools: Option<Vec<Value>>,
    pub response_format: Option<Value>,
    /// vLLM's extension: generate past EOS up to `max_tokens` (benchmarks).
    pub ignore_eos: Option<bool>,
    /// Every other parameter: refused where [`UNIMPLEMENTED`] names it with a value that
    /// changes the output, ignored otherwise (as `user` or `store`).
    #[serde(flatten)]
    pub other: BTreeMap<String, Value>,
}

/// vLLM's parameters that change what is generated and that dppo does not implement, each
/// with the values that leave generation as it is (clients send defaults; `null` always
/// passes).
const UNIMPLEMENTED: &[(&str, &str)] = &[
    ("repetition_penalty", "1"),
    ("length_penalty", "1"),
    ("min_tokens", "0"),
    ("stop_token_ids", "[]"),
    ("include_stop_str_in_output", "false"),
    ("allowed_token_ids", "[]"),
    ("bad_words", "[]"),
    ("use_beam_search", "false"),
    ("prompt_logprobs", "0"),
    ("truncate_prompt_tokens", "null"),
    ("skip_special_tokens", "true"),
    ("spaces_between_special_tokens", "true"),
    ("return_tokens_as_token_ids", "false"),
    ("logits_processors", "[]"),
    ("guided_json", "null"),
    ("guided_regex", "null"),
    ("guided_choice", "null"),
    ("guided_grammar", "null"),
    ("guided_decoding_backend", "null"),
    ("guided_whitespace_pattern", "null"),
    ("structured_outputs", "null"),
    ("add_generation_prompt", "true"),
    ("continue_final_message", "false"),
    ("chat_template", "null"),
    ("chat_template_kwargs", "{}"),
    ("documents", "null"),
    ("mm_processor_kwargs", "null"),
];

/// Whether `value` is `null` or equals the JSON `neutral` (numbers compared as numbers).
fn is_neutral(value: &Value, neutral: &str) -> bool {
    let neutral: Value = serde_json::from_str(neutral).expect("valid JSON in UNIMPLEMENTED");
    match (value, &neutral) {
        (Value::Null, _) => true,
        (Value::Number(a), Value::Number(b)) => a.as_f64() == b.as_f64(),
        _ => *value == neutral,
    }
}

/// `stream_options`
#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// One chat message; `content` is a string or a list of text parts.
#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: Option<Value>,
}

/// What a request asks the engine for, validated.
#[derive(Debug)]
pub struct Job {
    /// Token ids of each prompt (completions may carry several).
    pub prompts: Vec<Vec<u32>>,
    pub n: usize,
    /// `None`: up to the end of the context.
    pub max_tokens: Option<usize>,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    pub stream: bool,
    pub include_usage: bool,
    /// Alternatives per token when logprobs were asked for.
    pub logprobs: Option<usize>,
    pub ignore_eos: bool,
}

/// A prompt before tokenisation.
pub enum PromptInput {
    Text(String),
    Ids(Vec<u32>),
}

/// Completions' default `max_tokens`, as OpenAI's.
const DEFAULT_COMPLETION_TOKENS: usize = 16;

impl ApiRequest {
    /// Parses a body; a JSON or type error names the parameter at fault.
    pub fn parse(body: &[u8]) -> Result<Self, ApiError> {
        let de = &mut serde_json::Deserializer::from_slice(body);
        serde_path_to_error::deserialize(de).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            if inner.is_syntax() || inner.is_eof() || path == "." {
                ApiError::bad_request(format!("invalid JSON body: {inner}"), None)
            } else {
                ApiError::bad_request(format!("{path}: {inner}"), Some(&path))
            }
        })
    }

    /// The completions prompts, as text or token ids.
    pub fn completion_prompts(&self) -> Result<Vec<PromptInput>, ApiError> {
        let bad = || {
            ApiError::bad_request(
                "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists".to_string(),
                Some("prompt"),
            )
        };
        let ids = |v: &[Value]| -> Option<Vec<u32>> {
            v.iter()
                .map(|x| x.as_u64().and_then(|i| u32::try_from(i).ok()))
                .collect()
        };
        let prompts = match self.prompt.as_ref() {
            None => {
                return Err(ApiError::bad_request(
                    "prompt is required".to_string(),
                    Some("prompt"),
                ))
            }
            Some(Value::String(s)) => vec![PromptInput::Text(s.clone())],
            Some(Value::Array(items)) if items.is_empty() => return Err(bad()),
            Some(Value::Array(items)) => match &items[0] {
                Value::String(_) => items
                    .iter()
                    .map(|x| x.as_str().map(|s| PromptInput::Text(s.to_string())))
                    .collect::<Option<_>>()
                    .ok_or_else(bad)?,
                Value::Number(_) => vec![PromptInput::Ids(ids(items).ok_or_else(bad)?)],
                Value::Array(_) => items
                    .iter()
                    .map(|x| x.as_array().and_then(|a| ids(a)).map(PromptInput::Ids))
                    .collect::<Option<_>>()
                    .ok_or_else(bad)?,
                _ => return Err(bad()),
            },
            Some(_) => return Err(bad()),
        };
        Ok(prompts)
    }

    /// The chat messages as (role, text) pairs.
    pub fn chat_messages(&self) -> Result<Vec<(String, String)>, ApiError> {
        let messages = match &self.messages {
            Some(m) if !m.is_empty() => m,
            _ => {
                return Err(ApiError::bad_request(
                    "messages must be a non-empty list".to_string(),
                    Some("messages"),
                ))
            }
        };
        messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let param = format!("messages[{i}]");
                if !matches!(
                    m.role.as_str(),
                    "system" | "developer" | "user" | "assistant"
                ) {
                    return Err(ApiError::bad_request(
                        format!(
                            "{param}.role: {:?} is not supported (system, developer, user, assistant)",
                            m.role
                        ),
                        Some(&param),
                    ));
                }
                let role = if m.role == "developer" {
                    "system"
                } else {
                    &m.role
                };
                Ok((role.to_string(), message_text(m, &param)?))
            })
            .collect()
    }

    /// Validates everything but the prompt and builds the job around `prompts`.
    pub fn job(&self, chat: bool, prompts: Vec<Vec<u32>>) -> Result<Job, ApiError> {
        self.refuse_unsupported()?;
        let n = self.n.unwrap_or(1);
        if let Some(best_of) = self.best_of {
            if best_of != n {
                return Err(ApiError::bad_request(
                    format!("best_of ({best_of}) different from n ({n}) is not supported"),
                    Some("best_of"),
                ));
            }
        }
        let max_tokens = if chat {
            self.max_completion_tokens.or(self.max_tokens)
        } else {
            Some(self.max_tokens.unwrap_or(DEFAULT_COMPLETION_TOKENS))
        };
        let top_k = match self.top_k {
            None | Some(-1) | Some(0) => 0,
            Some(k) if k > 0 => k as usize,
            Some(k) => {
                return Err(ApiError::bad_request(
                    format!("top_k must be positive, or 0 or -1 to disable it, got {k}"),
                    Some("top_k"),
                ))
            }
        };
        let logprobs = if chat {
            self.chat_logprobs()?
        } else {
            self.completion_logprobs()?
        };
        let sampling = SamplingParams {
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.unwrap_or(1.0),
            min_p: self.min_p.unwrap_or(0.0),
            top_k,
            seed: self.seed,
            model_logprobs: logprobs.is_some(),
            top_logprobs: logprobs.unwrap_or(0),
        };
        let stream = self.stream.unwrap_or(false);
        Ok(Job {
            prompts,
            n,
            max_tokens,
            sampling,
            stop: self.stop_strings()?,
            stream,
            include_usage: stream
                && self
                    .stream_options
                    .as_ref()
                    .is_some_and(|o| o.include_usage),
            logprobs,
            ignore_eos: self.ignore_eos.unwrap_or(false),
        })
    }

    fn completion_logprobs(&self) -> Result<Option<usize>, ApiError> {
        match &self.logprobs {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64() {
                Some(k) if k as usize <= MAX_TOP_LOGPROBS => Ok(Some(k as usize)),
                _ => Err(ApiError::bad_request(
                    format!("logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {v}"),
                    Some("logprobs"),
                )),
            },
        }
    }

    fn chat_logprobs(&self) -> Result<Option<usize>, ApiError> {
        let wanted = match &self.logprobs {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(ApiError::bad_request(
                    format!("logprobs must be a boolean, got {v}"),
                    Some("logprobs"),
                ))
            }
        };
        match (wanted, self.top_logprobs.unwrap_or(0)) {
            (_, k) if k > MAX_TOP_LOGPROBS => Err(ApiError::bad_request(
                format!("top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {k}"),
                Some("top_logprobs"),
            )),
            (false, k) if k > 0 => Err(ApiError::bad_request(
                "top_logprobs needs logprobs set to true".to_string(),
                Some("top_logprobs"),
            )),
            (true, k) => Ok(Some(k)),
            (false, _) => Ok(None),
        }
    }

    fn stop_strings(&self) -> Result<Vec<String>, ApiError> {
        let bad = || {
            ApiError::bad_request(
                "stop must be a string or a list of strings".to_string(),
                Some("stop"),
            )
        };
        match &self.stop {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::String(s)) => Ok(vec![s.clone()]),
            Some(Value::Array(items)) => items
                .iter()
                .map(|x| x.as_str().map(str::to_string))
                .collect::<Option<_>>()
                .ok_or_else(bad),
            Some(_) => Err(bad()),
        }
    }

    /// Parameters that would change the output and that dppo does not implement.
    fn refuse_unsupported(&self) -> Result<(), ApiError> {
        let refuse = |param: &str, what: &str| {
            Err(ApiError::bad_request(
                format!("{param}: {what} is not supported by this server"),
                Some(param),
            ))
        };
        if self.echo == Some(true) {
            return refuse("echo", "echoing the prompt");
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return refuse("suffix", "a suffix (insertion)");
        }
        if self.frequency_penalty.is_some_and(|p| p != 0.0) {
            return refuse("frequency_penalty", "a non-zero penalty");
        }
        if self.presence_penalty.is_some_and(|p| p != 0.0) {
            return refuse("presence_penalty", "a non-zero penalty");
        }
        if self.logit_bias.as_ref().is_some_and(|b| !b.is_empty()) {
            return refuse("logit_bias", "a logit bias");
        }
        if self.tools.as_ref().is_some_and(|t| !t.is_empty()) {
            return refuse("tools", "tool calling");
        }
        if let Some(format) = &self.response_format {
            if format.get("type").and_then(Value::as_str) != Some("text") {
                return refuse("response_format", "a response format other than text");
            }
        }
        for (param, neutral) in UNIMPLEMENTED {
            if let Some(value) = self.other.get(*param) {
                if !is_neutral(value, neutral) {
                    let shown: String = value.to_string().chars().take(40).collect();
                    return refuse(param, &format!("{param} = {shown}"));
                }
            }
        }
        Ok(())
    }
}

fn message_text(m: &Message, param: &str) -> Result<String, ApiError> {
    match &m.content {
        None | Some(Value::Null) => Ok(String::new()),
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(parts)) => parts
            .iter()
            .map(
                |p| match (p.get("type").and_then(Value::as_str), p.get("text")) {
                    (Some("text"), Some(Value::String(t))) => Ok(t.as_str()),
                    _ => Err(ApiError::bad_request(
                        format!("{param}.content: only text parts are supported"),
                        Some(param),
                    )),
                },
            )
            .collect::<Result<Vec<_>, _>>()
            .map(|t| t.join("\n")),
        Some(_) => Err(ApiError::bad_request(
            format!("{param}.content must be a string or a list of text parts"),
            Some(param),
        )),
    }
}

/// `usage`
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
}

impl Usage {
    /// Usage of `prompt` and `completion` tokens.
    pub fn new(prompt: usize, completion: usize) -> Self {
        Self {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
        }
    }
}

/// A completion or chat response, or one chunk of a stream.
#[derive(Debug, Serialize)]
pub struct Response<C> {
    pub id: String,
    pub object: &'static str,
    pub created: u64,
    pub model: String,
    /// `dppo-policy-v<last version>`.
    pub system_fingerprint: String,
    /// The policy versions that generated the tokens in this object, ascending.
    pub policy_versions: Vec<u64>,
    pub choices: Vec<C>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
}

/// A choice of `/v1/completions` (whole or one chunk).
#[derive(Debug, Serialize)]
pub struct TextChoice {
    pub index: usize,
    pub text: String,
    pub logprobs: Option<TextLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// Legacy completions logprobs: parallel lists.
#[derive(Debug, Default, Serialize)]
pub struct TextLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<BTreeMap<String, f32>>,
    pub text_offset: Vec<usize>,
}

/// A whole chat choice.
#[derive(Debug, Serialize)]
pub struct ChatChoice {
    pub index: usize,
    pub message: ChatMessageOut,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// A chat stream chunk's choice.
#[derive(Debug, Serialize)]
pub struct ChatDeltaChoice {
    pub index: usize,
    pub delta: ChatDelta,
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// The assistant's message.
#[derive(Debug, Serialize)]
pub struct ChatMessageOut {
    pub role: &'static str,
    pub content: String,
}

/// What a chat chunk adds.
#[derive(Debug, Default, Serialize)]
pub struct ChatDelta {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
}

/// Chat logprobs: one entry per token.
#[derive(Debug, Default, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<TokenLogprob>,
}

/// One token with its logprob and, on request, the most likely alternatives.
#[derive(Debug, Serialize)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_logprobs: Option<Vec<TokenLogprob>>,
}
