//! The engine on the emulated kernels: `engine.attention = "cuda"` on the CPU, which the
//! engine's unit tests resolve to `super` (builds without CUDA only).

use candle_core::Device;
use dppo_model::presets::task_tokenizer;
use dppo_model::{Arch, ModelConfig, Policy, Weights};

use crate::{AttentionMode, Engine, EngineConfig, GenerateRequest};

/// A model the kernels serve: 6 query heads over 2 KV heads of 32 dimensions; weights
/// wide enough that greedy choices are not near-ties.
fn policy() -> Policy {
    let tokenizer = task_tokenizer().unwrap();
    let config = ModelConfig {
        arch: Arch::Qwen3,
        vocab_size: tokenizer.vocab_size(),
        hidden_size: 96,
        intermediate_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 6,
        num_key_value_heads: 2,
        head_dim: 32,
        rope_theta: 10_000.0,
        rms_norm_eps: 1e-6,
        tie_word_embeddings: true,
        max_position_embeddings: 256,
        qkv_bias: false,
        o_bias: false,
        qk_norm: true,
        bos_token_id: None,
        eos_token_ids: vec![0],
    };
    let weights = Weights::random(&config, 0.2, 5, &Device::Cpu).unwrap();
    Policy::new(config, weights, tokenizer).unwrap()
}

/// Greedy requests: prompts of 1 to 58 tokens, 1 to 3 samples each, 10 to 24 new tokens.
fn requests(vocab: usize) -> Vec<GenerateRequest> {
    (0..10)
        .map(|p| {
            let len = 1 + (p * 13) % 60;
            let ids = (0..len).map(|i| ((i * 7 + p * 3 + 5) % vocab) as u32);
            let mut r = GenerateRequest::new(ids.collect(), 1 + p % 3, 10 + (p * 5) % 15);
            r.sampling.temperature = 0.0;
            r.ignore_eos = true;
            r
        })
        .collect()
}

/// The engine with the emulated CUDA kernels generates what it generates with the generic
/// path (the same tokens, logprobs within 1e-4): chunked prefill, groups sharing their
/// prompts' blocks, and a pool small enough to preempt, so block tables grow, fork, free and
/// come back between iterations.
#[test]
fn the_engine_on_the_emulated_kernels_generates_what_the_generic_path_does() {
    let policy = policy();
    let reqs = requests(policy.config.vocab_size);
    let config = |attention| EngineConfig {
        block_size: 4,
        kv_cache_tokens: Some(192),
        max_num_seqs: 12,
        max_batched_tokens: 24,
        attention,
        ..EngineConfig::default()
    };
    let run = |attention| {
        let engine = Engine::new(&policy, config(attention), Device::Cpu).unwrap();
        let out = engine.generate(reqs.clone()).unwrap();
        (out, engine.stats().num_preemptions)
    };
    let (want, _) = run(AttentionMode::Generic);
    let (got, preemptions) = run(AttentionMode::Cuda);
    assert!(preemptions > 0, "the pool was meant to run out");
    assert_eq!(got.len(), reqs.len());
    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.len(), reqs[r].n, "request {r}'s samples");
        for (s, (g, w)) in g.iter().zip(w).enumerate() {
            assert_eq!(
                g.logprobs.len(),
                g.token_ids.len(),
                "request {r} sample {s}"
            );
            assert_eq!(g.token_ids, w.token_ids, "request {r} sample {s}");
            for (t, (a, b)) in g.logprobs.iter().zip(&w.logprobs).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4,
                    "request {r} sample {s} token {t}: logprob {a} vs {b}"
                );
            }
        }
    }
}
