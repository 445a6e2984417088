//! The engine's attention backend: K/V live in fixed-size blocks of one flat buffer per
//! layer and are read in place through each sequence's block table (no per-step copy or
//! concatenation of caches). CPU kernel in plain Rust, parallel over (token, head).

use candle_core::{DType, Result, Tensor};
use dppo_model::parallel::multi_threaded;
use dppo_model::{AttentionBackend, CpuKernel};
use rayon::prelude::*;

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
        self.num_kv_heads * self.head_dim
    }

    /// Bytes of K and V for one token across all layers, stored as `dtype`.
    pub fn bytes_per_token(&self, dtype: DType) -> usize {
        2 * self.num_layers * self.slot_len() * dtype.size_in_bytes()
    }
}

/// K and V of every layer: `k[layer]` is (num_blocks * block_size, kv_heads, head_dim).
#[derive(Debug)]
pub struct KvCache {
    shape: CacheShape,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl KvCache {
    /// Zeroed storage for `shape`.
    pub fn new(shape: CacheShape) -> Self {
        let n = shape.num_blocks * shape.block_size * shape.slot_len();
        Self {
            shape,
            k: (0..shape.num_layers).map(|_| vec![0.0; n]).collect(),
            v: (0..shape.num_layers).map(|_| vec![0.0; n]).collect(),
        }
    }

    /// The cache's shape.
    pub fn shape(&self) -> CacheShape {
        self.shape
    }

    /// Carries out copy-on-write orders in every layer.
    pub fn copy_blocks(&mut self, copies: &[BlockCopy]) {
        let row = self.shape.slot_len();
        let block = self.shape.block_size * row;
        for c in copies {
            let (src, dst) = (c.src as usize * block, c.dst as usize * block);
            let len = c.num_tokens * row;
            for layer in self.k.iter_mut().chain(self.v.iter_mut()) {
                layer.copy_within(src..src + len, dst);
            }
        }
    }
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
        let k_new = k.flatten_all()?.to_vec1::<f32>()?;
        let v_new = v.flatten_all()?.to_vec1::<f32>()?;
        let (kc, vc) = (&mut self.cache.k[layer_idx], &mut self.cache.v[layer_idx]);
        for (t, &slot) in self.slot_mapping.iter().enumerate() {
            kc[slot * row..(slot + 1) * row].copy_from_slice(&k_new[t * row..(t + 1) * row]);
            vc[slot * row..(slot + 1) * row].copy_from_slice(&v_new[t * row..(t + 1) * row]);
        }
        // 2. Attend, reading K/V in place through block tables.
        let q = q.flatten_all()?.to_vec1::<f32>()?;
        let mut out = vec![0f32; num_tokens * num_heads * head_dim];
        let token_seq = token_owners(self.seqs, num_tokens);
        let kernel = Kernel {
            k: &self.cache.k[layer_idx],
            v: &self.cache.v[layer_idx],
            shape: self.cache.shape,
            scale: 1.0 / (head_dim as f32).sqrt(),
        };
        // One task per (token, KV head): the query heads sharing that KV head read each key
        // and value row once between them.
        let num_kv_heads = self.cache.shape.num_kv_heads;
        let group = num_heads / num_kv_heads;
        let cpu = dppo_model::cpu_kernel().map_err(candle_core::Error::wrap)?;
        let attend_group = |(idx, out_rows): (usize, &mut [f32])| {
            let (t, kv_head) = (idx / num_kv_heads, idx % num_kv_heads);
            let meta = &self.seqs[token_seq[t]];
            let pos = meta.num_computed_tokens + (t - meta.first_row);
            let q_rows = &q[idx * group * head_dim..(idx + 1) * group * head_dim];
            kernel.attend_group(cpu, q_rows, kv_head, pos, &meta.block_table, out_rows);
        };
        if multi_threaded() {
            out.par_chunks_mut(group * head_dim)
                .enumerate()
                .for_each(attend_group);
        } else {
            out.chunks_mut(group * head_dim)
                .enumerate()
                .for_each(attend_group);
        }
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

/// Read-only view of one layer's cache for the attention of single tokens.
struct Kernel<'a> {
    k: &'a [f32],
    v: &'a [f32],
    shape: CacheShape,
    scale: f32,
}

impl Kernel<'_> {
    /// Attention at position `pos` over keys `0..=pos` of a sequence, for the query heads
    /// `q` (`group x head_dim`, consecutive heads) that share KV head `kv_head`, compiled for
    /// the widest vectors of the process's CPU kernel. The instructions are the same IEEE
    /// operations in the same order on every path (Rust never fuses a multiply and an add),
    /// so the results are too.
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    fn attend_group(
        &self,
        cpu: CpuKernel,
        q: &[f32],
        kv_head: usize,
        pos: usize,
        block_table: &[BlockId],
        out: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f")]
            fn avx512(
                kernel: &Kernel,
                q: &[f32],
                h: usize,
                p: usize,
                t: &[BlockId],
                o: &mut [f32],
            ) {
                kernel.group(q, h, p, t, o)
            }
            #[target_feature(enable = "avx2")]
            fn avx2(kernel: &Kernel, q: &[f32], h: usize, p: usize, t: &[BlockId], o: &mut [f32]) {
                kernel.group(q, h, p, t, o)
            }
            match cpu {
                // SAFETY: the process's kernel is one this CPU has (`cpu_kernel`).
                CpuKernel::Avx512 => {
                    return unsafe { avx512(self, q, kv_head, pos, block_table, out) }
                }
                // SAFETY: as above.
                CpuKernel::Avx2 => return unsafe { avx2(self, q, kv_head, pos, block_table, out) },
                CpuKernel::Portable => {}
            }
        }
        self.group(q, kv_head, pos, block_table, out)
    }

    /// [`Kernel::attend_group`]'s arithmetic, inlined into each of its compilations. Each
    /// head's arithmetic is that of attending it alone; the group only shares the reads.
    #[inline(always)]
    fn group(
        &self,
        q: &[f32],
        kv_head: usize,
        pos: usize,
        block_table: &[BlockId],
        out: &mut [f32],
    ) {
        let d = self.shape.head_dim;
        let group = q.len() / d;
        let len = pos + 1;
        // The first slot of every block the sequence uses, and its number of tokens.
        let (bs, row) = (self.shape.block_size, self.shape.slot_len());
        let blocks = block_table
            .iter()
            .take(len.div_ceil(bs))
            .enumerate()
            .map(|(b, &block)| {
                (
                    block as usize * bs * row + kv_head * d,
                    (len - b * bs).min(bs),
                )
            });
        // scores[h][j] = q_h . k_j * scale, then a max-shifted softmax per head
        let mut scores = vec![0f32; group * len];
        let mut j = 0;
        for (base, tokens) in blocks.clone() {
            for slot in 0..tokens {
                let key = &self.k[base + slot * row..base + slot * row + d];
                for (h, q_h) in q.chunks_exact(d).enumerate() {
                    scores[h * len + j] = dot(q_h, key) * self.scale;
                }
                j += 1;
            }
        }
        let mut sums = vec![0f32; group];
        for (probs, sum) in scores.chunks_exact_mut(len).zip(&mut sums) {
            let max = probs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            for s in probs.iter_mut() {
                *s = (*s - max).exp();
                *sum += *s;
            }
        }
        // out_h = sum_j p_hj v_j, added in order of j
        out.fill(0.0);
        let mut j = 0;
        for (base, tokens) in blocks {
            for slot in 0..tokens {
                let value = &self.v[base + slot * row..base + slot * row + d];
                for (h, out_h) in out.chunks_exact_mut(d).enumerate() {
                    let w = scores[h * len + j] / sums[h];
                    for (o, x) in out_h.iter_mut().zip(value) {
                        *o += w * x;
                    }
                }
                j += 1;
            }
        }
    }
}

/// Dot product with eight independent accumulators, so that the compiler can vectorise it
/// (a single running sum is a dependency chain that float semantics forbid reordering).
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (a8, b8) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = a8
        .remainder()
        .iter()
        .zip(b8.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in a8.zip(b8) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}
