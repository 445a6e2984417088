//! The HTTP handlers: parse, submit to the engine, answer whole or as an SSE stream. A
//! request's engine handles live in its response: a client that disconnects drops them,
//! which cancels the request and frees its blocks.

use std::collections::BTreeSet;
use std::convert::Infallible;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dppo_engine::{EngineError, Event, FinishReason, GenerateRequest, RequestHandle};
use futures_util::stream::{self, BoxStream, SelectAll, StreamExt};
use serde_json::json;
use tokio::sync::watch;

use crate::openai::{
    ApiRequest, ChatChoice, ChatDelta, ChatDeltaChoice, ChatLogprobs, ChatMessageOut, Job,
    PromptInput, Response as Body, TextChoice, TextLogprobs, TokenLogprob, Usage,
};
use crate::text::TextStream;
use crate::{ApiError, AppState, PendingSlot};

/// The routes over `state`.
pub(crate) fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            crate::auth::require_key,
        ))
        .with_state(state)
}

async fn models(State(s): State<Arc<AppState>>) -> Response {
    let body = json!({"object": "list", "data": [{
        "id": s.model_name,
        "object": "model",
        "created": s.created,
        "owned_by": "dppo",
        "max_model_len": s.engine.max_model_len(),
    }]});
    s.counters.response("models", 200);
    Json(body).into_response()
}

async fn health(State(s): State<Arc<AppState>>) -> Response {
    let version = s.engine.stats().policy_version;
    Json(json!({"status": "ok", "policy_version": version})).into_response()
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    let text = s
        .counters
        .render(&s.engine.stats(), s.pending.load(Ordering::SeqCst));
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "no such route; this server answers /v1/models, /v1/completions, /v1/chat/completions, /health and /metrics".into(),
    )
}

async fn method_not_allowed() -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method not allowed on this route".into(),
    )
}

async fn completions(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    answer(&s, "completions", generate(&s, body, Kind::Text).await)
}

async fn chat_completions(
    State(s): State<Arc<AppState>>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    answer(&s, "chat_completions", generate(&s, body, Kind::Chat).await)
}

fn answer(s: &AppState, route: &'static str, result: Result<Response, ApiError>) -> Response {
    let response = result.unwrap_or_else(|e| {
        if e.status().is_server_error() {
            tracing::error!(route, "{e:?}");
        }
        e.into_response()
    });
    s.counters.response(route, response.status().as_u16());
    response
}

/// Which endpoint is answering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Text,
    Chat,
}

async fn generate(
    s: &Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
) -> Result<Response, ApiError> {
    if *s.shutdown.borrow() {
        return Err(unavailable());
    }
    let body = body.map_err(|r| ApiError::new(r.status(), r.body_text()))?;
    let req = ApiRequest::parse(&body)?;
    if req.model != s.model_name {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "the model `{}` does not exist; this server serves `{}`",
                req.model, s.model_name
            ),
        ));
    }
    let prompts = match kind {
        Kind::Text => req
            .completion_prompts()?
            .into_iter()
            .map(|p| match p {
                PromptInput::Text(t) => encode(s, &t, true),
                PromptInput::Ids(ids) => Ok(ids),
            })
            .collect::<Result<Vec<_>, _>>()?,
        Kind::Chat => {
            let messages: Vec<dppo_model::template::ChatMessage> = req
                .chat_messages()?
                .into_iter()
                .map(|(role, content)| dppo_model::template::ChatMessage::new(role, content))
                .collect();
            let text = s
                .tokenizer
                .apply_chat_template(&messages, true)
                .map_err(|e| ApiError::bad_request(e.to_string(), Some("messages")))?;
            vec![encode(s, &text, false)?]
        }
    };
    let job = req.job(kind == Kind::Chat, prompts)?;
    let slot = s.reserve()?;
    let handles = submit(s, &job)?;
    let out = Output::new(s.clone(), kind, job);
    if out.job.stream {
        Ok(stream_response(out, handles, slot))
    } else {
        whole_response(out, handles).await
    }
}

fn encode(s: &AppState, text: &str, special: bool) -> Result<Vec<u32>, ApiError> {
    s.tokenizer
        .encode(text, special)
        .map_err(|e| ApiError::bad_request(format!("cannot tokenize the prompt: {e}"), None))
}

fn unavailable() -> ApiError {
    ApiError::new(
        StatusCode::SERVICE_UNAVAILABLE,
        "the server is shutting down".into(),
    )
}

/// Queues the job's prompts in the engine as one batch.
fn submit(s: &AppState, job: &Job) -> Result<Vec<RequestHandle>, ApiError> {
    let context = s.engine.max_model_len();
    let reqs = job
        .prompts
        .iter()
        .map(|p| {
            let max_tokens = match job.max_tokens {
                Some(m) => m,
                None if p.len() < context => context - p.len(),
                None => {
                    return Err(ApiError::bad_request(
                        format!(
                            "the prompt ({} tokens) leaves no room in the model's context of {context} tokens",
                            p.len()
                        ),
                        Some("messages"),
                    ))
                }
            };
            Ok(GenerateRequest {
                sampling: job.sampling.clone(),
                stop: job.stop.clone(),
                ignore_eos: job.ignore_eos,
                ..GenerateRequest::new(p.clone(), job.n, max_tokens)
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let handles = s.engine.submit_all(reqs).map_err(|e| match e {
        EngineError::InvalidRequest(m) => ApiError::bad_request(m, None),
        EngineError::Closed => unavailable(),
        e => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    })?;
    s.counters
        .prompt_tokens(job.prompts.iter().map(Vec::len).sum());
    Ok(handles)
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
struct Output {
    s: Arc<AppState>,
    kind: Kind,
    job: Job,
    id: String,
    choices: Vec<ChoiceState>,
}

impl Output {
    fn new(s: Arc<AppState>, kind: Kind, job: Job) -> Self {
        let prefix = match kind {
            Kind::Text => "cmpl",
            Kind::Chat => "chatcmpl",
        };
        let num_choices = job.prompts.len() * job.n;
        Self {
            s,
            kind,
            id: format!("{prefix}-{:016x}", rand::random::<u64>()),
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
            created: self.s.created,
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
            lp.top_logprobs.push(e.top.into_iter().collect());
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
async fn whole_response(
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
            _ = shutdown.wait_for(|&s| s) => return Err(unavailable()),
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
fn stream_response(out: Output, handles: Vec<RequestHandle>, slot: PendingSlot) -> Response {
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
