//! API keys (`--api-key`, as vLLM's): with a key set, every route but `/health` wants
//! `Authorization: Bearer KEY`, compared in constant time, and answers 401 in OpenAI's
//! error body without it.

use std::convert::Infallible;
use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::{ApiError, AppState};

/// A bearer key: compared and sent, never printed (`Debug` shows only that one is set), so
/// no `{:?}` of a configuration can put it in a log.
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    pub fn new(key: impl Into<String>) -> Self {
        Self(key.into())
    }

    /// The key itself, for the `Authorization` header and the comparison.
    pub fn reveal(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

impl FromStr for ApiKey {
    type Err = Infallible;

    fn from_str(s: &str) -> Result<Self, Infallible> {
        Ok(Self::new(s))
    }
}

/// The one route open without a key: liveness probes carry no credentials.
const OPEN_ROUTE: &str = "/health";

/// Passes the request on when no key is set, the route is open, or it carries the key.
pub(crate) async fn require_key(
    State(s): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Response {
    let Some(key) = &s.api_key else {
        return next.run(req).await;
    };
    if req.uri().path() == OPEN_ROUTE {
        return next.run(req).await;
    }
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token);
    let error = match given {
        Some(token) if constant_time_eq(token.as_bytes(), key.reveal().as_bytes()) => {
            return next.run(req).await;
        }
        Some(_) => ApiError {
            code: Some("invalid_api_key"),
            ..ApiError::new(
                StatusCode::UNAUTHORIZED,
                "Incorrect API key provided.".into(),
            )
        },
        None => ApiError::new(
            StatusCode::UNAUTHORIZED,
            "You didn't provide an API key. You need to provide your API key in an \
             Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
                .into(),
        ),
    };
    s.counters.response("unauthorized", 401);
    error.into_response()
}

/// The credentials of an `Authorization: Bearer <token>` value (the scheme is
/// case-insensitive, as RFC 7235 has it).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then_some(token.trim())
}

/// `given == expected`, in a time that depends on `expected`'s length only: every byte of
/// the key is compared whatever the first difference, so response times do not reveal how
/// much of a guess was right.
fn constant_time_eq(given: &[u8], expected: &[u8]) -> bool {
    let mut diff = u8::from(given.len() != expected.len());
    for (i, &e) in expected.iter().enumerate() {
        diff |= e ^ given.get(i).copied().unwrap_or(!e);
    }
    std::hint::black_box(diff) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_compare_equal_only_when_identical() {
        assert!(constant_time_eq(b"sk-abc", b"sk-abc"));
        for given in [&b"sk-abd"[..], b"sk-ab", b"sk-abcd", b"", b"SK-ABC"] {
            assert!(!constant_time_eq(given, b"sk-abc"), "{given:?}");
        }
    }

    #[test]
    fn a_configuration_prints_without_its_key() {
        let cfg = crate::ServerConfig {
            addr: "127.0.0.1:0".into(),
            model_name: "m".into(),
            max_pending: 1,
            handle_ctrl_c: false,
            api_key: Some("sk-secret-123".parse().unwrap()),
        };
        let printed = format!("{cfg:?} {cfg:#?}");
        assert!(!printed.contains("sk-secret-123"), "{printed}");
        assert!(printed.contains("ApiKey(<redacted>)"), "{printed}");
        assert_eq!(cfg.api_key.unwrap().reveal(), "sk-secret-123");
    }

    #[test]
    fn bearer_tokens_are_parsed_case_insensitively() {
        assert_eq!(bearer_token("Bearer k1"), Some("k1"));
        assert_eq!(bearer_token("bearer  k1 "), Some("k1"));
        assert_eq!(bearer_token("Basic k1"), None);
        assert_eq!(bearer_token("k1"), None);
    }
}
