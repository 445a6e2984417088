//! kernels/paged_attention.cu itself, run on the CPU ([`crate::kernel_emu`]) over the GPU
//! check's batches and geometry: the block tables written entry by entry, the new K/V written
//! into their slots, the attention and the merge of its splits. Held bit for bit to the CPU
//! twin (its output rounded to the dtype) and within the GPU check's tolerance to the f64
//! reference.

use candle_core::Device;
use dppo_model::presets::task_tokenizer;
use dppo_model::{Arch, ModelConfig, Policy, Weights};

use super::{attend, write_entries, write_slots, Stored};
use crate::cuda_attn::case::{checked_cases, tolerance, Case};
use crate::cuda_attn::twin::{self, Caches};
use crate::cuda_attn::KernelPlan;
use crate::{AttentionMode, Engine, EngineConfig, GenerateRequest};

/// Twice the multiprocessors of an H100 SXM: the engine's split target on one.
const MIN_BLOCKS: usize = 2 * 132;

fn stored<T: Stored>(xs: &[f32]) -> Vec<T> {
    xs.iter().map(|&x| T::of(x)).collect()
}

fn bits<T: Stored>(xs: &[T]) -> Vec<u32> {
    xs.iter().map(|x| x.bits()).collect()
}

/// What the emulated kernels leave: the output, both pools and the block tables.
struct Emulated<T> {
    out: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    tables: Vec<u32>,
}

/// One batch through the kernels in `T`: the block tables written entry by entry from
/// zero, the new K/V into their slots, the attention and its merge.
fn emulate<T: Stored>(case: &Case, plan: &KernelPlan, host_tables: &[u32]) -> Emulated<T> {
    let pairs: Vec<u32> = (0..)
        .zip(host_tables)
        .filter(|(_, &b)| b != 0)
        .flat_map(|(i, &b)| [i, b])
        .collect();
    let mut tables = vec![0u32; host_tables.len()];
    write_entries(&mut tables, &pairs).unwrap();
    let (pool_k, pool_v) = case.cached_pool();
    let (mut k, mut v) = (stored::<T>(&pool_k), stored::<T>(&pool_v));
    let (new_k, new_v) = case.new_kv();
    write_slots(plan, &stored::<T>(&new_k), &mut k).unwrap();
    write_slots(plan, &stored::<T>(&new_v), &mut v).unwrap();
    let out = attend(plan, &stored::<T>(&case.q), (&k, &v), &tables).unwrap();
    Emulated { out, k, v, tables }
}

/// Every checked batch in `T`, split as the engine would on an H100 and into one chunk per
/// split: the emulated kernels against the twin and the reference.
fn check<T: Stored>() {
    for (c, case) in checked_cases(T::DTYPE).iter().enumerate() {
        for min_blocks in [MIN_BLOCKS, usize::MAX / 2] {
            let (plan, host_tables) = case.plan(min_blocks).unwrap();
            let got = emulate::<T>(case, &plan, &host_tables);
            let what = format!(
                "{:?} case {c} ({:?}, {} splits of {})",
                T::DTYPE,
                case.heads,
                plan.splits,
                plan.split_len
            );
            assert_eq!(got.tables, host_tables, "{what}: block tables");

            let (mut k, mut v) = case.cached_pool();
            let (new_k, new_v) = case.new_kv();
            let row = case.heads.num_kv_heads * case.heads.head_dim;
            twin::write_slots(&new_k, &mut k, &plan.slots, row);
            twin::write_slots(&new_v, &mut v, &plan.slots, row);
            assert!(bits(&got.k) == bits(&stored::<T>(&k)), "{what}: K pool");
            assert!(bits(&got.v) == bits(&stored::<T>(&v)), "{what}: V pool");
            let caches = Caches {
                k: &k,
                v: &v,
                tables: &host_tables,
            };
            let want = stored::<T>(&twin::attention(&plan, &case.q, &caches));
            let differ = bits(&got.out)
                .iter()
                .zip(bits(&want))
                .filter(|(a, b)| **a != *b)
                .count();
            assert_eq!(differ, 0, "{what}: outputs that differ from the twin's");
            let values: Vec<f32> = got.out.iter().map(|x| x.value()).collect();
            let worst = case.worst_error(&values);
            assert!(
                worst <= tolerance(T::DTYPE),
                "{what}: {worst:e} from the reference"
            );
        }
    }
}

#[test]
fn f32_kernels_compute_what_their_twin_computes_bit_for_bit() {
    check::<f32>();
}

#[test]
fn bf16_kernels_compute_what_their_twin_computes_bit_for_bit() {
    check::<half::bf16>();
}

#[test]
fn f16_kernels_compute_what_their_twin_computes_bit_for_bit() {
    check::<half::f16>();
}

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

/// Greedy requests: prompts of 1 to 60 tokens, 1 to 3 samples each, 10 to 24 new tokens.
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
    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
        for (s, (g, w)) in g.iter().zip(w).enumerate() {
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
