//! Numerics against HF transformers: logits of tiny random Llama / Qwen2 / Qwen3
//! checkpoints, and SmolLM2-135M-Instruct from its GGUF (tokenizer, chat template, greedy
//! continuation). Expected values come from `tests/fixtures/make_fixtures.py`.

use candle_core::{Device, Tensor};
use dppo_model::{CausalAttention, ChatMessage, Policy};
use serde_json::Value;

use crate::util::{fixture, logits, smollm2_gguf};

fn json(path: &std::path::Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn logits_match_transformers_on_tiny_checkpoints() {
    for name in ["llama", "llama_tied", "qwen2", "qwen3"] {
        let dir = fixture(&format!("hf/{name}"));
        let loaded = Policy::load(dir.to_str().unwrap(), &Device::Cpu)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        // What we save must load back to the same numbers.
        let tmp = tempfile::tempdir().unwrap();
        loaded.save_hf(&tmp.path().join(name)).unwrap();
        let resaved = Policy::load(tmp.path().join(name).to_str().unwrap(), &Device::Cpu).unwrap();
        let reference = json(&dir.join("reference.json"));
        for policy in [&loaded, &resaved] {
            let seqs = reference["input_ids"].as_array().unwrap();
            let want_all = reference["logits"].as_array().unwrap();
            for (seq, want) in seqs.iter().zip(want_all) {
                let want: Vec<f32> = want
                    .as_array()
                    .unwrap()
                    .iter()
                    .flat_map(|row| {
                        row.as_array()
                            .unwrap()
                            .iter()
                            .map(|x| x.as_f64().unwrap() as f32)
                    })
                    .collect();
                let got = logits(policy, &ids_of(seq));
                assert_close!(got, want, 1e-4);
            }
        }
    }
}

#[test]
fn generation_config_eos_ids_are_read() {
    let policy = Policy::load(fixture("hf/qwen3").to_str().unwrap(), &Device::Cpu).unwrap();
    let gen = json(&fixture("hf/qwen3/generation_config.json"));
    let want = ids_of(&gen["eos_token_id"]);
    assert_eq!(want.len(), 2);
    for id in want {
        assert!(
            policy.eos_token_ids().contains(&id),
            "{id} not among {:?}",
            policy.eos_token_ids()
        );
    }
}

/// SmolLM2 expectations, made by transformers from the same GGUF.
fn smollm2() -> (Policy, Value) {
    let policy = Policy::load(smollm2_gguf().to_str().unwrap(), &Device::Cpu).unwrap();
    (policy, json(&fixture("smollm2.json")))
}

#[test]
fn smollm2_gguf_matches_transformers() {
    let (policy, want) = smollm2();
    let tok = &policy.tokenizer;
    // 1. Tokenizer rebuilt from GGUF metadata: same ids and same decoded text.
    let strings = want["strings"].as_array().unwrap();
    for (i, s) in strings.iter().enumerate() {
        let s = s.as_str().unwrap();
        let ids = tok.encode(s, false).unwrap();
        assert_eq!(ids, ids_of(&want["token_ids"][i]), "token ids of {s:?}");
        assert_eq!(
            tok.decode(&ids, false).unwrap(),
            want["decoded"][i].as_str().unwrap()
        );
    }
    // 2. Chat template from GGUF metadata renders as transformers renders it.
    let messages: Vec<ChatMessage> = serde_json::from_value(want["chat_messages"].clone()).unwrap();
    let prompt = tok.apply_chat_template(&messages, true).unwrap();
    assert_eq!(prompt, want["chat_prompt"].as_str().unwrap());
    let mut ids = tok.encode(&prompt, false).unwrap();
    assert_eq!(ids, ids_of(&want["chat_prompt_ids"]));
    // 3. Greedy continuation, token for token (full recompute each step: no cache involved).
    let model = policy.model().unwrap();
    let greedy = ids_of(&want["greedy_ids"]);
    for _ in 0..greedy.len() {
        let ids_t = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
        let pos = Tensor::arange(0u32, ids.len() as u32, &Device::Cpu).unwrap();
        let hidden = model.forward(&ids_t, &pos, &mut CausalAttention).unwrap();
        let last = hidden.narrow(0, ids.len() - 1, 1).unwrap();
        let next = model
            .logits(&last)
            .unwrap()
            .argmax(1)
            .unwrap()
            .to_vec1::<u32>()
            .unwrap()[0];
        ids.push(next);
    }
    let n = ids.len();
    assert_eq!(&ids[n - greedy.len()..], greedy.as_slice());
}
