//! One client request of the mix (completions or chat, streamed or whole, `n` of 1 to 4,
//! seeded or not, some hung up on mid-way) and the check of its answer.

use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::Rng;
use serde_json::{json, Value};

use super::http::{self, Response};

/// Where the requests go.
pub struct Target {
    /// The server's loopback address.
    pub addr: SocketAddr,
    /// The model id requests name.
    pub model: String,
    /// Sent as `Authorization: Bearer` when set.
    pub api_key: Option<String>,
    /// The longest a request may take, from connecting to its last byte.
    pub timeout: Duration,
}

/// When a client hangs up on purpose.
#[derive(Debug, Clone, Copy)]
enum HangUp {
    /// After this many stream events.
    AfterEvents(usize),
    /// This long after sending, unless the answer has begun.
    AfterMillis(u64),
}

/// One request of the mix.
#[derive(Debug, Clone)]
pub struct Spec {
    chat: bool,
    stream: bool,
    n: usize,
    max_tokens: usize,
    seed: Option<u64>,
    temperature: f64,
    include_usage: bool,
    hang_up: Option<HangUp>,
    prompt: String,
}

impl Spec {
    /// A random request: half chat, half streamed, `n` in {1, 2, 4}, half seeded, a tenth
    /// hung up on by the client.
    pub fn random(rng: &mut StdRng, max_tokens: usize) -> Spec {
        let (a, b) = (rng.random_range(2..100), rng.random_range(2..100));
        let prompt = match rng.random_range(0..4) {
            0 => format!("What is {a}+{b}?"),
            1 => format!("Compute {a}*{b}. Answer with a number."),
            2 => format!("A shop sells {a} apples in the morning and {b} in the afternoon. How many apples does it sell in a day? Think step by step."),
            _ => format!("Write one sentence about the number {a}."),
        };
        let stream = rng.random_bool(0.5);
        let hang_up = rng.random_bool(0.1).then(|| {
            if stream {
                HangUp::AfterEvents(rng.random_range(1..8))
            } else {
                HangUp::AfterMillis(rng.random_range(10..500))
            }
        });
        Spec {
            chat: rng.random_bool(0.5),
            stream,
            n: [1, 1, 2, 4][rng.random_range(0..4)],
            max_tokens: rng.random_range(1..=max_tokens.max(1)),
            seed: rng.random_bool(0.5).then(|| rng.random_range(0..1000)),
            temperature: [0.0, 0.7, 1.0][rng.random_range(0..3)],
            include_usage: rng.random_bool(0.5),
            hang_up,
            prompt,
        }
    }

    /// The request's route and JSON body.
    fn request(&self, model: &str) -> (&'static str, Value) {
        let mut body = json!({
            "model": model,
            "n": self.n,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "stream": self.stream,
        });
        if let Some(seed) = self.seed {
            body["seed"] = json!(seed);
        }
        if self.stream && self.include_usage {
            body["stream_options"] = json!({"include_usage": true});
        }
        if self.chat {
            body["messages"] = json!([{"role": "user", "content": self.prompt}]);
            ("/v1/chat/completions", body)
        } else {
            body["prompt"] = json!(self.prompt);
            ("/v1/completions", body)
        }
    }
}

/// What became of one request.
#[derive(Debug)]
pub enum Outcome {
    /// A complete, well-formed answer: its latency, and for streams the time to the first
    /// token.
    Done {
        latency: Duration,
        ttft: Option<Duration>,
    },
    /// The client hung up on purpose.
    HungUp,
    /// 429: the server was at capacity.
    Rejected,
    /// Anything else: the kind of failure and a detail.
    Failed(String, String),
}

fn failed(kind: &str, detail: impl Into<String>) -> Outcome {
    Outcome::Failed(kind.to_string(), detail.into())
}

fn io_failure(e: &io::Error) -> Outcome {
    let kind = match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => "timeout",
        io::ErrorKind::UnexpectedEof => "connection closed early",
        io::ErrorKind::InvalidData => "malformed HTTP",
        _ => "connection error",
    };
    failed(kind, e.to_string())
}

/// Sends `spec` to `target` and checks the answer.
pub fn run_one(target: &Target, spec: &Spec) -> Outcome {
    let start = Instant::now();
    let (path, body) = spec.request(&target.model);
    let sent = http::send(
        target.addr,
        "POST",
        path,
        &body.to_string(),
        target.api_key.as_deref(),
        target.timeout,
    );
    let stream = match sent {
        Ok(s) => s,
        Err(e) => return io_failure(&e),
    };
    if let Some(HangUp::AfterMillis(ms)) = spec.hang_up {
        let waited = stream
            .set_read_timeout(Some(Duration::from_millis(ms)))
            .and_then(|()| stream.peek(&mut [0u8; 1]));
        match waited {
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Outcome::HungUp;
            }
            Err(e) => return io_failure(&e),
            Ok(_) => {
                if let Err(e) = stream.set_read_timeout(Some(target.timeout)) {
                    return io_failure(&e);
                }
            }
        }
    }
    let response = match Response::read_head(stream) {
        Ok(r) => r,
        Err(e) => return io_failure(&e),
    };
    let result = match response.status {
        200 if spec.stream => read_stream(response, spec, start, target.timeout),
        200 => read_whole(response, spec, start),
        429 => return Outcome::Rejected,
        status => {
            let body = response.text().unwrap_or_default();
            return failed(&format!("HTTP {status}"), body);
        }
    };
    result.unwrap_or_else(|e| io_failure(&e))
}

/// Checks a finish reason.
fn finish_ok(reason: &Value) -> bool {
    matches!(reason.as_str(), Some("stop" | "length"))
}

fn read_whole(response: Response, spec: &Spec, start: Instant) -> io::Result<Outcome> {
    let text = response.text()?;
    let latency = start.elapsed();
    let Ok(body) = serde_json::from_str::<Value>(&text) else {
        return Ok(failed("invalid JSON", text));
    };
    let Some(choices) = body["choices"].as_array() else {
        return Ok(failed("no choices", text));
    };
    if choices.len() != spec.n {
        return Ok(failed("wrong number of choices", text));
    }
    if !choices.iter().all(|c| finish_ok(&c["finish_reason"])) {
        return Ok(failed("bad finish_reason", text));
    }
    let tokens = body["usage"]["completion_tokens"].as_u64();
    if tokens.is_none_or(|t| t > (spec.n * spec.max_tokens) as u64) {
        return Ok(failed("bad usage", text));
    }
    Ok(Outcome::Done {
        latency,
        ttft: None,
    })
}

fn read_stream(
    mut response: Response,
    spec: &Spec,
    start: Instant,
    timeout: Duration,
) -> io::Result<Outcome> {
    if !response.event_stream {
        return Ok(failed("stream without text/event-stream", ""));
    }
    let mut finished = vec![false; spec.n];
    let (mut events, mut ttft, mut usage) = (0, None, false);
    loop {
        let Some(data) = response.next_event()? else {
            return Ok(failed(
                "stream ended before [DONE]",
                format!("{events} events"),
            ));
        };
        if data == "[DONE]" {
            break;
        }
        if start.elapsed() > timeout {
            return Ok(failed(
                "timeout",
                format!("stream still open after {timeout:?}"),
            ));
        }
        events += 1;
        let Ok(chunk) = serde_json::from_str::<Value>(&data) else {
            return Ok(failed("invalid JSON chunk", data));
        };
        if !chunk["error"].is_null() {
            return Ok(failed("error in stream", data));
        }
        usage |= !chunk["usage"].is_null();
        for choice in chunk["choices"].as_array().into_iter().flatten() {
            let Some(i) = choice["index"].as_u64().filter(|&i| (i as usize) < spec.n) else {
                return Ok(failed("bad choice index", data));
            };
            let piece = if spec.chat {
                &choice["delta"]["content"]
            } else {
                &choice["text"]
            };
            let reason = &choice["finish_reason"];
            if piece.as_str().is_some_and(|p| !p.is_empty()) || !reason.is_null() {
                ttft.get_or_insert_with(|| start.elapsed());
            }
            if !reason.is_null() {
                if !finish_ok(reason) {
                    return Ok(failed("bad finish_reason", data));
                }
                finished[i as usize] = true;
            }
        }
        if matches!(spec.hang_up, Some(HangUp::AfterEvents(k)) if events >= k) {
            return Ok(Outcome::HungUp);
        }
    }
    if !finished.iter().all(|&f| f) {
        return Ok(failed(
            "choice without finish_reason",
            format!("{finished:?}"),
        ));
    }
    if spec.include_usage && !usage {
        return Ok(failed("no usage chunk", ""));
    }
    Ok(Outcome::Done {
        latency: start.elapsed(),
        ttft,
    })
}
