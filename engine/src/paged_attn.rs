//! The engine's attention backend: K/V live in fixed-size blocks of one flat buffer per
//! layer and are read in place through each sequence's block table (no per-step copy or
//! concatenation of caches). The CPU kernel is [`dppo_model::block_attn`] (shared with the
//! learner), run in parallel over (token, KV head).

use candle_core::{DType, Result, Tensor};
use dppo_model::block_attn::{BlockAttention, BlockLayout};
use dppo_model::host_data::with_f32;
use dppo_model::uninit;
use dppo_model::AttentionBackend;

use crate::kv_pool::{BlockCopy, BlockId};

/// Shapes of the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheShape {
    pub num_layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl CacheShape {
    /// Floats per token slot in one layer's K (or V).
    pub(crate) fn slot_len(&self) -> usize {
        self.layout().slot_len()
    }

    /// How a layer's K and V lie in their blocks.
    pub fn layout(&self) -> BlockLayout {
        BlockLayout {
            block_size: self.block_size,
            kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
        }
    }

    /// Bytes of K and V for one token across all layers, stored as `dtype`.
    pub fn bytes_per_token(&self, dtype: DType) -> usize {
        2 * self.num_layers * self.slot_len() * dtype.size_in_bytes()
    }
}

/// K and V of every layer, each a pool of blocks laid out as [`BlockLayout`] says.
#[derive(Debug)]
pub struct KvCache {
    shape: CacheShape,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl KvCache {
    /// Zeroed storage for `shape`, on huge pages where the OS offers them.
    pub fn new(shape: CacheShape) -> Self {
        let n = shape.num_blocks * shape.block_size * shape.slot_len();
        let layer = || {
            let buf = vec![0.0; n];
            advise_huge_pages(&buf);
            buf
        };
        Self {
            shape,
            k: (0..shape.num_layers).map(|_| layer()).collect(),
            v: (0..shape.num_layers).map(|_| layer()).collect(),
        }
    }

    /// The cache's shape.
    pub fn shape(&self) -> CacheShape {
        self.shape
    }

    /// Carries out copy-on-write orders in every layer, a whole block at a time (the
    /// layout interleaves the slots with the heads); slots past `num_tokens` are unused.
    pub fn copy_blocks(&mut self, copies: &[BlockCopy]) {
        let block = self.shape.block_size * self.shape.slot_len();
        for c in copies {
            let (src, dst) = (c.src as usize * block, c.dst as usize * block);
            for layer in self.k.iter_mut().chain(self.v.iter_mut()) {
                layer.copy_within(src..src + block, dst);
            }
        }
    }

    /// Writes one token's keys and values (`kv_heads x head_dim` each) into cache slot
    /// `slot` of `layer`.
    fn store(&mut self, layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let layout = self.shape.layout();
        layout.store(&mut self.k[layer], &mut self.v[layer], slot, k, v);
    }
}

/// Asks Linux to back `buf` with transparent huge pages (a hint; nothing changes where it
/// is refused). The cache's pages are first touched in the middle of generation, one
/// fault per 4 KiB on the engine's thread, and attention reads them scattered across the
/// pool: 2 MiB pages cut both the faults and the TLB misses.
fn advise_huge_pages(buf: &[f32]) {
    #[cfg(target_os = "linux")]
    {
        const HUGE: usize = 2 << 20;
        let (start, end) = (
            buf.as_ptr() as usize,
            buf.as_ptr() as usize + size_of_val(buf),
        );
        let first = start.next_multiple_of(HUGE);
        if first < end {
            // SAFETY: the range lies inside `buf`'s allocation; MADV_HUGEPAGE changes how
            // pages are backed, never their contents.
            unsafe {
                libc::madvise(
                    first as *mut libc::c_void,
                    (end - first) / HUGE * HUGE,
                    libc::MADV_HUGEPAGE,
                )
            };
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = buf;
}

/// One sequence's part of a batch, as the attention kernel needs it.
#[derive(Debug, Clone)]
pub struct SeqAttnMeta {
    /// First row of this sequence's new tokens in the batch.
    pub first_row: usize,
    pub num_new_tokens: usize,
    /// Tokens already cached; new token `i` sits at position `num_computed_tokens + i`.
    pub num_computed_tokens: usize,
    pub block_table: Vec<BlockId>,
}

/// The attention backend over a [`KvCache`] for one iteration.
pub struct PagedAttention<'a> {
    pub cache: &'a mut KvCache,
    pub seqs: &'a [SeqAttnMeta],
    /// Cache slot of every new token, in batch order.
    pub slot_mapping: &'a [usize],
}

impl AttentionBackend for PagedAttention<'_> {
    fn attend(&mut self, layer_idx: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let (num_tokens, num_heads, head_dim) = q.dims3()?;
        let row = self.cache.shape.slot_len();
        // 1. Write the new tokens' K/V into their slots.
        with_f32(k, |k_new| {
            with_f32(v, |v_new| {
                for (t, &slot) in self.slot_mapping.iter().enumerate() {
                    let span = t * row..(t + 1) * row;
                    self.cache
                        .store(layer_idx, slot, &k_new[span.clone()], &v_new[span]);
                }
            })
        })??;
        // 2. Attend, reading K/V in place through block tables.
        let len = num_tokens * num_heads * head_dim;
        let token_seq = token_owners(self.seqs, num_tokens);
        let kernel = BlockAttention::new(
            &self.cache.k[layer_idx],
            &self.cache.v[layer_idx],
            self.cache.shape.layout(),
        );
        // One task per (token, KV head): the query heads sharing that KV head read each key
        // and value row once between them, writing its own rows of the output.
        let num_kv_heads = self.cache.shape.num_kv_heads;
        let group = num_heads / num_kv_heads;
        let cpu = dppo_model::cpu_kernel().map_err(candle_core::Error::wrap)?;
        let out = with_f32(q, |q| {
            uninit::filled_rows(len, group * head_dim, |idx, out_rows| {
                let (t, kv_head) = (idx / num_kv_heads, idx % num_kv_heads);
                let meta = &self.seqs[token_seq[t]];
                let pos = meta.num_computed_tokens + (t - meta.first_row);
                let q_rows = &q[idx * group * head_dim..(idx + 1) * group * head_dim];
                kernel.attend_group(cpu, q_rows, kv_head, pos, &meta.block_table, out_rows, None);
            })
        })?;
        Tensor::from_vec(out, (num_tokens, num_heads, head_dim), k.device())
    }
}

/// For every batch row, the index of the sequence it belongs to.
fn token_owners(seqs: &[SeqAttnMeta], num_tokens: usize) -> Vec<usize> {
    let mut owners = vec![0; num_tokens];
    for (s, meta) in seqs.iter().enumerate() {
        owners[meta.first_row..meta.first_row + meta.num_new_tokens].fill(s);
    }
    owners
}
