//! The engine against the contiguous-cache reference: greedy outputs token for token and
//! logprobs within 1e-4 (block sizes, preemption, staggered arrivals, groups), under both
//! attention backends the CPU has (its kernel and the device-generic path); seeded
//! sampling, bad requests, and the bf16 engine against f32 ([`smollm2`]); requests over
//! their lives in [`lifecycle`].

use std::sync::Arc;

use candle_core::{DType, Device};
use dppo_engine::naive::generate_naive;
use dppo_engine::{
    AttentionMode, Completion, Engine, EngineConfig, Event, FinishReason, GenerateRequest,
    Priority, SamplingParams,
};
use dppo_model::{Arch, Policy};

use crate::util::{random_policy, small_config};

mod lifecycle;
mod smollm2;
pub(crate) use smollm2::{assert_bf16_agrees_with_f32, smollm2_requests};

/// The attention backends the CPU runs: its kernel and the device-generic path (what a GPU
/// runs), each checked against the same reference.
const MODES: [AttentionMode; 2] = [AttentionMode::Cpu, AttentionMode::Generic];

pub(crate) fn policy() -> Policy {
    let mut cfg = small_config(Arch::Llama);
    cfg.max_position_embeddings = 128;
    random_policy(&cfg, 21)
}

fn greedy(prompt_ids: Vec<u32>, n: usize, max_tokens: usize) -> GenerateRequest {
    let mut r = GenerateRequest::new(prompt_ids, n, max_tokens);
    r.sampling.temperature = 0.0;
    r.ignore_eos = true;
    r
}

/// Prompts of lengths 1..=23 with varied contents.
pub(crate) fn workload(num: usize, n: usize, vocab: usize) -> Vec<GenerateRequest> {
    (0..num)
        .map(|p| {
            let len = 1 + (p * 7) % 23;
            let ids = (0..len)
                .map(|i| ((i * 11 + p * 5 + 3) % vocab) as u32)
                .collect();
            greedy(ids, n, 6 + p % 9)
        })
        .collect()
}

/// [`workload`] sampled at temperature 1, request `i` seeded with `first_seed + i`.
fn seeded_workload(num: usize, n: usize, vocab: usize, first_seed: u64) -> Vec<GenerateRequest> {
    let mut reqs = workload(num, n, vocab);
    for (i, r) in reqs.iter_mut().enumerate() {
        r.sampling = SamplingParams {
            temperature: 1.0,
            seed: Some(first_seed + i as u64),
            ..SamplingParams::default()
        };
    }
    reqs
}

pub(crate) fn reference(policy: &Policy, reqs: &[GenerateRequest]) -> Vec<Vec<Completion>> {
    let model = policy.model().unwrap();
    generate_naive(&model, reqs, policy.eos_token_ids(), &Device::Cpu).unwrap()
}

pub(crate) fn run(engine: &Engine, reqs: &[GenerateRequest]) -> Vec<Vec<Completion>> {
    engine.generate(reqs.to_vec()).unwrap()
}

/// The token ids of every sample of every request.
pub(crate) fn tokens(out: &[Vec<Completion>]) -> Vec<Vec<Vec<u32>>> {
    out.iter()
        .map(|cs| cs.iter().map(|c| c.token_ids.clone()).collect())
        .collect()
}

/// `got` is the reference `want`: the same tokens, and logprobs within 1e-4.
pub(crate) fn assert_matches_reference(
    got: &[Vec<Completion>],
    want: &[Vec<Completion>],
    what: &str,
) {
    assert_eq!(tokens(got), tokens(want), "{what}");
    for (r, (g, w)) in got.iter().zip(want).enumerate() {
        for (s, (g, w)) in g.iter().zip(w).enumerate() {
            for (t, (a, b)) in g.logprobs.iter().zip(&w.logprobs).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4,
                    "{what}: request {r} sample {s} token {t}: logprob {a} vs {b}"
                );
            }
        }
    }
}

pub(crate) fn config(
    block_size: usize,
    kv_cache_tokens: usize,
    attention: AttentionMode,
) -> EngineConfig {
    EngineConfig {
        block_size,
        kv_cache_tokens: Some(kv_cache_tokens),
        max_num_seqs: 32,
        max_batched_tokens: 64,
        attention,
        ..EngineConfig::default()
    }
}

#[test]
fn greedy_paged_equals_contiguous_reference_for_every_block_size() {
    let policy = policy();
    let reqs = workload(10, 2, policy.config.vocab_size);
    let want = reference(&policy, &reqs);
    for mode in MODES {
        for block_size in [1, 16, 7] {
            let engine = Engine::new(&policy, config(block_size, 4096, mode), Device::Cpu).unwrap();
            let what = format!("{mode:?}, block_size {block_size}");
            assert_matches_reference(&run(&engine, &reqs), &want, &what);
            assert_eq!(engine.stats().num_preemptions, 0);
        }
    }
}

#[test]
fn preemption_keeps_greedy_outputs() {
    let policy = policy();
    let reqs = workload(12, 3, policy.config.vocab_size);
    let want = reference(&policy, &reqs);
    for mode in MODES {
        // 64 slots: far less than the workload needs at once.
        let engine = Engine::new(&policy, config(4, 64, mode), Device::Cpu).unwrap();
        assert_matches_reference(&run(&engine, &reqs), &want, &format!("{mode:?}"));
        assert!(
            engine.stats().num_preemptions > 0,
            "{mode:?}: the pool was meant to run out"
        );
    }
}

#[test]
fn staggered_arrivals_from_many_threads() {
    let policy = policy();
    let reqs = workload(8, 2, policy.config.vocab_size);
    let want = reference(&policy, &reqs);
    let engine =
        Arc::new(Engine::new(&policy, config(16, 2048, AttentionMode::Auto), Device::Cpu).unwrap());
    let threads: Vec<_> = reqs
        .iter()
        .cloned()
        .enumerate()
        .map(|(i, r)| {
            let engine = engine.clone();
            std::thread::spawn(move || {
                std::thread::sleep(std::time::Duration::from_millis(3 * i as u64));
                engine
                    .submit(r)
                    .unwrap()
                    .wait()
                    .into_iter()
                    .map(|c| c.token_ids)
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let got: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(got, tokens(&want));
}

#[test]
fn seeded_group_samples_equal_reference_and_differ_from_each_other() {
    let policy = policy();
    let reqs = seeded_workload(4, 4, policy.config.vocab_size, 100);
    let want = reference(&policy, &reqs);
    for mode in MODES {
        let engine = Engine::new(&policy, config(4, 4096, mode), Device::Cpu).unwrap();
        let got = run(&engine, &reqs);
        // Copy-on-write must not change any sibling's tokens.
        assert_matches_reference(&got, &want, &format!("{mode:?}"));
        let got = tokens(&got);
        assert!(
            got.iter().any(|g| g.iter().any(|s| s != &g[0])),
            "samples of a group should differ"
        );
        // Seeded results do not depend on the rest of the batch.
        let alone = tokens(&run(&engine, &reqs[1..2]));
        assert_eq!(alone[0], got[1], "{mode:?}");
    }
}

/// Every op of a forward pass treats rows independently (the CPU projection kernels
/// accumulate each output in a fixed order), so a sample's logprobs are bit-identical whether
/// its group runs alone or in a batch with other groups. `kernels::` runs this under every
/// kernel the CPU has.
#[test]
fn logprobs_are_bit_identical_alone_and_in_a_batch() {
    let policy = policy();
    let reqs = seeded_workload(6, 4, policy.config.vocab_size, 200);
    let engine = Engine::new(&policy, config(4, 4096, AttentionMode::Auto), Device::Cpu).unwrap();
    let logprobs = |reqs: &[GenerateRequest]| -> Vec<Vec<Vec<u32>>> {
        engine
            .generate(reqs.to_vec())
            .unwrap()
            .into_iter()
            .map(|cs| {
                cs.into_iter()
                    .map(|c| c.logprobs.iter().map(|l| l.to_bits()).collect())
                    .collect()
            })
            .collect()
    };
    let batched = logprobs(&reqs);
    for i in [0, 3, 5] {
        assert_eq!(logprobs(&reqs[i..i + 1])[0], batched[i], "group {i}");
    }
}

/// The attention's read counters account exactly: each scheduled sequence reads its whole
/// context, the blocks a group's samples share once. Two prompts (lengths 5 and 9, blocks of
/// 4) prefill together in one iteration, each as one row sampling its group's G = 3 first
/// tokens; then every sample decodes T - 1 = 5 more tokens, step k reading the prompt's full
/// blocks (shared) and, of its own, the prompt's last partial block and k generated tokens.
#[test]
fn decode_steps_count_the_kv_they_attend() {
    let policy = policy();
    let engine = Engine::new(&policy, config(4, 512, AttentionMode::Auto), Device::Cpu).unwrap();
    let (lens, g, t) = ([5usize, 9], 3, 6);
    let reqs = lens
        .iter()
        .map(|&l| greedy((1..=l as u32).collect(), g, t))
        .collect();
    engine.generate(reqs).unwrap();
    let stats = engine.stats();
    let decoded = |l: usize| {
        let shared = l / 4 * 4;
        (1..t).map(|k| shared + g * (l - shared + k)).sum::<usize>()
    };
    let decode_kv: usize = lens.iter().map(|&l| decoded(l)).sum();
    let prefill_kv: usize = lens.iter().sum();
    assert_eq!(stats.num_iterations, t);
    assert_eq!(stats.num_decode_iterations, t - 1);
    assert_eq!(stats.decode_cost.kv_tokens as usize, decode_kv);
    assert_eq!(stats.decode_cost.seqs as usize, lens.len() * g * (t - 1));
    assert_eq!(stats.cost.kv_tokens as usize, prefill_kv + decode_kv);
    assert_eq!(stats.cost.seqs as usize, lens.len() * (1 + g * (t - 1)));
}

/// Timing the device (`time_device`) changes no output, only adds the attention's time, on
/// the CPU kernel and on the generic path alike: a part of the forward pass's.
#[test]
fn timing_the_device_splits_the_forward_pass_and_changes_nothing_else() {
    let policy = policy();
    let reqs = workload(4, 2, policy.config.vocab_size);
    for attention in [AttentionMode::Cpu, AttentionMode::Generic] {
        let out = |time_device| {
            let cfg = EngineConfig {
                time_device,
                ..config(4, 512, attention)
            };
            let engine = Engine::new(&policy, cfg, Device::Cpu).unwrap();
            (run(&engine, &reqs), engine.stats().cost)
        };
        let (plain, plain_cost) = out(false);
        let (timed, timed_cost) = out(true);
        assert_eq!(plain_cost.attention_ns, 0, "{attention:?}");
        assert!(timed_cost.attention_ns > 0, "{attention:?}");
        assert!(
            timed_cost.attention_ns < timed_cost.forward_ns,
            "{attention:?}"
        );
        assert!(
            timed_cost.attention_wait_ns <= timed_cost.attention_ns,
            "{attention:?}"
        );
        assert_eq!(tokens(&timed), tokens(&plain), "{attention:?}");
        for (t, p) in timed.iter().flatten().zip(plain.iter().flatten()) {
            assert_eq!(t.logprobs, p.logprobs, "{attention:?}");
        }
    }
}

#[test]
fn bad_requests_get_clear_errors() {
    let policy = policy();
    let engine = Engine::new(&policy, config(16, 2048, AttentionMode::Auto), Device::Cpu).unwrap();
    let err = |r: GenerateRequest| {
        engine
            .submit(r)
            .err()
            .expect("must be rejected")
            .to_string()
    };
    let long = greedy(vec![1; 120], 1, 20);
    assert!(err(long).contains("exceeds the model's context of 128 tokens"));
    assert!(err(greedy(vec![1, 2], 0, 4)).contains("n must be between 1"));
    assert!(err(greedy(vec![], 1, 4)).contains("prompt is empty"));
    let mut hot = greedy(vec![1], 1, 4);
    hot.sampling.temperature = -1.0;
    assert!(err(hot).contains("temperature"));
    let mut nucleus = greedy(vec![1], 1, 4);
    nucleus.sampling.top_p = 0.0;
    assert!(err(nucleus).contains("top_p"));
    let mut min_p = greedy(vec![1], 1, 4);
    min_p.sampling.min_p = 1.5;
    assert!(err(min_p).contains("min_p must be in [0, 1], got 1.5"));
    assert!(err(greedy(vec![100_000], 1, 4)).contains("outside the vocabulary"));
}

#[test]
fn the_cuda_kernels_asked_for_on_the_cpu_are_a_clear_error() {
    let err = Engine::new(&policy(), config(16, 256, AttentionMode::Cuda), Device::Cpu)
        .err()
        .unwrap();
    assert!(
        err.to_string()
            .contains("engine.attention = \"cuda\" runs on a GPU of a CUDA build"),
        "{err}"
    );
}

#[test]
fn the_cpu_kernel_asked_for_where_it_cannot_run_is_a_clear_error() {
    let cfg = EngineConfig {
        dtype: Some(DType::BF16),
        ..config(16, 256, AttentionMode::Cpu)
    };
    let err = Engine::new(&policy(), cfg, Device::Cpu).err().unwrap();
    assert!(err
        .to_string()
        .contains("engine.attention = \"cpu\" runs f32 on the CPU only"));
    // "auto" picks the generic path for bf16 and matches the explicit choice.
    let reqs = workload(3, 2, policy().config.vocab_size);
    let out = |attention| {
        let cfg = EngineConfig { attention, ..cfg };
        tokens(&run(
            &Engine::new(&policy(), cfg, Device::Cpu).unwrap(),
            &reqs,
        ))
    };
    assert_eq!(out(AttentionMode::Auto), out(AttentionMode::Generic));
}
