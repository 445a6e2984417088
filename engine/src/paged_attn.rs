//! The engine's attention backend: K/V live in fixed-size blocks of one flat buffer per
//! layer and are read in place through each sequence's block table (no per-step copy or
//! concatenation of caches). CPU kernel in plain Rust, parallel over (token, head).

use candle_core::{DType, Result, Tensor};
use dppo_model::parallel::multi_threaded;
use dppo_model::AttentionBackend;
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
            num_heads,
            scale: 1.0 / (head_dim as f32).sqrt(),
        };
        let attend_row = |(idx, out_row): (usize, &mut [f32])| {
            let (t, h) = (idx / num_heads, idx % num_heads);
            let meta = &self.seqs[token_seq[t]];
            let pos = meta.num_computed_tokens + (t - meta.first_row);
            let q_row = &q[idx * head_dim..(idx + 1) * head_dim];
            kernel.attend_one(q_row, h, pos, &meta.block_table, out_row);
        };
        if multi_threaded() {
            out.par_chunks_mut(head_dim)
                .enumerate()
                .for_each(attend_row);
        } else {
            out.chunks_mut(head_dim).enumerate().for_each(attend_row);
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

/// Read-only view of one layer's cache for the attention of single (token, head) pairs.
struct Kernel<'a> {
    k: &'a [f32],
    v: &'a [f32],
    shape: CacheShape,
    num_heads: usize,
    scale: f32,
}

impl Kernel<'_> {
    /// Attention of one query head at position `pos` over keys `0..=pos` of a sequence.
    fn attend_one(
        &self,
        q: &[f32],
        head: usize,
        pos: usize,
        block_table: &[BlockId],
        out: &mut [f32],
    ) {
        let d = self.shape.head_dim;
        let bs = self.shape.block_size;
        let kv_head = head / (self.num_heads / self.shape.num_kv_heads);
        let row = self.shape.slot_len();
        let offset = |j: usize| (block_table[j / bs] as usize * bs + j % bs) * row + kv_head * d;
        // scores = q . k_j * scale, then a max-shifted softmax
        let mut scores: Vec<f32> = (0..=pos)
            .map(|j| dot(q, &self.k[offset(j)..offset(j) + d]) * self.scale)
            .collect();
        let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0f32;
        for s in scores.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        out.fill(0.0);
        for (j, p) in scores.iter().enumerate() {
            let v = &self.v[offset(j)..offset(j) + d];
            let w = p / sum;
            for (o, x) in out.iter_mut().zip(v) {
                *o += w * x;
            }
        }
    }
}

/// Dot product with eight independent accumulators, so that the compiler can vectorise it
/// (a single running sum is a dependency chain that float semantics forbid reordering).
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
