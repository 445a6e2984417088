//! Seeded garbage against a live server: every answer a whole 2xx or 4xx, every block free.

use serde_json::{json, Value};

use super::{serve, tiny, MODEL};
use crate::http::request;

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
