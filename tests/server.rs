//! The OpenAI-compatible server over real HTTP on loopback: answers equal the engine's own
//! outputs, streams concatenate to whole answers, bad requests get the right status and
//! message, the queue is bounded, disconnects and load leave every KV block in the pool.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::Device;
use dppo_engine::{Engine, EngineConfig, GenerateRequest};
use dppo_model::template::ChatMessage;
use dppo_model::{Arch, Policy, Weights};
use dppo_server::{spawn, ServerConfig, ServerHandle};
use serde_json::{json, Value};

use crate::http::{open, post, read_until, request};
use crate::util::small_config;

const MODEL: &str = "tiny";

struct Served {
    policy: Policy,
    engine: Arc<Engine>,
    handle: ServerHandle,
}

impl Served {
    fn addr(&self) -> SocketAddr {
        self.handle.addr()
    }

    /// Greedy tokens of `prompt_ids` straight from an engine (the reference).
    fn greedy(&self, prompt_ids: Vec<u32>, max_tokens: usize) -> Vec<u32> {
        let mut req = GenerateRequest::new(prompt_ids, 1, max_tokens);
        req.sampling.temperature = 0.0;
        self.engine.generate(vec![req]).unwrap()[0][0]
            .token_ids
            .clone()
    }

    fn text(&self, ids: &[u32]) -> String {
        self.policy.tokenizer.decode(ids, true).unwrap()
    }

    /// Waits until the engine holds no block and runs nothing.
    fn wait_idle(&self) {
        let start = Instant::now();
        loop {
            let s = self.engine.stats();
            if s.blocks_used == 0 && s.num_running == 0 && s.num_waiting == 0 {
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "the engine still holds {} blocks, {} running",
                s.blocks_used,
                s.num_running
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// A random model big enough that long requests take seconds (for tests that must catch
/// a request in flight), with the task tokenizer.
fn slow_policy() -> Policy {
    let tokenizer = dppo_model::presets::task_tokenizer().unwrap();
    let mut cfg = small_config(Arch::Llama);
    cfg.vocab_size = tokenizer.vocab_size();
    cfg.hidden_size = 768;
    cfg.intermediate_size = 2048;
    cfg.num_hidden_layers = 4;
    cfg.num_attention_heads = 12;
    cfg.num_key_value_heads = 4;
    cfg.head_dim = 64;
    cfg.max_position_embeddings = 2048;
    let weights = Weights::random(&cfg, 0.02, 3, &Device::Cpu).unwrap();
    Policy::new(cfg, weights, tokenizer).unwrap()
}

fn tiny() -> Policy {
    Policy::load("builtin:tiny", &Device::Cpu).unwrap()
}

fn serve(max_pending: usize, policy: Policy) -> Served {
    serve_with_key(max_pending, policy, None)
}

fn serve_with_key(max_pending: usize, policy: Policy, api_key: Option<&str>) -> Served {
    let engine = Arc::new(Engine::new(&policy, EngineConfig::default(), Device::Cpu).unwrap());
    let cfg = ServerConfig {
        addr: "127.0.0.1:0".into(),
        model_name: MODEL.into(),
        max_pending,
        handle_ctrl_c: false,
        api_key: api_key.map(str::to_string),
    };
    let handle = spawn(
        engine.clone(),
        policy.tokenizer.clone(),
        policy.eos_token_ids().to_vec(),
        cfg,
    )
    .unwrap();
    Served {
        policy,
        engine,
        handle,
    }
}

#[test]
fn models_health_and_metrics() {
    let s = serve(8, tiny());
    let models = request(s.addr(), "GET", "/v1/models", None);
    assert_eq!(models.status, 200);
    assert_eq!(models.json()["data"][0]["id"], MODEL);
    let health = request(s.addr(), "GET", "/health", None);
    assert_eq!(
        (health.status, health.json()["status"].clone()),
        (200, json!("ok"))
    );
    let metrics = request(s.addr(), "GET", "/metrics", None);
    assert_eq!(metrics.status, 200);
    let total = s.engine.stats().num_blocks;
    for line in [
        "# TYPE dppo_requests_total counter".to_string(),
        "dppo_requests_total{route=\"models\",status=\"200\"} 1".to_string(),
        format!("dppo_kv_blocks_total {total}"),
        "dppo_kv_blocks_used 0".to_string(),
        "dppo_queue_depth 0".to_string(),
        "dppo_policy_version 0".to_string(),
        "# TYPE process_resident_memory_bytes gauge".to_string(),
        "# TYPE dppo_kv_blocks_peak gauge".to_string(),
        format!("dppo_kv_block_bytes {}", s.engine.stats().block_bytes),
    ] {
        assert!(
            metrics.body.contains(&line),
            "{line} missing:\n{}",
            metrics.body
        );
    }
}

#[test]
fn completions_equal_the_engine_and_count_usage() {
    let s = serve(8, tiny());
    let prompt = "What is 12+34?";
    let ids = s.policy.tokenizer.encode(prompt, true).unwrap();
    let want = s.greedy(ids.clone(), 10);
    let r = post(
        s.addr(),
        "/v1/completions",
        &json!({"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let body = r.json();
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["choices"][0]["text"], s.text(&want));
    assert_eq!(body["usage"]["prompt_tokens"], ids.len());
    assert_eq!(body["usage"]["completion_tokens"], want.len());
    assert_eq!(body["usage"]["total_tokens"], ids.len() + want.len());
    assert_eq!(body["policy_versions"], json!([0]));
    assert_eq!(body["system_fingerprint"], "dppo-policy-v0");
    let reason = body["choices"][0]["finish_reason"].as_str().unwrap();
    assert_eq!(reason, if want.len() == 10 { "length" } else { "stop" });
    // Token-id prompts, and several prompts at once (choices prompt-major).
    let r = post(
        s.addr(),
        "/v1/completions",
        &json!({"model": MODEL, "prompt": [ids.clone(), ids], "n": 2, "max_tokens": 10, "temperature": 0}),
    );
    let choices = r.json()["choices"].as_array().unwrap().clone();
    assert_eq!(choices.len(), 4);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
        assert_eq!(c["text"], s.text(&want));
    }
}

#[test]
fn chat_applies_the_template() {
    let s = serve(8, tiny());
    let text = s
        .policy
        .tokenizer
        .apply_chat_template(&[ChatMessage::new("user", "What is 7*6?")], true)
        .unwrap();
    let want = s.greedy(s.policy.tokenizer.encode(&text, false).unwrap(), 12);
    let r = post(
        s.addr(),
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "What is 7*6?"}]}],
                "max_tokens": 12, "temperature": 0}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let body = r.json();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["choices"][0]["message"]["role"], "assistant");
    assert_eq!(body["choices"][0]["message"]["content"], s.text(&want));
}

/// Concatenated stream chunks of every choice, the finish reasons, and the usage chunk.
fn collect_stream(chunks: &[String], chat: bool) -> (Vec<String>, Vec<String>, Option<Value>) {
    assert_eq!(chunks.last().map(String::as_str), Some("[DONE]"));
    let mut texts: Vec<String> = Vec::new();
    let mut reasons: Vec<String> = Vec::new();
    let mut usage = None;
    for c in &chunks[..chunks.len() - 1] {
        let v: Value = serde_json::from_str(c).unwrap();
        if !v["usage"].is_null() {
            usage = Some(v["usage"].clone());
        }
        for choice in v["choices"].as_array().unwrap() {
            let i = choice["index"].as_u64().unwrap() as usize;
            if texts.len() <= i {
                texts.resize(i + 1, String::new());
                reasons.resize(i + 1, String::new());
            }
            let piece = if chat {
                &choice["delta"]["content"]
            } else {
                &choice["text"]
            };
            texts[i].push_str(piece.as_str().unwrap_or(""));
            if let Some(r) = choice["finish_reason"].as_str() {
                reasons[i] = r.to_string();
            }
        }
    }
    (texts, reasons, usage)
}

#[test]
fn streams_concatenate_to_the_whole_answer() {
    let s = serve(8, tiny());
    for (path, chat) in [("/v1/completions", false), ("/v1/chat/completions", true)] {
        let mut body =
            json!({"model": MODEL, "n": 3, "max_tokens": 12, "temperature": 1.0, "seed": 5});
        if chat {
            body["messages"] = json!([{"role": "user", "content": "What is 3+4?"}]);
        } else {
            body["prompt"] = json!("What is 3+4?");
        }
        let whole = post(s.addr(), path, &body).json();
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        let r = post(s.addr(), path, &body);
        assert_eq!(r.status, 200);
        assert!(r.headers.contains("content-type: text/event-stream"));
        let (texts, reasons, usage) = collect_stream(&r.sse(), chat);
        assert_eq!(texts.len(), 3);
        for (i, text) in texts.iter().enumerate() {
            let choice = &whole["choices"][i];
            let want = if chat {
                &choice["message"]["content"]
            } else {
                &choice["text"]
            };
            assert_eq!(text, want.as_str().unwrap(), "{path} choice {i}");
            assert_eq!(reasons[i], choice["finish_reason"].as_str().unwrap());
        }
        assert_eq!(usage.unwrap(), whole["usage"], "{path}");
    }
}

#[test]
fn stop_strings_end_and_trim_the_text() {
    let s = serve(8, tiny());
    let ids = s.policy.tokenizer.encode("1+1=", true).unwrap();
    let full = s.text(&s.greedy(ids, 16));
    // Stop at the second half of what greedy decoding produces.
    let cut = full
        .char_indices()
        .map(|(i, _)| i)
        .nth(full.chars().count() / 2)
        .unwrap();
    let stop = full[cut..].chars().take(2).collect::<String>();
    let at = full.find(&stop).unwrap();
    for stream in [false, true] {
        let r = post(
            s.addr(),
            "/v1/completions",
            &json!({"model": MODEL, "prompt": "1+1=", "max_tokens": 16, "temperature": 0, "stop": [stop], "stream": stream}),
        );
        let (text, reason) = if stream {
            let (t, r, _) = collect_stream(&r.sse(), false);
            (t[0].clone(), r[0].clone())
        } else {
            let c = r.json()["choices"][0].clone();
            (
                c["text"].as_str().unwrap().to_string(),
                c["finish_reason"].as_str().unwrap().to_string(),
            )
        };
        assert_eq!(text, full[..at], "stream {stream}, stop {stop:?}");
        assert_eq!(reason, "stop");
    }
}

#[test]
fn logprobs_list_each_token_with_its_alternatives() {
    let s = serve(8, tiny());
    let r = post(
        s.addr(),
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "What is 5+5?", "max_tokens": 6, "temperature": 0, "logprobs": 3}),
    );
    let body = r.json();
    let lp = &body["choices"][0]["logprobs"];
    let tokens = lp["tokens"].as_array().unwrap();
    assert!(!tokens.is_empty());
    let text: String = tokens.iter().map(|t| t.as_str().unwrap()).collect();
    assert_eq!(text, body["choices"][0]["text"].as_str().unwrap());
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let top = top.as_object().unwrap();
        assert!(!top.is_empty() && top.len() <= 3);
        // Greedy: the chosen token is the most likely one.
        let best = top
            .values()
            .map(|v| v.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        let chosen = lp["token_logprobs"][i].as_f64().unwrap();
        assert!(
            (chosen - best).abs() < 1e-5 && chosen <= 0.0,
            "{chosen} vs {best}"
        );
    }
    let r = post(
        s.addr(),
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "logprobs": true, "top_logprobs": 2, "seed": 1}),
    );
    let content = r.json()["choices"][0]["logprobs"]["content"].clone();
    for entry in content.as_array().unwrap() {
        assert_eq!(entry["top_logprobs"].as_array().unwrap().len(), 2);
        assert!(entry["logprob"].as_f64().unwrap() <= 0.0);
        let token = entry["token"].as_str().unwrap();
        let bytes: Vec<u8> = entry["bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b.as_u64().unwrap() as u8)
            .collect();
        assert_eq!(bytes, token.as_bytes());
    }
}

#[test]
fn bad_requests_get_their_status_and_a_clear_message() {
    let s = serve(8, tiny());
    let long = "1+".repeat(600);
    let cases: Vec<(&str, &str, String, u16, &str)> = vec![
        ("POST", "/v1/completions", "{not json".into(), 400, "invalid JSON body"),
        ("POST", "/v1/completions", json!({"prompt": "hi"}).to_string(), 400, "missing field `model`"),
        ("POST", "/v1/completions", json!({"model": "gpt-9", "prompt": "hi"}).to_string(), 404, "`gpt-9` does not exist"),
        ("POST", "/v1/completions", json!({"model": MODEL, "prompt": "hi", "temperature": -1}).to_string(), 400, "temperature must be >= 0"),
        ("POST", "/v1/completions", json!({"model": MODEL, "prompt": "hi", "temperature": "hot"}).to_string(), 400, "temperature: invalid type"),
        ("POST", "/v1/completions", json!({"model": MODEL, "prompt": "hi", "top_p": 0}).to_string(), 400, "top_p must be in (0, 1]"),
        ("POST", "/v1/completions", json!({"model": MODEL, "prompt": "hi", "top_k": -5}).to_string(), 400, "top_k must be positive"),
        ("POST", "/v1/completions", json!({"model": MODEL, "prompt": "hi", "n": 0}).to_string(), 400, "n must be between 1"),
        ("POST", "/v1/completions", json!({"model": MODEL, "prompt": "hi", "max_tokens": 0}).to_string(), 400, "max_tokens must be at least 1"),
        ("POST", "/v1/completions", json!({"model": MODEL, "prompt": long}).to_string(), 400, "exceeds the model's context"),
        ("POST", "/v1/completions", json!({"model": MODEL}).to_string(), 400, "prompt is required"),
        ("POST", "/v1/completions", json!({"model": MODEL, "prompt": 7}).to_string(), 400, "prompt must be a string"),
        ("POST", "/v1/completions", json!({"model": MODEL, "prompt": [99999]}).to_string(), 400, "outside the vocabulary"),
        ("POST", "/v1/completions", json!({"model": MODEL, "prompt": "hi", "stop": [""]}).to_string(), 400, "stop strings must not be empty"),
        ("POST", "/v1/completions", json!({"model": MODEL, "prompt": "hi", "stop": 3}).to_string(), 400, "stop must be a string"),
        ("POST", "/v1/completions", json!({"model": MODEL, "prompt": "hi", "echo": true}).to_string(), 400, "echo"),
        ("POST", "/v1/completions", json!({"model": MODEL, "prompt": "hi", "logprobs": 50}).to_string(), 400, "logprobs must be an integer"),
        ("POST", "/v1/completions", json!({"model": MODEL, "prompt": "hi", "presence_penalty": 0.5}).to_string(), 400, "presence_penalty"),
        ("POST", "/v1/chat/completions", json!({"model": MODEL, "messages": []}).to_string(), 400, "messages must be a non-empty list"),
        ("POST", "/v1/chat/completions", json!({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}).to_string(), 400, "messages[0].role"),
        ("POST", "/v1/chat/completions", json!({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).to_string(), 400, "only text parts"),
        ("POST", "/v1/chat/completions", json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}).to_string(), 400, "top_logprobs needs logprobs"),
        ("POST", "/v1/chat/completions", json!({"model": MODEL, "messages": [{"role": "user", "content": long}]}).to_string(), 400, "context"),
        ("GET", "/v1/completions", String::new(), 405, "method not allowed"),
        ("POST", "/v1/nothing", "{}".into(), 404, "no such route"),
        ("POST", "/v1/completions", "x".repeat(3 << 20), 413, "length limit"),
    ];
    for (method, path, body, status, message) in cases {
        let r = request(s.addr(), method, path, Some(&body));
        let shown: String = body.chars().take(80).collect();
        assert_eq!(r.status, status, "{method} {path} {shown}: {}", r.body);
        let error = &r.json()["error"];
        let got = error["message"].as_str().unwrap_or_default();
        assert!(got.contains(message), "{shown}: {got:?} lacks {message:?}");
        assert!(error["type"].is_string(), "{}", r.body);
    }
    s.wait_idle();
}

#[test]
fn a_full_queue_answers_429_and_frees_its_places() {
    let s = serve(2, slow_policy());
    let body = json!({"model": MODEL, "prompt": "1", "max_tokens": 1000, "stream": true, "temperature": 0, "ignore_eos": true}).to_string();
    let mut held: Vec<_> = (0..2)
        .map(|_| {
            let mut stream = open(s.addr(), "POST", "/v1/completions", Some(&body));
            read_until(&mut stream, "data:");
            stream
        })
        .collect();
    let r = post(
        s.addr(),
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "1", "max_tokens": 2}),
    );
    assert_eq!(r.status, 429, "{}", r.body);
    assert!(r.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("at capacity"));
    held.clear();
    s.wait_idle();
    let start = Instant::now();
    loop {
        let r = post(
            s.addr(),
            "/v1/completions",
            &json!({"model": MODEL, "prompt": "1", "max_tokens": 2}),
        );
        if r.status == 200 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "places were not given back"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn disconnected_clients_cancel_their_requests() {
    let s = serve(8, slow_policy());
    for stream in [true, false] {
        let body = json!({"model": MODEL, "prompt": "1", "n": 4, "max_tokens": 1500, "stream": stream, "temperature": 0, "ignore_eos": true}).to_string();
        let before = s.engine.stats().num_generated_tokens;
        let mut socket = open(s.addr(), "POST", "/v1/completions", Some(&body));
        if stream {
            read_until(&mut socket, "data:");
        } else {
            let start = Instant::now();
            while s.engine.stats().num_generated_tokens == before {
                assert!(start.elapsed() < Duration::from_secs(10));
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        drop(socket);
        s.wait_idle();
        let generated = s.engine.stats().num_generated_tokens - before;
        assert!(
            generated < 4 * 1500,
            "stream {stream}: ran to the end ({generated} tokens)"
        );
    }
}

#[test]
fn sixty_four_concurrent_streams_finish_and_return_every_block() {
    let s = serve(256, tiny());
    let addr = s.addr();
    let deadline = Instant::now() + Duration::from_secs(300);
    let clients: Vec<_> = (0..64)
        .map(|i| {
            std::thread::spawn(move || {
                let (path, mut body) = if i % 2 == 0 {
                    (
                        "/v1/completions",
                        json!({"prompt": format!("What is {i}+{i}?")}),
                    )
                } else {
                    (
                        "/v1/chat/completions",
                        json!({"messages": [{"role": "user", "content": format!("{i}*2")}]}),
                    )
                };
                body["model"] = json!(MODEL);
                body["max_tokens"] = json!(24);
                body["stream"] = json!(true);
                body["seed"] = json!(i);
                let r = post(addr, path, &body);
                assert_eq!(r.status, 200, "client {i}: {}", r.body);
                let (_, reasons, _) = collect_stream(&r.sse(), i % 2 == 1);
                assert!(
                    ["stop", "length"].contains(&reasons[0].as_str()),
                    "client {i}: {reasons:?}"
                );
            })
        })
        .collect();
    for c in clients {
        c.join().expect("a client failed");
    }
    assert!(Instant::now() < deadline, "64 clients took too long");
    s.wait_idle();
    let metrics = request(addr, "GET", "/metrics", None).body;
    assert!(metrics.contains("dppo_kv_blocks_used 0"), "{metrics}");
    assert!(metrics.contains("dppo_requests_pending 0"), "{metrics}");
}

#[test]
fn shutdown_ends_open_streams_promptly() {
    let s = serve(8, slow_policy());
    let body = json!({"model": MODEL, "prompt": "1", "max_tokens": 1500, "stream": true, "temperature": 0, "ignore_eos": true}).to_string();
    let mut socket = open(s.addr(), "POST", "/v1/completions", Some(&body));
    read_until(&mut socket, "data:");
    let start = Instant::now();
    let Served { engine, handle, .. } = s;
    handle.shutdown().unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(4),
        "shutdown waited for the stream"
    );
    let rest = read_until(&mut socket, "shutting down");
    assert!(rest.contains("error"));
    let start = Instant::now();
    while engine.stats().blocks_used > 0 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "blocks not freed"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn an_api_key_guards_every_route_but_health() {
    use crate::http::request_with;
    let s = serve_with_key(8, tiny(), Some("sk-right"));
    let body = json!({"model": MODEL, "prompt": "1+1", "max_tokens": 2}).to_string();
    let routes = [
        ("GET", "/v1/models", None),
        ("POST", "/v1/completions", Some(body.as_str())),
        ("POST", "/v1/chat/completions", Some("{}")),
        ("GET", "/metrics", None),
        ("GET", "/v1/no-such-route", None),
    ];
    let right = [("Authorization", "Bearer sk-right")];
    for (method, path, body) in routes {
        let missing = request(s.addr(), method, path, body);
        assert_eq!(missing.status, 401, "{path}: {}", missing.body);
        let error = &missing.json()["error"];
        assert_eq!(error["type"], "invalid_request_error");
        assert!(
            error["message"].as_str().unwrap().contains("API key"),
            "{error}"
        );
        for wrong in [
            "Bearer sk-wrong",
            "Bearer sk-righ",
            "Bearer sk-right-",
            "sk-right",
        ] {
            let r = request_with(s.addr(), method, path, body, &[("Authorization", wrong)]);
            assert_eq!(r.status, 401, "{path} with {wrong:?}");
        }
        let r = request_with(
            s.addr(),
            method,
            path,
            body,
            &[("Authorization", "Bearer sk-wrong")],
        );
        assert_eq!(r.json()["error"]["code"], "invalid_api_key");
        let ok = request_with(s.addr(), method, path, body, &right);
        assert_ne!(ok.status, 401, "{path} with the key: {}", ok.body);
    }
    let ok = request_with(s.addr(), "POST", "/v1/completions", Some(&body), &right);
    assert_eq!(ok.status, 200, "{}", ok.body);
    let health = request(s.addr(), "GET", "/health", None);
    assert_eq!(health.status, 200, "/health stays open for probes");
    let metrics = request_with(s.addr(), "GET", "/metrics", None, &right);
    assert!(
        metrics
            .body
            .contains(r#"route="unauthorized",status="401""#),
        "{}",
        metrics.body
    );
}

/// `dppo serve` (or `dppo run --serve`) as a child process, and the address it printed.
pub struct Child {
    pub process: std::process::Child,
    pub addr: SocketAddr,
}

impl Child {
    /// Starts the binary with `args` and waits for its "listening on" line.
    pub fn start(args: &[&str]) -> Child {
        use std::io::BufRead;
        let mut process = std::process::Command::new(env!("CARGO_BIN_EXE_dppo"))
            .args(args)
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("start dppo");
        let stdout = process.stdout.take().unwrap();
        let mut lines = std::io::BufReader::new(stdout).lines();
        let addr = loop {
            let line = lines.next().expect("dppo exited before listening").unwrap();
            if let Some(rest) = line.strip_prefix("listening on http://") {
                break rest.trim().parse().unwrap();
            }
        };
        // Keep draining stdout so the child never blocks on a full pipe.
        std::thread::spawn(move || lines.for_each(drop));
        Child { process, addr }
    }

    /// Sends Ctrl-C (SIGINT) and expects a clean exit within `secs`.
    pub fn interrupt(mut self, secs: u64) {
        let pid = self.process.id().to_string();
        let sent = std::process::Command::new("kill")
            .args(["-INT", &pid])
            .status()
            .unwrap();
        assert!(sent.success());
        self.wait_success(secs);
    }

    /// Expects the child to exit successfully within `secs`.
    pub fn wait_success(&mut self, secs: u64) {
        let start = Instant::now();
        loop {
            if let Some(status) = self.process.try_wait().unwrap() {
                assert!(status.success(), "dppo exited with {status}");
                return;
            }
            assert!(
                start.elapsed() < Duration::from_secs(secs),
                "dppo did not exit within {secs} s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

#[test]
fn the_openai_python_client_drives_dppo_serve() {
    let smollm2 = crate::util::smollm2_gguf();
    for model in ["builtin:tiny", smollm2.to_str().unwrap()] {
        let child = Child::start(&[
            "serve",
            "--model",
            model,
            "--addr",
            "127.0.0.1:0",
            "--served-model-name",
            "policy",
        ]);
        let out = std::process::Command::new("python3")
            .arg(crate::util::repo_root().join("tests/openai_client.py"))
            .arg(format!("http://{}/v1", child.addr))
            .arg("policy")
            .output()
            .expect("python3 must be installed (with the openai package: .ci/run installs it)");
        assert!(
            out.status.success(),
            "{model}:\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        // Ctrl-C shuts the server down cleanly.
        child.interrupt(20);
    }
}

/// A random JSON value: every type, huge and negative numbers, odd unicode, nesting.
fn random_value(rng: &mut rand::rngs::StdRng, depth: usize) -> Value {
    use rand::Rng;
    let strings = [
        "",
        "hi",
        "ünï😀còdé",
        "\u{0}\u{FFFF}",
        "<|im_end|>",
        "user",
        "tiny",
        "\u{202E}x",
    ];
    match rng.random_range(0..if depth > 3 { 7 } else { 9 }) {
        0 => Value::Null,
        1 => json!(rng.random_bool(0.5)),
        2 => json!([-1i64, 0, 1, 2, 7, 255, 1 << 31, i64::MAX][rng.random_range(0..8)]),
        3 => json!(u64::MAX),
        4 => json!([1e300, -1e-300, 0.5, -0.0, 3.7, f64::MAX][rng.random_range(0..6)]),
        5 => json!(strings[rng.random_range(0..strings.len())]),
        6 => json!("x".repeat(rng.random_range(0..3000))),
        7 => Value::Array(
            (0..rng.random_range(0..4))
                .map(|_| random_value(rng, depth + 1))
                .collect(),
        ),
        _ => {
            let keys = [
                "role", "content", "type", "text", "model", "n", "prompt", "zzz",
            ];
            Value::Object(
                (0..rng.random_range(0..4))
                    .map(|_| {
                        let k = keys[rng.random_range(0..keys.len())].to_string();
                        (k, random_value(rng, depth + 1))
                    })
                    .collect(),
            )
        }
    }
}

/// Mutates `v` in place at a random spot: replace, remove, add, or nest deeply.
fn mutate_value(v: &mut Value, rng: &mut rand::rngs::StdRng) {
    use rand::Rng;
    let descend = rng.random_bool(0.5);
    match v {
        Value::Object(map) if !map.is_empty() && descend => {
            let key = map
                .keys()
                .nth(rng.random_range(0..map.len()))
                .unwrap()
                .clone();
            mutate_value(map.get_mut(&key).unwrap(), rng);
        }
        Value::Array(items) if !items.is_empty() && descend => {
            let i = rng.random_range(0..items.len());
            mutate_value(&mut items[i], rng);
        }
        Value::Object(map) => match rng.random_range(0..3) {
            0 if !map.is_empty() => {
                let key = map
                    .keys()
                    .nth(rng.random_range(0..map.len()))
                    .unwrap()
                    .clone();
                map.remove(&key);
            }
            _ => {
                let fields = [
                    "model",
                    "prompt",
                    "messages",
                    "max_tokens",
                    "n",
                    "stream",
                    "temperature",
                    "top_p",
                    "top_k",
                    "seed",
                    "stop",
                    "logprobs",
                    "top_logprobs",
                    "max_completion_tokens",
                    "ignore_eos",
                    "stream_options",
                    "echo",
                    "user",
                ];
                let key = fields[rng.random_range(0..fields.len())].to_string();
                map.insert(key, random_value(rng, 0));
            }
        },
        _ if rng.random_bool(0.1) => {
            let mut nested = std::mem::take(v);
            for _ in 0..rng.random_range(1..300) {
                nested = json!([nested]);
            }
            *v = nested;
        }
        _ => *v = random_value(rng, 0),
    }
}

/// Seeded garbage against a live server: valid bodies with fields of the wrong type,
/// huge numbers, odd unicode, missing or extra fields, deep nesting, cut or corrupted JSON.
/// Every answer is a whole 2xx or 4xx response (never a 5xx or a dropped connection), and
/// afterwards every KV block is free.
#[test]
fn fuzzed_request_bodies_get_2xx_or_4xx_and_free_every_block() {
    use rand::{Rng, SeedableRng};
    let s = serve(64, tiny());
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    let bases = [
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "What is 2+3?", "max_tokens": 4, "n": 2,
                   "temperature": 0.7, "top_p": 0.9, "seed": 1, "stop": ["\n"], "logprobs": 2}),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 3, "stream": true,
                   "stream_options": {"include_usage": true}}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "system", "content": "be brief"},
                   {"role": "user", "content": [{"type": "text", "text": "1+1"}]}],
                   "max_completion_tokens": 4, "logprobs": true, "top_logprobs": 2}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                   "max_tokens": 3, "stream": true, "n": 2, "temperature": 0}),
        ),
    ];
    let mut statuses = std::collections::BTreeMap::new();
    for case in 0..10_000 {
        let (path, base) = &bases[rng.random_range(0..bases.len())];
        let mut body = base.clone();
        for _ in 0..rng.random_range(1..4) {
            mutate_value(&mut body, &mut rng);
        }
        let mut raw = body.to_string().into_bytes();
        match rng.random_range(0..10) {
            0 => raw.truncate(rng.random_range(0..raw.len())),
            1 => {
                let i = rng.random_range(0..raw.len());
                raw[i] = rng.random();
            }
            _ => {}
        }
        let text = String::from_utf8_lossy(&raw).into_owned();
        let r = crate::http::try_request(s.addr(), "POST", path, Some(&text))
            .unwrap_or_else(|e| panic!("case {case}: connection failed ({e}) on {text:.300}"));
        assert!(
            (200..500).contains(&r.status),
            "case {case}: {} for {text:.300}: {:.300}",
            r.status,
            r.body
        );
        if r.status >= 400 {
            assert!(
                r.json()["error"]["message"].is_string(),
                "case {case}: {}",
                r.body
            );
        } else if r.headers.contains("text/event-stream") {
            let chunks = r.sse();
            assert_eq!(
                chunks.last().map(String::as_str),
                Some("[DONE]"),
                "case {case}"
            );
            for c in &chunks[..chunks.len() - 1] {
                serde_json::from_str::<Value>(c)
                    .unwrap_or_else(|e| panic!("case {case}: chunk {c:.200}: {e}"));
            }
        } else {
            assert!(
                r.json()["choices"].is_array(),
                "case {case}: {:.300}",
                r.body
            );
        }
        *statuses.entry(r.status).or_insert(0) += 1;
    }
    assert!(statuses.get(&200).is_some_and(|&n| n > 100), "{statuses:?}");
    s.wait_idle();
    let health = request(s.addr(), "GET", "/health", None);
    assert_eq!(health.status, 200);
}
