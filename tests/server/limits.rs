//! The server at its limits: bad requests get their status and a clear message, a full
//! queue answers 429, disconnects cancel, load and shutdown leave no request or block behind,
//! an API key guards every route but `/health`.

use std::time::{Duration, Instant};

use serde_json::json;

use super::{collect_stream, serve, serve_with_key, slow_policy, tiny, Served, MODEL};
use crate::http::{open, post, read_until, request};

#[test]
fn bad_requests_get_their_status_and_a_clear_message() {
    let s = serve(8, tiny());
    let long = "1+".repeat(600);
    let cases: Vec<(&str, &str, String, u16, &str)> = vec![
        ("POST", "/v1/completions", "{not json".into(), 400, "invalid JSON body"),
        ("POST", "/v1/completions", json!({"model": MODEL, "prompt": "hi", "repetition_penalty": 1.2}).to_string(), 400, "repetition_penalty = 1.2 is not supported"),
        ("POST", "/v1/chat/completions", json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "guided_json": {"type": "object"}}).to_string(), 400, "guided_json"),
        ("POST", "/v1/chat/completions", json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": false}}).to_string(), 400, "chat_template_kwargs"),
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
    assert!(r.headers.contains("retry-after: 1"), "{}", r.headers);
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
