//! The HTTP handlers: parse, submit to the engine, answer whole or as an SSE stream. A
//! request's engine handles live in its response: a client that disconnects drops them,
//! which cancels the request and frees its blocks.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use dppo_engine::{EngineError, GenerateRequest, RequestHandle};
use serde_json::json;

use crate::openai::{ApiRequest, Job, PromptInput};
use crate::reply::{stream_response, whole_response, Kind, Output};
use crate::{ApiError, AppState};

/// The routes over `state`.
pub(crate) fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/models", get(models))
        .route("/v1/models/{*id}", get(model))
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

/// The 404 for a model other than the served one.
fn unknown_model(s: &AppState, model: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!(
            "the model `{model}` does not exist; this server serves `{}`",
            s.model_name
        ),
    )
}

/// The served model as `/v1/models` lists it.
fn model_card(s: &AppState) -> serde_json::Value {
    json!({
        "id": s.model_name,
        "object": "model",
        "created": s.created,
        "owned_by": "dppo",
        "max_model_len": s.engine.max_model_len(),
    })
}

async fn models(State(s): State<Arc<AppState>>) -> Response {
    let body = json!({"object": "list", "data": [model_card(&s)]});
    s.counters.response("models", 200);
    Json(body).into_response()
}

/// `GET /v1/models/{id}` (the client's `models.retrieve`): the served model, 404 otherwise.
async fn model(State(s): State<Arc<AppState>>, Path(id): Path<String>) -> Response {
    if id != s.model_name {
        s.counters.response("models", 404);
        return unknown_model(&s, &id).into_response();
    }
    s.counters.response("models", 200);
    Json(model_card(&s)).into_response()
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

async fn generate(
    s: &Arc<AppState>,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
) -> Result<Response, ApiError> {
    if *s.shutdown.borrow() {
        return Err(ApiError::shutting_down());
    }
    let body = body.map_err(|r| ApiError::new(r.status(), r.body_text()))?;
    let req = ApiRequest::parse(&body)?;
    if let Some(model) = req.model.as_ref().filter(|m| **m != s.model_name) {
        return Err(unknown_model(s, model));
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
        EngineError::Closed => ApiError::shutting_down(),
        e => ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()),
    })?;
    s.counters
        .prompt_tokens(job.prompts.iter().map(Vec::len).sum());
    Ok(handles)
}
