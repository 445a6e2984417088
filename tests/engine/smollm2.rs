//! The engine on SmolLM2: paged greedy outputs against the contiguous reference, and its
//! bf16 engine against f32.

use super::*;

/// SmolLM2 and greedy requests for its test prompts, `n` samples of `max_tokens` each.
pub(crate) fn smollm2_requests(n: usize, max_tokens: usize) -> (Policy, Vec<GenerateRequest>) {
    let path = crate::util::smollm2_gguf();
    let policy = Policy::load(path.to_str().unwrap(), &Device::Cpu).unwrap();
    let tok = &policy.tokenizer;
    let reqs = ["The capital of France is", "1, 2, 3, 4,", "def fib(n):"]
        .iter()
        .map(|p| greedy(tok.encode(p, false).unwrap(), n, max_tokens))
        .collect();
    (policy, reqs)
}

#[test]
fn smollm2_greedy_paged_equals_contiguous_reference() {
    let (policy, reqs) = smollm2_requests(2, 12);
    let want = reference(&policy, &reqs);
    for mode in MODES {
        for block_size in [16, 3] {
            let engine = Engine::new(&policy, config(block_size, 1024, mode), Device::Cpu).unwrap();
            let what = format!("{mode:?}, block_size {block_size}");
            assert_matches_reference(&run(&engine, &reqs), &want, &what);
        }
    }
}

/// The bf16 engine (weights and KV cache in bf16, the generic path: a GPU's numerics) gives
/// SmolLM2's f32 greedy tokens for the first 16 tokens of every test prompt, with logprobs
/// within 0.05 of f32's on average.
#[test]
fn smollm2_bf16_engine_agrees_with_f32() {
    let (policy, reqs) = smollm2_requests(1, 16);
    let generate = |dtype| {
        let cfg = EngineConfig {
            dtype: Some(dtype),
            ..config(16, 1024, AttentionMode::Auto)
        };
        run(&Engine::new(&policy, cfg, Device::Cpu).unwrap(), &reqs)
    };
    assert_bf16_agrees_with_f32(&generate(DType::F32), &generate(DType::BF16));
}

/// Greedy samples of 16 tokens in bf16 (`got`) and f32 (`want`) agree on every token, and
/// their logprobs differ by less than 0.05 on average; prints the agreement.
pub(crate) fn assert_bf16_agrees_with_f32(want: &[Vec<Completion>], got: &[Vec<Completion>]) {
    let (mut diff_sum, mut num_compared) = (0f32, 0usize);
    for (r, (a, b)) in want.iter().zip(got).enumerate() {
        let (a, b) = (&a[0], &b[0]);
        let agree = a
            .token_ids
            .iter()
            .zip(&b.token_ids)
            .take_while(|(x, y)| x == y)
            .count();
        eprintln!("prompt {r}: bf16 agrees with f32 on {agree} of 16 greedy tokens");
        assert_eq!(
            agree, 16,
            "prompt {r}: {:?} vs {:?}",
            a.token_ids, b.token_ids
        );
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            diff_sum += (x - y).abs();
            num_compared += 1;
        }
    }
    let mean = diff_sum / num_compared as f32;
    eprintln!("mean |logprob bf16 - f32| over {num_compared} tokens: {mean:.4}");
    assert!(mean < 0.05, "mean logprob difference {mean}");
}
