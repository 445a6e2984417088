use super::*;

/// A model small enough to account for by hand.
fn small() -> ModelShape {
    ModelShape {
        num_parameters: 1000,
        num_layers: 2,
        hidden_size: 8,
        intermediate_size: 16,
        num_attention_heads: 2,
        num_kv_heads: 1,
        head_dim: 4,
        vocab_size: 10,
    }
}

fn inputs(model: ModelShape, total: u64) -> BudgetInputs {
    BudgetInputs {
        model,
        engine_dtype: Precision::Bf16,
        learner: Some(LearnerInputs {
            compute_dtype: Precision::Bf16,
            pack_tokens: 32,
        }),
        total_memory: total,
        free_memory: total,
        gpu_memory_utilization: 0.5,
        block_size: 4,
        max_batched_tokens: 16,
        seq_len: 20,
    }
}

#[test]
fn a_small_budget_accounts_for_every_byte() {
    let p = budget(&inputs(small(), 1_000_000)).unwrap();
    assert_eq!(p.budget, 500_000);
    assert_eq!(p.engine_weights, 2_000); // 1000 bf16
                                         // 16 tokens x (10 f32 logits + (2*8 + 8 + 2*4 + 2*16) bf16 values).
    assert_eq!(p.engine_workspace, 16 * (40 + 64 * 2));
    assert_eq!(p.master_weights, 4_000);
    assert_eq!(p.optimizer_state, 8_000);
    assert_eq!(p.gradients, 4_000); // f32, cast back from the bf16 backward
    assert_eq!(p.compute_weights, 2_000);
    // Per layer: 32 tokens x (6*8 + 3*8 + 3*4 + 4*16 = 148) values and 2 x 2 heads x 32 x 32
    // scores (a segment is the whole buffer, shorter than SEGMENT_TOKENS), in bf16; then
    // 3 x 32 tokens x 10 f32 logits.
    assert_eq!(
        p.activations,
        2 * (32 * 148 + 2 * 2 * 32 * 32) * 2 + 3 * 32 * 10 * 4
    );
    assert_eq!(p.activations, 39_168);
    assert_eq!(p.kv_bytes_per_token, 32); // K and V x 2 layers x 4 values x 2 bytes
                                          // (500000 - 61856) / (32 * 4) = 3423.0 blocks; a sequence of 20 tokens takes 5.
    assert_eq!(p.kv_blocks, 3_423);
    assert_eq!(p.kv_tokens, 13_692);
    assert_eq!(p.kv_bytes(), 438_144);
    assert_eq!(p.max_seqs, 684);
    let text = p.to_string();
    for line in [
        "f32 master weights      3.91 KiB",
        "3423 blocks of 4 tokens, 13692 tokens",
        "sequences at once       684 of 20 tokens",
    ] {
        assert!(text.contains(line), "{line:?} not in\n{text}");
    }
}

#[test]
fn f32_compute_keeps_no_second_copy_and_an_engine_alone_no_learner_state() {
    let mut input = inputs(small(), 1_000_000);
    input.learner = Some(LearnerInputs {
        compute_dtype: Precision::F32,
        pack_tokens: 32,
    });
    let p = budget(&input).unwrap();
    assert_eq!((p.compute_weights, p.gradients), (0, 4_000));
    input.learner = None;
    input.gpu_memory_utilization = 0.9;
    let p = budget(&input).unwrap();
    assert_eq!(p.budget, 900_000);
    let learner = p.master_weights + p.optimizer_state + p.gradients + p.activations;
    assert_eq!(learner + p.compute_weights, 0);
    assert_eq!(p.kv_blocks, (900_000 - 2_000 - 2_688) / 128);
}

/// SmolLM2-135M's config.json (HuggingFaceTB/SmolLM2-135M-Instruct).
const SMOLLM2_135M: &str = r#"{
    "model_type": "llama", "architectures": ["LlamaForCausalLM"],
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 100000,
    "tie_word_embeddings": true, "hidden_act": "silu",
    "bos_token_id": 1, "eos_token_id": 2
}"#;

#[test]
fn smollm2_135m_on_80_gib() {
    let cfg = ModelConfig::from_hf_json(SMOLLM2_135M, "SmolLM2-135M").unwrap();
    let model = ModelShape::from(&cfg);
    assert_eq!(model.num_parameters, 134_515_008);
    assert_eq!(model.head_dim, 64);
    let total = 80u64 << 30;
    let input = BudgetInputs {
        model,
        engine_dtype: Precision::Bf16,
        learner: Some(LearnerInputs {
            compute_dtype: Precision::Bf16,
            pack_tokens: 4096,
        }),
        total_memory: total,
        free_memory: total - (1 << 30),
        gpu_memory_utilization: 0.5,
        block_size: 16,
        max_batched_tokens: 2048,
        seq_len: 1024,
    };
    let p = budget(&input).unwrap();
    assert_eq!(p.budget, 40 << 30);
    assert_eq!(p.engine_weights, 269_030_016);
    assert_eq!(p.master_weights, 538_060_032);
    assert_eq!(p.optimizer_state, 1_076_120_064);
    // K and V x 30 layers x 3 heads x 64 x 2 bytes.
    assert_eq!(p.kv_bytes_per_token, 23_040);
    let needed: u64 = p.parts().iter().map(|(_, b)| b).sum();
    let left = p.budget - needed;
    // The KV cache takes what is left, to within one block.
    assert!(p.kv_bytes() <= left && left - p.kv_bytes() < 16 * 23_040);
    assert_eq!(p.max_seqs, p.kv_blocks / 64);
    assert!(p.max_seqs > 1_000, "{p}");
}

#[test]
fn an_impossible_budget_names_what_does_not_fit() {
    // An 8B model with f32 master weights and AdamW on a 24 GB card.
    let model = ModelShape {
        num_parameters: 8_000_000_000,
        num_layers: 36,
        hidden_size: 4096,
        intermediate_size: 12288,
        num_attention_heads: 32,
        num_kv_heads: 8,
        head_dim: 128,
        vocab_size: 151_936,
    };
    let mut input = inputs(model, 24_000_000_000);
    input.gpu_memory_utilization = 0.9;
    let err = budget(&input).unwrap_err().to_string();
    for part in [
        "does not fit",
        "engine weights 14.90 GiB",
        "f32 master weights 29.80 GiB",
        "AdamW moments (f32) 59.60 GiB",
        "of 22.35 GiB is 20.12 GiB",
        "raise engine.gpu_memory_utilization",
    ] {
        assert!(err.contains(part), "{part:?} not in {err}");
    }
}

#[test]
fn a_kv_cache_too_small_for_one_sequence_is_an_error() {
    let mut input = inputs(small(), 1_000_000);
    // 61856 bytes kept + 4 blocks of 128 bytes: a 20-token sequence needs 5.
    input.gpu_memory_utilization = (61_856.0 + 4.0 * 128.0 + 0.5) / 1e6;
    let err = budget(&input).unwrap_err();
    assert_eq!(
        err,
        BudgetError::NoSequenceFits {
            kv_bytes: 512,
            kv_blocks: 4,
            block_size: 4,
            seq_len: 20
        }
    );
    assert!(err.to_string().contains("holds no sequence of 20 tokens"));
    input.gpu_memory_utilization += 128.0 / 1e6;
    assert_eq!(budget(&input).unwrap().max_seqs, 1);
}

#[test]
fn a_budget_beyond_free_memory_or_a_bad_fraction_is_an_error() {
    let mut input = inputs(small(), 1_000_000);
    input.free_memory = 409_600;
    let err = budget(&input).unwrap_err().to_string();
    assert!(
        err.contains("= 0.5 of 976.56 KiB is 488.28 KiB, but only 400.00 KiB of the GPU is free"),
        "{err}"
    );
    for u in [0.0, -0.5, 1.5, f64::NAN] {
        input.gpu_memory_utilization = u;
        let err = budget(&input).unwrap_err();
        assert!(matches!(err, BudgetError::Utilization(_)), "{u}: {err}");
    }
}
