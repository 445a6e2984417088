//! `engine.fused_kernels`: candle-nn's fused RMSNorm, rotary embedding, SiLU and softmax in
//! the engine, and q/k/v and gate/up as one GEMM each over weights concatenated in the
//! engine's buffers. On the CPU they run where dppo's own fused f32 ops do not (bf16, f64,
//! and the generic attention's softmax), with the same numbers as the ops they replace.

use candle_core::{DType, Device};
use dppo_engine::{AttentionMode, Engine, EngineConfig, FusedKernels};

use crate::engine::{
    assert_bf16_agrees_with_f32, assert_matches_reference, config, policy, reference, run,
    smollm2_requests, tokens, workload,
};
use crate::util::random_policy;

/// f32 through the generic attention (its softmax fused) gives the contiguous reference's
/// tokens and logprobs within 1e-4, preemption included.
#[test]
fn fused_kernels_keep_the_f32_reference() {
    let policy = policy();
    let reqs = workload(8, 2, policy.config.vocab_size);
    let want = reference(&policy, &reqs);
    for (block_size, kv) in [(16, 4096), (4, 64)] {
        let cfg = EngineConfig {
            fused_kernels: FusedKernels::On,
            ..config(block_size, kv, AttentionMode::Generic)
        };
        let engine = Engine::new(&policy, cfg, Device::Cpu).unwrap();
        assert_matches_reference(&run(&engine, &reqs), &want, &format!("block {block_size}"));
    }
}

/// SmolLM2 in bf16 with every kernel fused (the GPU's path: RMSNorm, rope, SiLU and the
/// softmax all through candle-nn) agrees with f32 as the composites do.
#[test]
fn smollm2_bf16_with_fused_kernels_agrees_with_f32() {
    let (policy, reqs) = smollm2_requests(1, 16);
    let generate = |dtype, fused_kernels| {
        let cfg = EngineConfig {
            dtype: Some(dtype),
            fused_kernels: FusedKernels::from(fused_kernels),
            ..config(16, 1024, AttentionMode::Auto)
        };
        run(&Engine::new(&policy, cfg, Device::Cpu).unwrap(), &reqs)
    };
    let fused = generate(DType::BF16, true);
    assert_bf16_agrees_with_f32(&generate(DType::F32, false), &fused);
    // The kernels did run: bf16 rounds differently through them (candle-nn's RMSNorm
    // scales by its weight before rounding, the composite after).
    let logprobs = |out: &[Vec<dppo_engine::Completion>]| -> Vec<u32> {
        out.iter()
            .flat_map(|c| c[0].logprobs.iter().map(|l| l.to_bits()))
            .collect()
    };
    assert_ne!(logprobs(&fused), logprobs(&generate(DType::BF16, false)));
}

/// The fused projections (an f64 engine casts the f32 policy into buffers of its own, so it
/// fuses) give the unfused engine's tokens and logprobs, before and after a publication,
/// which reaches the concatenated weights through their parts.
#[test]
fn fused_projections_match_the_separate_ones_across_a_publication() {
    let policy = policy();
    let other = random_policy(&policy.config, 99);
    let reqs = workload(6, 2, policy.config.vocab_size);
    let f64_engine = |policy, fused_kernels| {
        let cfg = EngineConfig {
            dtype: Some(DType::F64),
            fused_kernels: FusedKernels::from(fused_kernels),
            ..config(16, 2048, AttentionMode::Generic)
        };
        Engine::new(policy, cfg, Device::Cpu).unwrap()
    };
    let engines = [false, true].map(|fused| f64_engine(&policy, fused));
    let qkv = "model.layers.0.self_attn.qkv_proj.weight";
    let fused_in = |e: &Engine| e.published_weights().fused(qkv).is_some();
    assert!(!fused_in(&engines[0]) && fused_in(&engines[1]));
    for round in ["before", "after"] {
        let [plain, fused] = engines.each_ref().map(|e| run(e, &reqs));
        assert_eq!(tokens(&plain), tokens(&fused), "{round}");
        assert_matches_reference(&fused, &plain, round);
        for engine in &engines {
            engine.publish(&other.weights).unwrap();
        }
    }
    // The publication took: the fused engine generates what one started on it does.
    let want = run(&f64_engine(&other, false), &reqs);
    assert_matches_reference(&run(&engines[1], &reqs), &want, "published");
}
