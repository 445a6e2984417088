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
use dppo_server::{spawn, ApiKey, ServerConfig, ServerHandle};
use serde_json::{json, Value};

use crate::http::{post, request};
use crate::util::small_config;

mod fuzz;
mod limits;

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
        api_key: api_key.map(ApiKey::new),
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
    // One model by id (the `openai` client's `models.retrieve`).
    let one = request(s.addr(), "GET", &format!("/v1/models/{MODEL}"), None);
    assert_eq!(
        (one.status, &one.json()["id"]),
        (200, &json!(MODEL)),
        "{}",
        one.body
    );
    let other = request(s.addr(), "GET", "/v1/models/org/gpt-9", None);
    assert_eq!(other.status, 404, "{}", other.body);
    assert!(other.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("`org/gpt-9` does not exist"));
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
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let created = body["created"].as_u64().unwrap();
    assert!(created <= now && now - created < 60, "{created} vs {now}");
    // Without `model` (the served one, as vLLM), with vLLM's parameters at their defaults
    // and parameters that change nothing: the same answer.
    let r = post(
        s.addr(),
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 10, "temperature": 0, "repetition_penalty": 1.0,
                "skip_special_tokens": true, "stop_token_ids": [], "user": "me"}),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.json()["choices"][0]["text"], s.text(&want));
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
    // Text parts are joined by newlines, as vLLM joins them.
    let joined = s
        .policy
        .tokenizer
        .apply_chat_template(&[ChatMessage::new("user", "What is\n7*6?")], true)
        .unwrap();
    let r = post(
        s.addr(),
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "7*6?"}]}],
                "max_tokens": 1, "temperature": 0}),
    );
    let prompt_tokens = s.policy.tokenizer.encode(&joined, false).unwrap().len();
    assert_eq!(
        r.json()["usage"]["prompt_tokens"],
        prompt_tokens,
        "{}",
        r.body
    );
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
        // Up to logprobs + 1 entries, the sampled token always among them (as OpenAI's).
        assert!(!top.is_empty() && top.len() <= 4);
        let token = tokens[i].as_str().unwrap();
        assert_eq!(top[token], lp["token_logprobs"][i], "{top:?}");
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
