//! A reward server over HTTP (`reward.url`): one POST per batch, with a timeout and bounded
//! retries with exponential backoff for what may pass (no connection, a timeout, 429 and 5xx
//! answers). ureq without TLS keeps the build small; an https server needs a local proxy.

use std::time::Duration;

use super::{Failure, StartError};

/// The first retry waits this long; each later one twice as long, up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(250);
const MAX_BACKOFF: Duration = Duration::from_secs(8);

/// A reward server's address and how to reach it.
pub struct HttpReward {
    url: String,
    agent: ureq::Agent,
    /// The `Authorization` header's value (`Bearer <token>`); never printed.
    authorization: Option<String>,
    max_retries: u32,
}

impl HttpReward {
    /// `url` must be `http://host[:port]/path`; `token` is the bearer token, if any.
    pub fn new(
        url: &str,
        token: Option<String>,
        timeout: Duration,
        max_retries: u32,
    ) -> Result<Self, StartError> {
        if url.starts_with("https://") {
            return Err(StartError::Https(url.to_string()));
        }
        if !url.starts_with("http://") {
            return Err(StartError::NotHttp(url.to_string()));
        }
        let agent = ureq::Agent::config_builder()
            .timeout_global(Some(timeout))
            .http_status_as_error(false)
            .build()
            .into();
        Ok(Self {
            url: url.to_string(),
            agent,
            authorization: token.map(|t| format!("Bearer {t}")),
            max_retries,
        })
    }

    /// The server's address (for errors and logs).
    pub fn url(&self) -> &str {
        &self.url
    }

    /// POSTs `body` and returns the answer's text, retrying what may pass.
    pub fn exchange(&self, body: &str) -> Result<String, Failure> {
        let mut backoff = FIRST_BACKOFF;
        let mut attempt = 0;
        loop {
            match self.post(body) {
                Ok(text) => return Ok(text),
                Err((reason, retryable)) if retryable && attempt < self.max_retries => {
                    tracing::warn!(
                        "reward server {}: {reason}; retrying in {:?} ({} of {})",
                        self.url,
                        backoff,
                        attempt + 1,
                        self.max_retries
                    );
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                    attempt += 1;
                }
                Err((reason, _)) => {
                    let tries = attempt + 1;
                    return Err(Failure::Failed(format!(
                        "{reason} (after {tries} attempt{})",
                        if tries == 1 { "" } else { "s" }
                    )));
                }
            }
        }
    }

    /// One POST: the answer's text, or why not and whether a retry may help.
    fn post(&self, body: &str) -> Result<String, (String, bool)> {
        let mut request = self
            .agent
            .post(&self.url)
            .header("Content-Type", "application/json");
        if let Some(auth) = &self.authorization {
            request = request.header("Authorization", auth);
        }
        let mut response = request.send(body).map_err(|e| (e.to_string(), true))?;
        let status = response.status();
        let text = response
            .body_mut()
            .read_to_string()
            .map_err(|e| (format!("reading the answer: {e}"), true))?;
        if status.is_success() {
            return Ok(text);
        }
        let shown: String = text.chars().take(200).collect();
        let retryable = status.is_server_error() || status.as_u16() == 429;
        Err((format!("HTTP {status}: {shown:?}"), retryable))
    }
}
