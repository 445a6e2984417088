//! The OpenAI-compatible HTTP server over an [`Engine`]: `/v1/models`, `/v1/completions`,
//! `/v1/chat/completions` (SSE streaming for both), `/health` and Prometheus `/metrics`.
//! It runs on its own thread and tokio runtime, alone (`dppo serve`) or beside the trainer
//! (`dppo run --serve`), whose rollouts keep priority in the shared engine.

mod auth;
mod metrics;
pub mod openai;
mod reply;
mod routes;
pub mod text;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use dppo_engine::Engine;
use dppo_model::TextTokenizer;
use serde_json::json;
use tokio::sync::watch;

pub use crate::auth::ApiKey;
use crate::metrics::Counters;

/// How long in-flight requests get to wind down after a shutdown request.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// Server settings.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// `host:port` to listen on (port 0 picks a free one).
    pub addr: String,
    /// The model id clients must name.
    pub model_name: String,
    /// Requests accepted at once (queued or generating); more are answered 429.
    pub max_pending: usize,
    /// Stop on Ctrl-C (SIGINT): cancel in-flight requests and return from [`ServerHandle::wait`].
    pub handle_ctrl_c: bool,
    /// When set, every route but `/health` needs `Authorization: Bearer <api_key>`.
    pub api_key: Option<ApiKey>,
}

/// Errors starting or running the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("server runtime: {0}")]
    Runtime(std::io::Error),
    #[error("invalid server config: {0}")]
    Config(String),
}

/// What the handlers share.
struct AppState {
    engine: Arc<Engine>,
    tokenizer: TextTokenizer,
    eos_token_ids: Vec<u32>,
    model_name: String,
    api_key: Option<ApiKey>,
    max_pending: usize,
    pending: AtomicUsize,
    counters: Counters,
    created: u64,
    shutdown: watch::Receiver<bool>,
}

impl AppState {
    /// Takes a place in the bounded queue, or answers 429.
    fn reserve(self: &Arc<Self>) -> Result<PendingSlot, ApiError> {
        let taken = self.pending.fetch_add(1, Ordering::SeqCst);
        let slot = PendingSlot(self.clone());
        if taken >= self.max_pending {
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                format!(
                    "the server is at capacity ({} requests in flight); retry later",
                    self.max_pending
                ),
            ));
        }
        Ok(slot)
    }
}

/// A place in the bounded queue, given back on drop (when the response is done or the
/// client went away).
struct PendingSlot(Arc<AppState>);

impl Drop for PendingSlot {
    fn drop(&mut self) {
        self.0.pending.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A running server: its address, and ways to stop it or wait for it.
pub struct ServerHandle {
    addr: SocketAddr,
    stop: watch::Sender<bool>,
    interrupted: Arc<AtomicBool>,
    thread: Option<JoinHandle<Result<(), ServerError>>>,
}

impl ServerHandle {
    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Whether Ctrl-C was pressed (with `handle_ctrl_c`).
    pub fn interrupted(&self) -> bool {
        self.interrupted.load(Ordering::SeqCst)
    }

    /// Stops accepting, cancels in-flight requests and waits for the server thread.
    pub fn shutdown(mut self) -> Result<(), ServerError> {
        let _ = self.stop.send(true);
        self.join()
    }

    /// Waits until the server stops (Ctrl-C with `handle_ctrl_c`).
    pub fn wait(mut self) -> Result<(), ServerError> {
        self.join()
    }

    fn join(&mut self) -> Result<(), ServerError> {
        match self.thread.take().map(JoinHandle::join) {
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(ServerError::Runtime(std::io::Error::other(
                "the server thread panicked",
            ))),
            None => Ok(()),
        }
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
        let _ = self.join();
    }
}

/// Now, in seconds since the Unix epoch (responses' and the model's `created`).
fn unix_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Binds `cfg.addr` (so an address in use fails here) and serves `engine` on a thread.
pub fn spawn(
    engine: Arc<Engine>,
    tokenizer: TextTokenizer,
    eos_token_ids: Vec<u32>,
    cfg: ServerConfig,
) -> Result<ServerHandle, ServerError> {
    if cfg.max_pending == 0 {
        return Err(ServerError::Config("max_pending must be at least 1".into()));
    }
    if cfg
        .api_key
        .as_ref()
        .is_some_and(|k| k.reveal().trim().is_empty())
    {
        return Err(ServerError::Config("the API key is empty".into()));
    }
    let bind_err = |source| ServerError::Bind {
        addr: cfg.addr.clone(),
        source,
    };
    let listener = std::net::TcpListener::bind(&cfg.addr).map_err(bind_err)?;
    listener.set_nonblocking(true).map_err(bind_err)?;
    let addr = listener.local_addr().map_err(bind_err)?;
    if cfg.api_key.is_none() && !addr.ip().is_loopback() {
        tracing::warn!(
            "serving on {addr}, reachable from other machines, without an API key: anyone \
             who can connect can use the model (set --api-key or DPPO_API_KEY)"
        );
    }
    let (stop, shutdown) = watch::channel(false);
    let state = Arc::new(AppState {
        engine,
        tokenizer,
        eos_token_ids,
        model_name: cfg.model_name.clone(),
        api_key: cfg.api_key.clone(),
        max_pending: cfg.max_pending,
        pending: AtomicUsize::new(0),
        counters: Counters::default(),
        created: unix_seconds(),
        shutdown: shutdown.clone(),
    });
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("dppo-http")
        .enable_all()
        .build()
        .map_err(ServerError::Runtime)?;
    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    let stopper = stop.clone();
    let thread = std::thread::Builder::new()
        .name("dppo-server".into())
        .spawn(move || {
            runtime.block_on(async move {
                if cfg.handle_ctrl_c {
                    tokio::spawn(async move {
                        if tokio::signal::ctrl_c().await.is_ok() {
                            tracing::info!("Ctrl-C: shutting the server down");
                            flag.store(true, Ordering::SeqCst);
                            let _ = stopper.send(true);
                        }
                    });
                }
                let listener =
                    tokio::net::TcpListener::from_std(listener).map_err(ServerError::Runtime)?;
                let app = routes::router(state);
                let graceful =
                    axum::serve(listener, app).with_graceful_shutdown(stopped(shutdown.clone()));
                tokio::select! {
                    r = graceful => r.map_err(ServerError::Runtime),
                    _ = async {
                        stopped(shutdown).await;
                        tokio::time::sleep(SHUTDOWN_GRACE).await;
                    } => {
                        tracing::warn!("connections still open after the grace period; closing");
                        Ok(())
                    }
                }
            })
        })
        .map_err(ServerError::Runtime)?;
    tracing::info!("serving {} at http://{addr}/v1", cfg.model_name);
    Ok(ServerHandle {
        addr,
        stop,
        interrupted,
        thread: Some(thread),
    })
}

/// Resolves once a shutdown was requested (or the handle is gone).
async fn stopped(mut shutdown: watch::Receiver<bool>) {
    let _ = shutdown.wait_for(|&s| s).await;
}

/// An error answered OpenAI-style: `{"error": {"message", "type", "param", "code"}}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    param: Option<String>,
    code: Option<&'static str>,
}

impl ApiError {
    /// An error with `status` and `message`.
    pub fn new(status: StatusCode, message: String) -> Self {
        Self {
            status,
            message,
            param: None,
            code: None,
        }
    }

    /// 400, naming the parameter at fault when there is one.
    pub fn bad_request(message: String, param: Option<&str>) -> Self {
        Self {
            param: param.map(str::to_string),
            ..Self::new(StatusCode::BAD_REQUEST, message)
        }
    }

    /// 503: the server is shutting down and takes no more work.
    pub(crate) fn shutting_down() -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "the server is shutting down".into(),
        )
    }

    /// The status answered.
    pub fn status(&self) -> StatusCode {
        self.status
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status {
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "service_unavailable_error",
            s if s.is_server_error() => "internal_server_error",
            _ => "invalid_request_error",
        };
        let body = json!({"error": {
            "message": self.message,
            "type": kind,
            "param": self.param,
            "code": self.code,
        }});
        let mut response = (self.status, axum::Json(body)).into_response();
        // A full queue drains within a request's time: clients that honour the header (the
        // `openai` client among them) retry after a second.
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            response.headers_mut().insert(
                axum::http::header::RETRY_AFTER,
                axum::http::HeaderValue::from_static("1"),
            );
        }
        response
    }
}
