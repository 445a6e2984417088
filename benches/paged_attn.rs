//! One layer's decode attention: the engine's paged kernel (K/V read in place through block
//! tables) against the contiguous-cache batched attention of the learner
//! (`causal_attention_batch`, candle matmuls) in the same process. Shapes: builtin:tiny in
//! the default run (32 prompts x 8 samples at position 24) and SmolLM2-135M in
//! `configs/smollm2-gsm8k.toml` (4 x 8 at position 160).

use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, Criterion};
use dppo_engine::paged_attn::{CacheShape, KvCache, PagedAttention, SeqAttnMeta};
use dppo_model::attention::causal_attention_batch;
use dppo_model::AttentionBackend;

fn decode(c: &mut Criterion) {
    let dev = Device::Cpu;
    // (name, sequences, cached tokens, heads, kv heads, head dim)
    for (name, seqs, cached, heads, kv_heads, d) in [
        ("tiny_256x24", 256, 24usize, 4, 2, 16),
        ("smollm2_32x160", 32, 160, 9, 3, 64),
    ] {
        let block_size: usize = 16;
        let blocks_per_seq = (cached + 1).div_ceil(block_size);
        let shape = CacheShape {
            num_layers: 1,
            num_blocks: seqs * blocks_per_seq,
            block_size,
            num_kv_heads: kv_heads,
            head_dim: d,
        };
        let mut cache = KvCache::new(shape);
        let metas: Vec<SeqAttnMeta> = (0..seqs)
            .map(|s| SeqAttnMeta {
                first_row: s,
                num_new_tokens: 1,
                num_computed_tokens: cached,
                block_table: (0..blocks_per_seq)
                    .map(|b| (s * blocks_per_seq + b) as u32)
                    .collect(),
            })
            .collect();
        let slots: Vec<usize> = (0..seqs)
            .map(|s| s * blocks_per_seq * block_size + cached)
            .collect();
        let q = Tensor::randn(0f32, 1.0, (seqs, heads, d), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (seqs, kv_heads, d), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (seqs, kv_heads, d), &dev).unwrap();
        let k_all = Tensor::randn(0f32, 1.0, (seqs * (cached + 1), kv_heads, d), &dev).unwrap();
        let v_all = Tensor::randn(0f32, 1.0, (seqs * (cached + 1), kv_heads, d), &dev).unwrap();
        let mut group = c.benchmark_group(format!("decode_attention_{name}"));
        group.sample_size(30);
        group.bench_function("paged", |b| {
            b.iter(|| {
                let mut backend = PagedAttention {
                    cache: &mut cache,
                    seqs: &metas,
                    slot_mapping: &slots,
                };
                backend.attend(0, &q, &k, &v).unwrap()
            })
        });
        group.bench_function("contiguous_batched", |b| {
            b.iter(|| causal_attention_batch(&q, &k_all, &v_all, seqs, cached).unwrap())
        });
        group.finish();
    }
}

criterion_group!(benches, decode);
criterion_main!(benches);
