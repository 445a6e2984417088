//! The engine's numbers depend on the sequence alone: on the CPU kernel in f32, a
//! sequence's logprobs are the same bits whatever the batch, the prefill chunking and the
//! block size.

use candle_core::Device;
use dppo_engine::{AttentionMode, Engine, EngineConfig, GenerateRequest};
use dppo_model::Policy;

use crate::engine::{config, policy, run, smollm2_requests, workload};

/// The CPU kernel's logprobs are the same bits whatever else is in the batch, however the
/// prefill is chunked (down to 3 tokens an iteration, so prefill chunks and decode rows mix)
/// and whatever the block size: a sequence's numbers depend on the sequence alone, the
/// ground an exact learner pass can stand on (issue #41, point 4).
#[test]
fn cpu_logprobs_are_the_same_bits_whatever_the_batch_chunking_and_blocks() {
    let check = |policy: &Policy, reqs: &[GenerateRequest], alone_cfg: EngineConfig| {
        let base = Engine::new(policy, config(16, 4096, AttentionMode::Cpu), Device::Cpu).unwrap();
        let together = run(&base, reqs);
        let engine = Engine::new(policy, alone_cfg, Device::Cpu).unwrap();
        let mut compared = 0;
        for (i, r) in reqs.iter().enumerate() {
            let alone = run(&engine, std::slice::from_ref(r));
            for (a, b) in alone[0].iter().zip(&together[i]) {
                assert_eq!(a.token_ids, b.token_ids, "request {i}");
                for (t, (x, y)) in a.logprobs.iter().zip(&b.logprobs).enumerate() {
                    assert_eq!(
                        x.to_bits(),
                        y.to_bits(),
                        "request {i} token {t}: {x} vs {y}"
                    );
                    compared += 1;
                }
            }
        }
        assert!(compared > 0);
    };
    let chunked = |max_batched_tokens, block_size, kv| EngineConfig {
        max_batched_tokens,
        ..config(block_size, kv, AttentionMode::Cpu)
    };
    let tiny = policy();
    let reqs = workload(8, 2, tiny.config.vocab_size);
    check(&tiny, &reqs, config(16, 4096, AttentionMode::Cpu));
    check(&tiny, &reqs, chunked(4, 4, 256));
    let (smol, reqs) = smollm2_requests(2, 8);
    check(&smol, &reqs, chunked(3, 4, 1024));
}
