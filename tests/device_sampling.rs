//! `engine.sampling = "device"` through the whole engine: on the CPU the kernel's host
//! reference draws (`dppo_engine::gumbel`), so these run every step of the path but the
//! kernel (which `dppo doctor --device cuda` compares with the reference on a GPU).

use candle_core::Device;
use dppo_engine::naive::generate_naive_on;
use dppo_engine::{
    AttentionMode, Completion, Engine, EngineConfig, GenerateRequest, SamplingPlace,
};
use dppo_model::{CausalLm, Policy};

use crate::engine::{assert_matches_reference, config, policy, reference, run, tokens, workload};

fn device_sampled(block_size: usize, kv_tokens: usize, mode: AttentionMode) -> EngineConfig {
    EngineConfig {
        sampling: SamplingPlace::Device,
        ..config(block_size, kv_tokens, mode)
    }
}

/// Requests sampled at temperature `t`, request `i` seeded with `100 + i`, groups of 4.
fn seeded(t: f32) -> Vec<GenerateRequest> {
    let mut reqs = workload(6, 4, policy().config.vocab_size);
    for (i, r) in reqs.iter_mut().enumerate() {
        r.sampling.temperature = t;
        r.sampling.seed = Some(100 + i as u64);
    }
    reqs
}

/// `reqs` drawn by a static batch with the device sampler's noise.
fn static_reference(
    policy: &Policy,
    model: &CausalLm,
    reqs: &[GenerateRequest],
) -> Vec<Vec<Completion>> {
    generate_naive_on(
        model,
        reqs,
        policy.eos_token_ids(),
        &Device::Cpu,
        SamplingPlace::Device,
    )
    .unwrap()
}

/// Greedy decoding gives the contiguous reference's tokens and logprobs, with preemption.
#[test]
fn greedy_device_sampling_equals_the_reference() {
    let policy = policy();
    let reqs = workload(8, 2, policy.config.vocab_size);
    let want = reference(&policy, &reqs);
    for (block_size, kv) in [(16, 4096), (4, 64)] {
        for mode in [AttentionMode::Cpu, AttentionMode::Generic] {
            let engine =
                Engine::new(&policy, device_sampled(block_size, kv, mode), Device::Cpu).unwrap();
            let what = format!("block {block_size}, {kv} slots, {mode:?}");
            assert_matches_reference(&run(&engine, &reqs), &want, &what);
        }
    }
}

/// Seeded samples (forked groups, continuous batching, preemption) are exactly what a
/// static batch draws with the same noise: the draw depends only on the sample's seed
/// stream, position and index. Different samples of a group differ.
#[test]
fn seeded_device_samples_equal_the_static_reference_and_ignore_the_batch() {
    let policy = policy();
    let model = policy.model().unwrap();
    for t in [1.0, 0.6] {
        let reqs = seeded(t);
        let want = static_reference(&policy, &model, &reqs);
        for (block_size, kv) in [(16, 4096), (4, 96)] {
            let engine = Engine::new(
                &policy,
                device_sampled(block_size, kv, AttentionMode::Auto),
                Device::Cpu,
            )
            .unwrap();
            let got = run(&engine, &reqs);
            let what = format!("T {t}, block {block_size}, {kv} slots");
            assert_matches_reference(&got, &want, &what);
            let alone = run(&engine, &reqs[2..3]);
            assert_eq!(tokens(&alone)[0], tokens(&got)[2], "{what}");
            assert!(
                tokens(&got).iter().any(|g| g.iter().any(|s| s != &g[0])),
                "{what}: the samples of a group should differ"
            );
        }
    }
}

/// Top-k and top-p are drawn on the device too: the same tokens and logprobs as the static
/// reference with the same noise, whatever the batch.
#[test]
fn truncated_device_draws_equal_the_static_reference() {
    let policy = policy();
    let model = policy.model().unwrap();
    let mut reqs = seeded(0.8);
    reqs[0].sampling.top_k = 5;
    reqs[1].sampling.top_p = 0.9;
    reqs[2].sampling.top_k = 20;
    reqs[2].sampling.top_p = 0.7;
    let want = static_reference(&policy, &model, &reqs);
    let engine = Engine::new(
        &policy,
        device_sampled(4, 96, AttentionMode::Auto),
        Device::Cpu,
    )
    .unwrap();
    assert_matches_reference(&run(&engine, &reqs), &want, "top-k and top-p");
}

/// Top logprobs come from the device with every greedy token: the host sampler's.
#[test]
fn device_top_logprobs_are_the_host_samplers() {
    let policy = policy();
    let mut reqs = workload(4, 1, policy.config.vocab_size);
    for r in &mut reqs {
        r.sampling.top_logprobs = 3;
    }
    let host = Engine::new(&policy, config(16, 4096, AttentionMode::Auto), Device::Cpu).unwrap();
    let device = Engine::new(
        &policy,
        device_sampled(16, 4096, AttentionMode::Auto),
        Device::Cpu,
    )
    .unwrap();
    let (a, b) = (run(&host, &reqs), run(&device, &reqs));
    assert_eq!(tokens(&a), tokens(&b));
    for (ra, rb) in a.iter().zip(&b) {
        for (ca, cb) in ra.iter().zip(rb) {
            assert_eq!(ca.top_logprobs.len(), ca.token_ids.len());
            for (ta, tb) in ca.top_logprobs.iter().zip(&cb.top_logprobs) {
                assert_eq!(ta.len(), 3);
                for ((ia, la), (ib, lb)) in ta.iter().zip(tb) {
                    assert_eq!(ia, ib);
                    assert!((la - lb).abs() < 1e-4, "{la} vs {lb}");
                }
            }
        }
    }
}
