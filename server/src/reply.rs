//! The OpenAI answer built from engine events: whole (one JSON body once every choice is
//! done) or streamed (server-sent events, a chunk per token that is safe to show).

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use dppo_engine::{Event, FinishReason, RequestHandle};
use futures_util::stream::{self, BoxStream, SelectAll, StreamExt};
use serde_json::json;
use tokio::sync::watch;

use crate::openai::{
    ChatChoice, ChatDelta, ChatDeltaChoice, ChatLogprobs, ChatMessageOut, Job, Response as Body,
    TextChoice, TextLogprobs, TokenLogprob, Usage,
};
use crate::text::TextStream;
use crate::{ApiError, AppState, PendingSlot};

/// Which endpoint is answering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    Text,
    Chat,
}

/// One token's logprob entry, before formatting for an endpoint.
struct TokenEntry {
    token: String,
    logprob: f32,
    top: Vec<(String, f32)>,
}

/// What one event adds to one choice.
#[derive(Default)]
struct Delta {
    text: String,
    entries: Vec<TokenEntry>,
    finish: Option<FinishReason>,
    version: Option<u64>,
}

/// Per choice: its text so far, token count and policy versions.
#[derive(Default)]
struct ChoiceState {
    text: TextStream,
    num_tokens: usize,
    versions: BTreeSet<u64>,
}

/// A response being built: the job, the choices' state, ids shared by every chunk.
pub(crate) struct Output {
    s: Arc<AppState>,
    kind: Kind,
    pub(crate) job: Job,
    id: String,
    /// When the request came (Unix seconds), every chunk's `created`.
    created: u64,
    choices: Vec<ChoiceState>,
}

impl Output {
    pub(crate) fn new(s: Arc<AppState>, kind: Kind, job: Job) -> Self {
        let prefix = match kind {
            Kind::Text => "cmpl",
            Kind::Chat => "chatcmpl",
        };
        let num_choices = job.prompts.len() * job.n;
        Self {
            s,
            kind,
            id: format!("{prefix}-{:016x}", rand::random::<u64>()),
            created: crate::unix_seconds(),
            choices: (0..num_choices).map(|_| ChoiceState::default()).collect(),
            job,
        }
    }

    /// Folds an event of prompt `prompt_idx` into its choice; returns the choice and what
    /// it gained.
    fn apply(&mut self, prompt_idx: usize, event: Event) -> (usize, Delta) {
        let s = &self.s;
        match event {
            Event::Token {
                sample_index,
                token_id,
                model_logprob,
                top_logprobs,
                policy_version,
                ..
            } => {
                let index = prompt_idx * self.job.n + sample_index;
                let c = &mut self.choices[index];
                s.counters.generation_token();
                c.num_tokens += 1;
                c.versions.insert(policy_version);
                let mut delta = Delta {
                    text: c.text.push(&s.tokenizer, token_id, &self.job.stop),
                    version: Some(policy_version),
                    ..Delta::default()
                };
                if self.job.logprobs.is_some() && !s.eos_token_ids.contains(&token_id) {
                    delta.entries.push(TokenEntry {
                        token: token_text(s, token_id),
                        logprob: model_logprob.unwrap_or(f32::NAN),
                        top: top_logprobs
                            .iter()
                            .map(|&(id, lp)| (token_text(s, id), lp))
                            .collect(),
                    });
                }
                (index, delta)
            }
            Event::Finished {
                sample_index,
                reason,
            } => {
                let index = prompt_idx * self.job.n + sample_index;
                let c = &mut self.choices[index];
                let delta = Delta {
                    text: c.text.finish(&self.job.stop),
                    finish: Some(reason),
                    ..Delta::default()
                };
                (index, delta)
            }
        }
    }

    fn usage(&self) -> Usage {
        let prompt = self.job.prompts.iter().map(Vec::len).sum();
        Usage::new(prompt, self.choices.iter().map(|c| c.num_tokens).sum())
    }

    fn body<C>(&self, choices: Vec<C>, versions: Vec<u64>, usage: Option<Usage>) -> Body<C> {
        let object = match (self.kind, self.job.stream) {
            (Kind::Text, _) => "text_completion",
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
        };
        let last = versions
            .last()
            .copied()
            .unwrap_or_else(|| self.s.engine.stats().policy_version);
        Body {
            id: self.id.clone(),
            object,
            created: self.created,
            model: self.s.model_name.clone(),
            system_fingerprint: format!("dppo-policy-v{last}"),
            policy_versions: versions,
            choices,
            usage,
        }
    }

    /// One stream chunk for `delta` of choice `index`; `None` when it adds nothing.
    fn chunk(&self, index: usize, delta: Delta) -> Option<String> {
        if delta.text.is_empty() && delta.entries.is_empty() && delta.finish.is_none() {
            return None;
        }
        let versions: Vec<u64> = delta.version.into_iter().collect();
        let finish_reason = delta.finish.map(finish_reason);
        let json = match self.kind {
            Kind::Text => {
                let offset = self.choices[index].text.text().len() - delta.text.len();
                let choice = TextChoice {
                    index,
                    logprobs: self.text_logprobs(delta.entries, offset),
                    text: delta.text,
                    finish_reason,
                };
                serde_json::to_string(&self.body(vec![choice], versions, None))
            }
            Kind::Chat => {
                let choice = ChatDeltaChoice {
                    index,
                    delta: ChatDelta {
                        role: None,
                        content: (!delta.text.is_empty()).then_some(delta.text),
                    },
                    logprobs: self.chat_logprobs(delta.entries),
                    finish_reason,
                };
                serde_json::to_string(&self.body(vec![choice], versions, None))
            }
        };
        Some(json.expect("serialisable"))
    }

    fn text_logprobs(&self, entries: Vec<TokenEntry>, mut offset: usize) -> Option<TextLogprobs> {
        self.job.logprobs?;
        let mut lp = TextLogprobs::default();
        for e in entries {
            lp.text_offset.push(offset);
            offset += e.token.len();
            // Up to logprobs + 1 entries, as OpenAI's: the sampled token is always one.
            let mut top: BTreeMap<String, f32> = e.top.into_iter().collect();
            top.entry(e.token.clone()).or_insert(e.logprob);
            lp.top_logprobs.push(top);
            lp.tokens.push(e.token);
            lp.token_logprobs.push(e.logprob);
        }
        Some(lp)
    }

    fn chat_logprobs(&self, entries: Vec<TokenEntry>) -> Option<ChatLogprobs> {
        self.job.logprobs?;
        let entry = |token: String, logprob: f32, top| TokenLogprob {
            bytes: token.as_bytes().to_vec(),
            token,
            logprob,
            top_logprobs: top,
        };
        let content = entries
            .into_iter()
            .map(|e| {
                let top = e
                    .top
                    .into_iter()
                    .map(|(t, lp)| entry(t, lp, None))
                    .collect();
                entry(e.token, e.logprob, Some(top))
            })
            .collect();
        Some(ChatLogprobs { content })
    }
}

fn token_text(s: &AppState, id: u32) -> String {
    s.tokenizer.decode(&[id], true).unwrap_or_default()
}

fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
        FinishReason::Cancelled => "abort",
    }
}

/// The events of every handle, tagged with the handle's prompt index.
fn merged(handles: Vec<RequestHandle>) -> SelectAll<BoxStream<'static, (usize, Event)>> {
    stream::select_all(handles.into_iter().enumerate().map(|(i, h)| {
        stream::unfold(h, |mut h| async move {
            let event = h.recv().await?;
            Some((event, h))
        })
        .map(move |e| (i, e))
        .boxed()
    }))
}

/// Waits for every choice, then answers with one JSON body.
pub(crate) async fn whole_response(
    mut out: Output,
    handles: Vec<RequestHandle>,
) -> Result<Response, ApiError> {
    let mut events = merged(handles);
    let mut shutdown = out.s.shutdown.clone();
    let mut entries: Vec<Vec<TokenEntry>> = (0..out.choices.len()).map(|_| Vec::new()).collect();
    let mut finish = vec![None; out.choices.len()];
    loop {
        let next = tokio::select! {
            e = events.next() => e,
            _ = shutdown.wait_for(|&s| s) => return Err(ApiError::shutting_down()),
        };
        let Some((prompt_idx, event)) = next else {
            break;
        };
        let (index, delta) = out.apply(prompt_idx, event);
        entries[index].extend(delta.entries);
        finish[index] = finish[index].or(delta.finish);
    }
    let versions: BTreeSet<u64> = out
        .choices
        .iter()
        .flat_map(|c| c.versions.clone())
        .collect();
    let versions: Vec<u64> = versions.into_iter().collect();
    let usage = Some(out.usage());
    let texts: Vec<String> = out
        .choices
        .iter()
        .map(|c| c.text.text().to_string())
        .collect();
    let parts = texts.into_iter().zip(entries).zip(finish).enumerate();
    let json = match out.kind {
        Kind::Text => {
            let choices = parts
                .map(|(index, ((text, entries), finish))| TextChoice {
                    index,
                    logprobs: out.text_logprobs(entries, 0),
                    text,
                    finish_reason: finish.map(finish_reason),
                })
                .collect();
            serde_json::to_value(out.body(choices, versions, usage))
        }
        Kind::Chat => {
            let choices = parts
                .map(|(index, ((text, entries), finish))| ChatChoice {
                    index,
                    message: ChatMessageOut {
                        role: "assistant",
                        content: text,
                    },
                    logprobs: out.chat_logprobs(entries),
                    finish_reason: finish.map(finish_reason),
                })
                .collect();
            serde_json::to_value(out.body(choices, versions, usage))
        }
    };
    Ok(Json(json.expect("serialisable")).into_response())
}

/// State of an SSE response.
struct Streaming {
    out: Output,
    events: SelectAll<BoxStream<'static, (usize, Event)>>,
    shutdown: watch::Receiver<bool>,
    /// Held for the life of the stream: the request counts against the queue bound.
    _slot: PendingSlot,
    done: bool,
}

/// Answers as server-sent events: a chunk per token (text that is safe to show), a chunk
/// with each choice's finish reason, usage when asked, then `[DONE]`.
pub(crate) fn stream_response(
    out: Output,
    handles: Vec<RequestHandle>,
    slot: PendingSlot,
) -> Response {
    let mut first = Vec::new();
    if out.kind == Kind::Chat {
        for index in 0..out.choices.len() {
            let choice = ChatDeltaChoice {
                index,
                delta: ChatDelta {
                    role: Some("assistant"),
                    content: Some(String::new()),
                },
                logprobs: None,
                finish_reason: None,
            };
            let body = out.body(vec![choice], Vec::new(), None);
            first.push(serde_json::to_string(&body).expect("serialisable"));
        }
    }
    let state = Streaming {
        shutdown: out.s.shutdown.clone(),
        out,
        events: merged(handles),
        _slot: slot,
        done: false,
    };
    let chunks =
        stream::iter(first).chain(stream::unfold(state, next_chunks).flat_map(stream::iter));
    let events = chunks.map(|data| Ok::<_, Infallible>(SseEvent::default().data(data)));
    Sse::new(events)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(2)))
        .into_response()
}

/// The next chunks of a stream (possibly none for a held-back token).
async fn next_chunks(mut st: Streaming) -> Option<(Vec<String>, Streaming)> {
    if st.done {
        return None;
    }
    let next = tokio::select! {
        e = st.events.next() => Some(e),
        _ = st.shutdown.wait_for(|&s| s) => None,
    };
    let Some(next) = next else {
        st.done = true;
        let error = json!({"error": {"message": "the server is shutting down", "type": "service_unavailable_error", "param": null, "code": null}});
        return Some((vec![error.to_string()], st));
    };
    let chunks = match next {
        Some((prompt_idx, event)) => {
            let (index, delta) = st.out.apply(prompt_idx, event);
            st.out.chunk(index, delta).into_iter().collect()
        }
        None => {
            st.done = true;
            let mut last = Vec::new();
            if st.out.job.include_usage {
                let usage = Some(st.out.usage());
                let body = match st.out.kind {
                    Kind::Text => serde_json::to_string(&st.out.body::<TextChoice>(
                        Vec::new(),
                        Vec::new(),
                        usage,
                    )),
                    Kind::Chat => serde_json::to_string(&st.out.body::<ChatDeltaChoice>(
                        Vec::new(),
                        Vec::new(),
                        usage,
                    )),
                };
                last.push(body.expect("serialisable"));
            }
            last.push("[DONE]".to_string());
            last
        }
    };
    Some((chunks, st))
}
