//! The engine on the emulated kernels: `engine.attention = "cuda"` on the CPU, which the
//! engine's unit tests resolve to `super` (builds without CUDA only).

use candle_core::{DType, Device, Result, Tensor};
use dppo_model::presets::task_tokenizer;
use dppo_model::{Arch, CausalLm, ModelConfig, Policy, Weights};

use crate::cuda_attn::{AttentionKernel, Batch, CudaAttention, Output, Switches};
use crate::generic_attn::TensorKvCache;
use crate::paged_attn::{CacheShape, SeqAttnMeta};
use crate::{AttentionMode, Engine, EngineConfig, GenerateRequest, IterationCost};

/// A model the kernels serve: 6 query heads over 2 KV heads of 32 dimensions; weights
/// wide enough that greedy choices are not near-ties.
fn policy() -> Policy {
    policy_of(|_| {})
}

/// [`policy`]'s model with `edit` applied to its config.
fn policy_of(edit: impl FnOnce(&mut ModelConfig)) -> Policy {
    let tokenizer = task_tokenizer().unwrap();
    let mut config = ModelConfig {
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
    edit(&mut config);
    let weights = Weights::random(&config, 0.2, 5, &Device::Cpu).unwrap();
    Policy::new(config, weights, tokenizer).unwrap()
}

/// The engine these tests run: 4-token blocks, a pool of 192 tokens (small enough to
/// preempt), 12 sequences and 24 tokens an iteration, on `attention`.
fn small_engine(attention: AttentionMode) -> EngineConfig {
    EngineConfig {
        block_size: 4,
        kv_cache_tokens: Some(192),
        max_num_seqs: 12,
        max_batched_tokens: 24,
        attention,
        ..EngineConfig::default()
    }
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
    let run = |attention| {
        let engine = Engine::new(&policy, small_engine(attention), Device::Cpu).unwrap();
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

/// The f16 engine on each tensor-core variant of the attention (the variants' module,
/// head_dim 64 and 128) generates the greedy tokens it generates on the scalar kernel, logprobs
/// within 0.02 (0.007 apart here; the variants round the probabilities to f16): the variants
/// as the engine plans, launches and reads them, with preemption, not only on the doctor's
/// batches. (In bf16 this small model's greedy choices come too close to ties to compare.)
/// The engine's default there is `mma_staged`, bit for bit.
#[test]
fn the_tensor_core_variants_generate_the_scalar_kernels_tokens() {
    for head_dim in [64, 128] {
        let policy = policy_of(|c| c.head_dim = head_dim);
        let reqs = requests(policy.config.vocab_size);
        let run = |attention_kernel| {
            let cfg = EngineConfig {
                dtype: Some(DType::F16),
                attention_kernel,
                ..small_engine(AttentionMode::Cuda)
            };
            let engine = Engine::new(&policy, cfg, Device::Cpu).unwrap();
            let out = engine.generate(reqs.clone()).unwrap();
            (out, engine.stats().num_preemptions)
        };
        let (want, _) = run(Some(AttentionKernel::SCALAR));
        // The engine's default here (f16 at head_dim 64 and 128) is the tensor-core kernel.
        let (default, _) = run(None);
        assert_eq!(default, run(Some(AttentionKernel::TENSOR_CORE)).0);
        assert_ne!(default, want, "the default ran the scalar kernel");
        let mmas = AttentionKernel::VARIANTS.into_iter().filter(|v| v.is_mma());
        for variant in mmas {
            let (got, preemptions) = run(Some(variant));
            let what = format!("{variant} at head_dim {head_dim}");
            assert!(preemptions > 0, "{what}: the pool was meant to run out");
            for (r, (g, w)) in got.iter().zip(&want).enumerate() {
                for (s, (g, w)) in g.iter().zip(w).enumerate() {
                    assert_eq!(g.token_ids, w.token_ids, "{what}: request {r} sample {s}");
                    for (t, (a, b)) in g.logprobs.iter().zip(&w.logprobs).enumerate() {
                        assert!(
                            (a - b).abs() <= 0.02,
                            "{what}: request {r} sample {s} token {t}: {a} vs {b}"
                        );
                    }
                }
            }
        }
    }
}

/// A Qwen2-style model (q/k/v biases, no q/k norms) in f16, so that the f32 engine keeps
/// weight buffers of its own and the fused kernels concatenate its projections (the path the
/// rope and layer kernels serve).
fn qwen2_policy() -> Policy {
    qwen2_policy_in(DType::F16)
}

/// [`qwen2_policy`] with its weights in `dtype`: an engine in another dtype serves it on the
/// rope and layer kernels.
fn qwen2_policy_in(dtype: DType) -> Policy {
    let policy = policy_of(|c| {
        c.arch = Arch::Qwen2;
        c.qkv_bias = true;
        c.qk_norm = false;
    });
    Policy {
        weights: policy.weights.to_dtype(dtype).unwrap(),
        ..policy
    }
}

/// The engine the kernels' switches are tested on: `dtype`, candle-nn's fused kernels (the
/// concatenated projections the rope and layer kernels serve), every switch off.
fn kernels_engine(dtype: DType) -> EngineConfig {
    EngineConfig {
        dtype: Some(dtype),
        fused_kernels: crate::FusedKernels::On,
        rope_kernel: false,
        rope_writes_kv: false,
        rope_qk_norm: false,
        layer_kernels: false,
        ..small_engine(AttentionMode::Cuda)
    }
}

/// `policy`'s greedy completions of [`requests`] by the engine of `cfg` on the emulated
/// kernels: the completions, the iterations' costs, and the iterations.
fn run_engine(
    policy: &Policy,
    cfg: EngineConfig,
) -> (Vec<Vec<crate::Completion>>, IterationCost, usize) {
    let engine = Engine::new(policy, cfg, Device::Cpu).unwrap();
    let out = engine.generate(requests(policy.config.vocab_size)).unwrap();
    let stats = engine.stats();
    (out, stats.cost, stats.num_iterations)
}

/// `completions` equal `want` in tokens, logprobs within `tolerance`; the tokens compared.
fn assert_close(
    got: &[Vec<crate::Completion>],
    want: &[Vec<crate::Completion>],
    tolerance: f32,
) -> usize {
    let mut tokens = 0;
    for (r, (g, w)) in got.iter().zip(want).enumerate() {
        for (s, (g, w)) in g.iter().zip(w).enumerate() {
            assert_eq!(g.token_ids, w.token_ids, "request {r} sample {s}");
            for (t, (a, b)) in g.logprobs.iter().zip(&w.logprobs).enumerate() {
                assert!(
                    (a - b).abs() <= tolerance,
                    "request {r} sample {s} token {t}: {a} vs {b}"
                );
            }
            tokens += g.token_ids.len();
        }
    }
    tokens
}

/// With `engine.rope_kernel` the engine on the emulated kernels generates exactly what it
/// generates without, and every layer of every iteration ran `qkv_rope`: in f32 the kernel
/// is the model's bias add, split and rotation bit for bit.
#[test]
fn the_rope_kernel_changes_no_token_or_logprob() {
    let policy = qwen2_policy();
    let off = kernels_engine(DType::F32);
    let (want, plain, iterations) = run_engine(&policy, off);
    let rope = EngineConfig {
        rope_kernel: true,
        ..off
    };
    let (got, cost, _) = run_engine(&policy, rope);
    let layers = policy.config.num_hidden_layers as u64;
    assert_eq!(
        cost.attention_ops - plain.attention_ops,
        layers * iterations as u64,
        "a qkv_rope a layer"
    );
    for (r, (g, w)) in got.iter().zip(&want).enumerate() {
        for (s, (g, w)) in g.iter().zip(w).enumerate() {
            assert_eq!(g.token_ids, w.token_ids, "request {r} sample {s}");
            assert_eq!(g.logprobs, w.logprobs, "request {r} sample {s}");
        }
    }
}

/// With `engine.rope_writes_kv` the rope kernel writes K and V into the pools itself, and the
/// engine on the emulated kernels generates exactly what it generates with the separate
/// writes, in f32 and f16 (with forks and preemption: the pools' rows are the same bits), with
/// two launches a layer fewer (the two `write_slots`).
#[test]
fn the_rope_kernels_kv_writes_change_no_token_or_logprob() {
    for (dtype, weights) in [(DType::F32, DType::F16), (DType::F16, DType::BF16)] {
        let policy = qwen2_policy_in(weights);
        let layers = policy.config.num_hidden_layers as u64;
        let separate = EngineConfig {
            rope_kernel: true,
            layer_kernels: true,
            ..kernels_engine(dtype)
        };
        let (want, separate_cost, iterations) = run_engine(&policy, separate);
        let into_pools = EngineConfig {
            rope_writes_kv: true,
            ..separate
        };
        let (got, cost, _) = run_engine(&policy, into_pools);
        assert_eq!(
            separate_cost.attention_ops - cost.attention_ops,
            2 * layers * iterations as u64,
            "{dtype:?}: two launches a layer fewer"
        );
        assert_eq!(got, want, "{dtype:?}");
        let tokens: usize = got.iter().flatten().map(|c| c.token_ids.len()).sum();
        assert!(tokens > 100, "{tokens} tokens compared");
    }
}

/// With `engine.layer_kernels` (and the rope kernel) the engine on the emulated kernels
/// generates the tokens it generates without, logprobs within 1e-4 (in f32 the kernels round
/// as the model's ops do, the RMSNorm's sum of squares taken in another order), and each
/// layer of each iteration launched three (two add-and-norms, a gated product), the final
/// norm one more. The host's time in their calls is counted apart from the attention's, both
/// within the forward pass's.
#[test]
fn the_layer_kernels_keep_every_token() {
    let policy = qwen2_policy();
    let rope = EngineConfig {
        rope_kernel: true,
        ..kernels_engine(DType::F32)
    };
    let (want, without, _) = run_engine(&policy, rope);
    let layer = EngineConfig {
        layer_kernels: true,
        ..rope
    };
    let (got, cost, iterations) = run_engine(&policy, layer);
    let layers = policy.config.num_hidden_layers;
    assert_eq!((without.layer_ops, without.layer_host_ns), (0, 0));
    assert_eq!(cost.layer_ops, ((3 * layers + 1) * iterations) as u64);
    assert!(
        cost.layer_host_ns > 0 && cost.attention_host_ns > 0,
        "{cost:?}"
    );
    assert!(
        cost.layer_host_ns + cost.attention_host_ns < cost.forward_ns,
        "{cost:?}"
    );
    let tokens = assert_close(&got, &want, 1e-4);
    assert!(tokens > 100, "{tokens} tokens compared");
}

/// With `engine.rope_qk_norm` a model with q/k norms (Qwen3, its weights in f16 so that the
/// f32 engine concatenates its projections) takes the rope kernel too, which norms each q
/// and k head itself: the engine on the emulated kernels generates the tokens it generates on
/// the model's norms and rotations, logprobs within 1e-4 (the norms' squares summed in
/// another order), a `qkv_rope` a layer of every iteration; with the K/V writes too, one
/// launch a layer fewer than the model's ops and their two writes.
#[test]
fn the_rope_kernel_takes_the_qk_norms() {
    let policy = policy();
    let policy = Policy {
        weights: policy.weights.to_dtype(DType::F16).unwrap(),
        ..policy
    };
    assert!(policy.config.qk_norm);
    let layers = policy.config.num_hidden_layers as u64;
    let ops = EngineConfig {
        rope_kernel: true,
        layer_kernels: true,
        ..kernels_engine(DType::F32)
    };
    let (want, plain, iterations) = run_engine(&policy, ops);
    let normed = EngineConfig {
        rope_qk_norm: true,
        ..ops
    };
    let (got, cost, _) = run_engine(&policy, normed);
    let per_run = layers * iterations as u64;
    assert_eq!(
        cost.attention_ops - plain.attention_ops,
        per_run,
        "a qkv_rope a layer"
    );
    let tokens = assert_close(&got, &want, 1e-4);
    assert!(tokens > 100, "{tokens} tokens compared");
    let into_pools = EngineConfig {
        rope_writes_kv: true,
        ..normed
    };
    let (got, cost, _) = run_engine(&policy, into_pools);
    assert_eq!(plain.attention_ops - cost.attention_ops, per_run);
    assert_close(&got, &want, 1e-4);
}

/// One iteration of `seqs` ((sequence, cached tokens, new tokens, block table)) through
/// `backend`, 4-token blocks: the attention's model output.
fn iteration(
    backend: &mut CudaAttention,
    model: &CausalLm,
    cache: &mut TensorKvCache,
    seqs: &[(u64, usize, usize, &[u32])],
) -> Result<Tensor> {
    let (mut metas, mut ids, mut positions, mut slots) = (vec![], vec![], vec![], vec![]);
    for &(_, cached, new, table) in seqs {
        metas.push(SeqAttnMeta {
            first_row: ids.len(),
            num_new_tokens: new,
            num_computed_tokens: cached,
            block_table: table.to_vec(),
        });
        for p in cached..cached + new {
            ids.push((p * 7 + 3) as u32);
            positions.push(p as u32);
            slots.push(table.get(p / 4).map_or(0, |&b| b as usize * 4 + p % 4));
        }
    }
    let seq_ids: Vec<u64> = seqs.iter().map(|s| s.0).collect();
    let batch = Batch {
        metas: &metas,
        block_copies: &[],
        seq_ids: &seq_ids,
        slot_mapping: &slots,
        input_ids: &ids,
        positions: &positions,
        padding: None,
    };
    match backend.forward(
        model,
        cache,
        &batch,
        |_| true,
        &mut IterationCost::default(),
    )? {
        Output::Hidden(hidden) => Ok(hidden),
        Output::Logits(_) => candle_core::bail!("an unpadded step yields hidden states"),
    }
}

/// An iteration that fails after the block tables' mirror took its changes (here its plan
/// refuses a sequence whose table is too short) leaves no entry stale on the device: the
/// next iteration computes what a backend that never saw the failure computes.
#[test]
fn a_failed_iteration_leaves_no_table_entry_stale() {
    let policy = policy();
    let model = CausalLm::new(&policy.config, &policy.weights).unwrap();
    let shape = CacheShape {
        num_layers: policy.config.num_hidden_layers,
        num_blocks: 16,
        block_size: 4,
        num_kv_heads: policy.config.num_key_value_heads,
        head_dim: policy.config.head_dim,
    };
    let fresh = || {
        let cache = TensorKvCache::new(shape, DType::F32, &Device::Cpu).unwrap();
        (
            CudaAttention::new(&model, &Device::Cpu, Switches::default()).unwrap(),
            cache,
        )
    };
    // Sequence 1 prefills a block, sequence 3 two; then sequence 1 decodes into a new block.
    let prefill: [(u64, usize, usize, &[u32]); 2] = [(1, 0, 4, &[3]), (3, 0, 8, &[5, 6])];
    let decode: [(u64, usize, usize, &[u32]); 1] = [(1, 4, 1, &[3, 7])];
    // The failed iteration: sequence 1's new block reaches the mirror, then the plan refuses
    // sequence 3 (9 tokens in one block).
    let failing: [(u64, usize, usize, &[u32]); 2] = [(1, 4, 1, &[3, 7]), (3, 8, 1, &[5])];

    let (mut backend, mut cache) = fresh();
    iteration(&mut backend, &model, &mut cache, &prefill).unwrap();
    let err = iteration(&mut backend, &model, &mut cache, &failing).unwrap_err();
    assert!(err.to_string().contains("blocks"), "{err}");
    let got = iteration(&mut backend, &model, &mut cache, &decode).unwrap();

    let (mut backend, mut cache) = fresh();
    iteration(&mut backend, &model, &mut cache, &prefill).unwrap();
    let want = iteration(&mut backend, &model, &mut cache, &decode).unwrap();
    let values = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(values(&got), values(&want));
}

/// With `engine.cuda_graphs` every decode step is padded to its bucket and run as its
/// captured graph would be (the CPU has no capture): the engine on the emulated kernels
/// generates the tokens it generates unpadded, with preemption and forks: on the model's ops
/// and on the rope and layer kernels with the rope kernel writing K and V (the pad rows'
/// writes land in the scratch block, or they would change the real rows' keys), logprobs
/// within 1e-4 in f32 (the matmuls run at the padded shape); and in f16 at head_dim 64 on the
/// tensor-core default, within 0.02.
#[test]
fn padded_decode_steps_generate_what_unpadded_ones_do() {
    let qwen2 = qwen2_policy();
    let kernels = EngineConfig {
        rope_kernel: true,
        layer_kernels: true,
        rope_writes_kv: true,
        ..kernels_engine(DType::F32)
    };
    let wide = EngineConfig {
        dtype: Some(DType::F16),
        ..small_engine(AttentionMode::Cuda)
    };
    let runs = [
        (policy(), small_engine(AttentionMode::Cuda), 1e-4),
        (qwen2, kernels, 1e-4),
        (policy_of(|c| c.head_dim = 64), wide, 0.02),
    ];
    for (policy, cfg, tolerance) in runs {
        let (want, plain, _) = run_engine(&policy, cfg);
        let graphs = EngineConfig {
            cuda_graphs: true,
            ..cfg
        };
        let engine = Engine::new(&policy, graphs, Device::Cpu).unwrap();
        let got = engine.generate(requests(policy.config.vocab_size)).unwrap();
        let stats = engine.stats();
        assert_eq!(plain.padded_steps, 0);
        assert!(
            stats.cost.padded_steps > 10 && stats.num_preemptions > 0,
            "{} padded steps, {} preemptions",
            stats.cost.padded_steps,
            stats.num_preemptions
        );
        assert_eq!(stats.cost.graph_replays, 0, "nothing captured on the CPU");
        let tokens = assert_close(&got, &want, tolerance);
        assert!(tokens > 100, "{tokens} tokens compared");
    }
}
