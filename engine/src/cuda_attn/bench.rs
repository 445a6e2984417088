//! The attention's kernels alone on a GPU, timed (`dppo bench attention`): one layer's calls
//! for a decode batch (the K/V writes, the attention and the merge of its splits, as a
//! decode step issues them), each sequence a context of `context` keys whose blocks lie
//! shuffled over the pool, as a long-running engine leaves them. A variant's time a call and
//! the KV read rate it implies, without the rest of a rollout around it.

use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::Heads;
use crate::paged_attn::{CacheShape, SeqAttnMeta};

/// Tokens per block of the benchmark's pool (the engine's default).
pub const BLOCK_SIZE: usize = 16;

/// A decode batch over a pool that holds just its blocks.
#[derive(Debug, Clone)]
pub struct DecodeBatch {
    pub shape: CacheShape,
    pub metas: Vec<SeqAttnMeta>,
    /// Each sequence's row of the block tables, `table_width` blocks wide.
    pub tables: Vec<u32>,
    pub table_width: usize,
    /// Each new token's slot: the last position of its sequence.
    pub slots: Vec<usize>,
}

impl DecodeBatch {
    /// `batch` sequences of `context` keys (`context - 1` cached, one new), their blocks a
    /// random permutation of the pool's (drawn from `seed`).
    pub fn new(heads: Heads, batch: usize, context: usize, seed: u64) -> Self {
        let per_seq = context.div_ceil(BLOCK_SIZE);
        let mut blocks: Vec<u32> = (0..(batch * per_seq) as u32).collect();
        blocks.shuffle(&mut StdRng::seed_from_u64(seed));
        let metas: Vec<SeqAttnMeta> = blocks
            .chunks(per_seq)
            .enumerate()
            .map(|(i, table)| SeqAttnMeta {
                first_row: i,
                num_new_tokens: 1,
                num_computed_tokens: context - 1,
                block_table: table.to_vec(),
            })
            .collect();
        let last = context - 1;
        let slots = metas
            .iter()
            .map(|m| m.block_table[last / BLOCK_SIZE] as usize * BLOCK_SIZE + last % BLOCK_SIZE)
            .collect();
        Self {
            shape: CacheShape {
                num_layers: 1,
                num_blocks: blocks.len(),
                block_size: BLOCK_SIZE,
                num_kv_heads: heads.num_kv_heads,
                head_dim: heads.head_dim,
            },
            tables: blocks,
            table_width: per_seq,
            metas,
            slots,
        }
    }

    /// Bytes of K and V the batch's attention reads once, in elements of `elem_bytes`.
    pub fn kv_bytes(&self, elem_bytes: usize) -> usize {
        let keys: usize = self.metas.iter().map(|m| m.num_computed_tokens + 1).sum();
        2 * keys * self.shape.num_kv_heads * self.shape.head_dim * elem_bytes
    }
}

#[cfg(feature = "cuda")]
pub use on_gpu::{time, Timing};

#[cfg(feature = "cuda")]
mod on_gpu {
    use std::time::Instant;

    use candle_core::{DType, Device, Result, Tensor};
    use dppo_model::AttentionBackend;

    use super::DecodeBatch;
    use crate::cuda_attn::tables::TableCopy;
    use crate::cuda_attn::{
        multiprocessors, AttentionKernel, CudaIndex, CudaPagedAttention, DeviceTables, Extras,
        Heads, KernelPlan,
    };
    use crate::generic_attn::TensorKvCache;

    /// One variant's time a call.
    #[derive(Debug, Clone, PartialEq)]
    pub struct Timing {
        pub variant: AttentionKernel,
        /// Mean microseconds of one layer's attention call, the device synchronised around
        /// the timed calls.
        pub us_per_call: f64,
        /// The batch's K and V bytes over that time.
        pub kv_gb_per_s: f64,
        /// Splits of the context the plan chose.
        pub splits: usize,
    }

    /// `iters` calls of `variant` on `batch` in `dtype`, after three untimed ones.
    pub fn time(
        device: &Device,
        (heads, dtype): (Heads, DType),
        batch: &DecodeBatch,
        variant: AttentionKernel,
        iters: usize,
    ) -> Result<Timing> {
        variant
            .check_serves(heads, dtype)
            .map_err(candle_core::Error::wrap)?;
        let Device::Cuda(cuda) = device else {
            candle_core::bail!("bench attention needs a GPU");
        };
        let mut cache = TensorKvCache::new(batch.shape, dtype, device)?;
        let rows: Vec<u32> = (0..batch.metas.len() as u32).collect();
        let plan = KernelPlan::new(
            &batch.metas,
            (&rows, batch.table_width),
            &batch.slots,
            batch.shape,
            heads,
            2 * multiprocessors(cuda)?,
        )
        .map_err(candle_core::Error::wrap)?;
        let splits = plan.splits;
        let tables = DeviceTables::copy_of(&batch.tables, device)?;
        let index = CudaIndex::new(plan, device)?;
        let n = batch.metas.len();
        let q = Tensor::zeros((n, heads.num_heads, heads.head_dim), dtype, device)?;
        let kv = Tensor::zeros((n, heads.num_kv_heads, heads.head_dim), dtype, device)?;
        let mut backend = CudaPagedAttention {
            cache: &mut cache,
            index: &index,
            tables: &tables,
            extras: Extras::default(),
            variant,
        };
        for _ in 0..3 {
            backend.attend(0, &q, &kv, &kv)?;
        }
        device.synchronize()?;
        let start = Instant::now();
        for _ in 0..iters {
            backend.attend(0, &q, &kv, &kv)?;
        }
        device.synchronize()?;
        let seconds = start.elapsed().as_secs_f64() / iters.max(1) as f64;
        Ok(Timing {
            variant,
            us_per_call: seconds * 1e6,
            kv_gb_per_s: batch.kv_bytes(dtype.size_in_bytes()) as f64 / seconds / 1e9,
            splits,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda_attn::KernelPlan;

    /// Every sequence owns its blocks (the pool holds just them, shuffled), its new token's
    /// slot is its last position, and the plan serves the batch as a decode step: a tile a
    /// sequence, the tables as wide as a context's blocks.
    #[test]
    fn the_batch_is_a_decode_step_over_shuffled_blocks() {
        let heads = Heads {
            num_heads: 14,
            num_kv_heads: 2,
            head_dim: 64,
        };
        let b = DecodeBatch::new(heads, 40, 330, 3);
        assert_eq!(b.table_width, 21);
        let mut seen = b.tables.clone();
        seen.sort_unstable();
        assert_eq!(seen, (0..40 * 21).collect::<Vec<u32>>());
        assert_ne!(b.tables, seen, "shuffled");
        for (m, &slot) in b.metas.iter().zip(&b.slots) {
            assert_eq!((m.num_computed_tokens, m.num_new_tokens), (329, 1));
            assert_eq!(
                slot,
                m.block_table[20] as usize * BLOCK_SIZE + 329 % BLOCK_SIZE
            );
        }
        assert_eq!(b.kv_bytes(2), 2 * 40 * 330 * 2 * 64 * 2);
        let rows: Vec<u32> = (0..40).collect();
        let plan = KernelPlan::new(
            &b.metas,
            (&rows, b.table_width),
            &b.slots,
            b.shape,
            heads,
            264,
        )
        .unwrap();
        assert_eq!(plan.tiles.len(), 40);
        assert_eq!(plan.rows, 40);
    }
}
