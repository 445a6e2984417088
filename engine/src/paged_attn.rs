//! The engine's attention backend: K/V live in fixed-size blocks of one flat buffer per
//! layer and are read in place through each sequence's block table (no per-step copy or
//! concatenation of caches). CPU kernel in plain Rust, parallel over (token, head).

use std::mem::MaybeUninit;

use candle_core::{CpuStorage, DType, Result, Storage, Tensor};
use dppo_model::parallel::multi_threaded;
use dppo_model::uninit;
use dppo_model::{AttentionBackend, CpuKernel};
use rayon::prelude::*;

use crate::fast_exp::exp_nonpositive;
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

/// K and V of every layer, each block holding its KV heads one after another so that what
/// one KV head reads of a block is contiguous. `v[layer]` is (num_blocks, kv_heads,
/// block_size, head_dim); `k[layer]` is (num_blocks, kv_heads, head_dim, block_size): keys
/// transposed, so that the attention kernel takes one query's dot products with a whole
/// block's keys as vector operations across the keys.
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
        let (bs, d, row) = (
            self.shape.block_size,
            self.shape.head_dim,
            self.shape.slot_len(),
        );
        let (block, offset) = (slot / bs, slot % bs);
        let span = block * bs * row..(block + 1) * bs * row;
        // Element `kv_head * head_dim + i` of the token's keys goes to row of the same index
        // in the block's (kv_heads * head_dim, block_size) transposed keys.
        let keys = &mut self.k[layer][span.clone()];
        for (dim, &x) in k.iter().enumerate() {
            keys[dim * bs + offset] = x;
        }
        let values = &mut self.v[layer][span];
        for (kv_head, v) in v.chunks_exact(d).enumerate() {
            let start = (kv_head * bs + offset) * d;
            values[start..start + d].copy_from_slice(v);
        }
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
        let mut out = uninit::buffer(len);
        let token_seq = token_owners(self.seqs, num_tokens);
        let kernel = Kernel {
            k: &self.cache.k[layer_idx],
            v: &self.cache.v[layer_idx],
            shape: self.cache.shape,
            scale: 1.0 / (head_dim as f32).sqrt(),
        };
        // One task per (token, KV head): the query heads sharing that KV head read each key
        // and value row once between them. Each task initialises its own rows of `out`.
        let num_kv_heads = self.cache.shape.num_kv_heads;
        let group = num_heads / num_kv_heads;
        let cpu = dppo_model::cpu_kernel().map_err(candle_core::Error::wrap)?;
        with_f32(q, |q| {
            let attend_group = |(idx, out_rows): (usize, &mut [MaybeUninit<f32>])| {
                let (t, kv_head) = (idx / num_kv_heads, idx % num_kv_heads);
                let meta = &self.seqs[token_seq[t]];
                let pos = meta.num_computed_tokens + (t - meta.first_row);
                let q_rows = &q[idx * group * head_dim..(idx + 1) * group * head_dim];
                let out_rows = uninit::zeroed(out_rows);
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
        })?;
        // SAFETY: every task initialised its rows, and the rows cover `out`.
        let out = unsafe { uninit::assume_init(out) };
        Tensor::from_vec(out, (num_tokens, num_heads, head_dim), k.device())
    }
}

/// `f` of the f32 elements of `t` in order: borrowed from the storage of a contiguous f32
/// CPU tensor (the projections' outputs), copied otherwise.
fn with_f32<T>(t: &Tensor, f: impl FnOnce(&[f32]) -> T) -> Result<T> {
    {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(CpuStorage::F32(data)), Some((start, end))) =
            (&*storage, layout.contiguous_offsets())
        {
            return Ok(f(&data[start..end]));
        }
    }
    Ok(f(&t.flatten_all()?.to_vec1::<f32>()?))
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
    /// the widest vectors of the process's CPU kernel. Every path computes the same
    /// operations in the same order; the AVX2 and AVX-512 paths fuse each multiply-add (and
    /// so agree bit for bit), the portable one rounds the product first.
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
            #[target_feature(enable = "avx512f,fma")]
            fn avx512(
                kernel: &Kernel,
                q: &[f32],
                h: usize,
                p: usize,
                t: &[BlockId],
                o: &mut [f32],
            ) {
                kernel.group::<16, 4, true>(q, h, p, t, o)
            }
            #[target_feature(enable = "avx2,fma")]
            fn avx2(kernel: &Kernel, q: &[f32], h: usize, p: usize, t: &[BlockId], o: &mut [f32]) {
                kernel.group::<8, 2, true>(q, h, p, t, o)
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
        self.group::<4, 2, false>(q, kv_head, pos, block_table, out)
    }

    /// [`Kernel::attend_group`]'s arithmetic, inlined into each of its compilations with
    /// the keys per vector `W` of its registers, multiply-adds fused when `FUSED`, and up
    /// to `G` heads computed side by side (as many as the registers hold). Each head's
    /// arithmetic is that of attending it alone; the heads only share the reads and give
    /// the core independent chains of multiply-adds to overlap.
    #[inline(always)]
    fn group<const W: usize, const G: usize, const FUSED: bool>(
        &self,
        q: &[f32],
        kv_head: usize,
        pos: usize,
        block_table: &[BlockId],
        out: &mut [f32],
    ) {
        let d = self.shape.head_dim;
        let mut heads = 0;
        while heads < q.len() / d {
            let (q, out) = (&q[heads * d..], &mut out[heads * d..]);
            heads += match q.len() / d {
                n if n >= 4 && G >= 4 => {
                    self.heads::<W, 4, FUSED>(q, kv_head, pos, block_table, out)
                }
                3 if G >= 3 => self.heads::<W, 3, FUSED>(q, kv_head, pos, block_table, out),
                n if n >= 2 && G >= 2 => {
                    self.heads::<W, 2, FUSED>(q, kv_head, pos, block_table, out)
                }
                _ => self.heads::<W, 1, FUSED>(q, kv_head, pos, block_table, out),
            };
        }
    }

    /// Attention of the first `H` heads of `q` into the first `H` of `out`; returns `H`.
    #[inline(always)]
    fn heads<const W: usize, const H: usize, const FUSED: bool>(
        &self,
        q: &[f32],
        kv_head: usize,
        pos: usize,
        block_table: &[BlockId],
        out: &mut [f32],
    ) -> usize {
        let d = self.shape.head_dim;
        let (q, out) = (&q[..H * d], &mut out[..H * d]);
        let len = pos + 1;
        let (bs, row) = (self.shape.block_size, self.shape.slot_len());
        let blocks = &block_table[..len.div_ceil(bs)];
        // probs[h][j] = q_h . k_j * scale for every slot of the blocks in use (those past
        // `len` are computed and ignored), then a max-shifted softmax per head over `..len`.
        let padded = blocks.len() * bs;
        let mut probs = vec![0f32; H * padded];
        // The KV head's part of a block: `d * bs` floats at the same offset in K and V.
        let span = |b: usize| {
            let start = span_start(blocks[b], bs, row, kv_head, d);
            start..start + d * bs
        };
        for b in 0..blocks.len() {
            let kt = &self.k[span(b)];
            let scores = &mut probs[b * bs..];
            if bs % W == 0 {
                block_scores::<W, H, FUSED>(q, kt, self.scale, scores, padded);
            } else {
                block_scores::<1, H, FUSED>(q, kt, self.scale, scores, padded);
            }
        }
        for probs_h in probs.chunks_exact_mut(padded) {
            softmax_prefix(&mut probs_h[..len]);
        }
        // out_h = sum_j p_hj v_j, added in order of j, a few registers' worth of dimensions
        // at a time.
        let mut dims = 0;
        while dims < d {
            let rows = Rows {
                v: self.v,
                starts: blocks.iter().map(|&b| span_start(b, bs, row, kv_head, d)),
                bs,
                d,
                len,
            };
            dims += match d - dims {
                n if n >= 4 * W => weighted_rows::<W, 4, H, FUSED>(&probs, padded, rows, dims, out),
                n if n >= W => weighted_rows::<W, 1, H, FUSED>(&probs, padded, rows, dims, out),
                _ => weighted_rows::<1, 1, H, FUSED>(&probs, padded, rows, dims, out),
            };
        }
        H
    }
}

/// Where the KV head `kv_head`'s part of block `block` starts in a layer's K or V.
#[inline(always)]
fn span_start(block: BlockId, bs: usize, row: usize, kv_head: usize, d: usize) -> usize {
    block as usize * bs * row + kv_head * d * bs
}

/// The value rows `0..len` of one KV head, `d` floats each, `bs` to a block starting at
/// each of `starts`.
struct Rows<'a, I> {
    v: &'a [f32],
    starts: I,
    bs: usize,
    d: usize,
    len: usize,
}

/// `out[h * d + s] = q_h . k_s * scale` for the keys of one block and the `H` heads of `q`
/// (`H x d`), into `out` with `stride` floats per head; `kt` holds the keys transposed
/// (`d x bs`). Computed `W` keys at a time in vectors across the keys. Each dot product
/// is four running sums over the dimensions `i = 0, 1, 2, 3 (mod 4)` in order of `i`, then
/// `(s0 + s1) + (s2 + s3)`: the same order whatever `W` and `H`, which decide only the
/// speed.
#[inline(always)]
fn block_scores<const W: usize, const H: usize, const FUSED: bool>(
    q: &[f32],
    kt: &[f32],
    scale: f32,
    out: &mut [f32],
    stride: usize,
) {
    let d = q.len() / H;
    let bs = kt.len() / d;
    let d4 = d / 4 * 4;
    let fma_lanes = |acc: [f32; W], a: f32, b: &[f32; W]| -> [f32; W] {
        std::array::from_fn(|l| mul_add::<FUSED>(a, b[l], acc[l]))
    };
    for c in 0..bs / W {
        let lanes = |i: usize| -> &[f32; W] {
            let start = i * bs + c * W;
            kt[start..start + W].try_into().expect("W lanes")
        };
        let mut acc = [[[0f32; W]; 4]; H];
        for i in (0..d4).step_by(4) {
            for r in 0..4 {
                let x = lanes(i + r);
                for h in 0..H {
                    acc[h][r] = fma_lanes(acc[h][r], q[h * d + i + r], x);
                }
            }
        }
        // The last `d % 4` dimensions; the loop's bound is fixed so that `acc` stays in
        // registers (an index only known at run time would put it on the stack).
        for r in 0..4 {
            if d4 + r < d {
                let x = lanes(d4 + r);
                for h in 0..H {
                    acc[h][r] = fma_lanes(acc[h][r], q[h * d + d4 + r], x);
                }
            }
        }
        for (h, acc) in acc.iter().enumerate() {
            let sums: [f32; W] = std::array::from_fn(|l| {
                ((acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l])) * scale
            });
            out[h * stride + c * W..h * stride + (c + 1) * W].copy_from_slice(&sums);
        }
    }
}

/// `out[h * d + dims + i] = sum_j p[h * stride + j] * v_j[dims + i]` for the `H` heads and
/// the first `C * W` dimensions from `dims`, added in order of `j` from zero in `H * C`
/// accumulators of `W` floats (registers, not memory). Returns the number of dimensions
/// done.
#[inline(always)]
fn weighted_rows<const W: usize, const C: usize, const H: usize, const FUSED: bool>(
    p: &[f32],
    stride: usize,
    rows: Rows<'_, impl Iterator<Item = usize>>,
    dims: usize,
    out: &mut [f32],
) -> usize {
    let mut acc = [[[0f32; W]; C]; H];
    let mut j = 0;
    for block in rows.starts {
        for slot in 0..rows.bs.min(rows.len - j) {
            let start = block + slot * rows.d + dims;
            let xs: [&[f32; W]; C] = std::array::from_fn(|c| {
                rows.v[start + c * W..start + (c + 1) * W]
                    .try_into()
                    .expect("W dims")
            });
            for (c, x) in xs.iter().enumerate() {
                for (h, acc_h) in acc.iter_mut().enumerate() {
                    let (w, a) = (p[h * stride + j], acc_h[c]);
                    acc_h[c] = std::array::from_fn(|i| mul_add::<FUSED>(w, x[i], a[i]));
                }
            }
            j += 1;
        }
    }
    for (h, acc) in acc.iter().enumerate() {
        for (c, acc) in acc.iter().enumerate() {
            let at = h * rows.d + dims + c * W;
            out[at..at + W].copy_from_slice(acc);
        }
    }
    C * W
}

/// `acc + a * b`, in one rounding when `FUSED` (only where the compilation has FMA: it is a
/// libm call otherwise).
#[inline(always)]
fn mul_add<const FUSED: bool>(a: f32, b: f32, acc: f32) -> f32 {
    if FUSED {
        a.mul_add(b, acc)
    } else {
        acc + a * b
    }
}

/// In-place softmax of one head's scores: weights `exp(s - max)` summed in eight running
/// sums over `j mod 8`, then each divided by the total.
#[inline(always)]
fn softmax_prefix(scores: &mut [f32]) {
    let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for s in scores.iter_mut() {
        *s = exp_nonpositive(*s - max);
    }
    let mut parts = [0f32; 8];
    let chunks = scores.chunks_exact(8);
    let tail: f32 = chunks.remainder().iter().sum();
    for chunk in chunks {
        for (p, x) in parts.iter_mut().zip(chunk) {
            *p += x;
        }
    }
    let sum = parts.iter().sum::<f32>() + tail;
    for s in scores.iter_mut() {
        *s /= sum;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values in [-1, 1).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// Every compiled path of the kernel, on every shape class (block sizes that are and
    /// are not multiples of the vector width, head sizes with and without a remainder mod
    /// 4 and mod the registers' dimensions, groups of 1 to 4 heads), against softmax
    /// attention in f64 over the same keys read contiguously.
    #[test]
    fn attend_group_matches_f64_attention_on_every_kernel_and_shape() {
        for cpu in CpuKernel::ALL.into_iter().filter(|k| k.is_available()) {
            for (bs, d, kv_heads, group, pos) in [
                (16usize, 64usize, 3usize, 3usize, 40usize),
                (16, 16, 2, 2, 0),
                (7, 6, 2, 4, 20),
                (8, 72, 1, 1, 9),
                (1, 5, 1, 2, 3),
            ] {
                let num_blocks = 2 * (pos + 1).div_ceil(bs) + 1;
                let shape = CacheShape {
                    num_layers: 1,
                    num_blocks,
                    block_size: bs,
                    num_kv_heads: kv_heads,
                    head_dim: d,
                };
                let mut cache = KvCache::new(shape);
                // The sequence uses every other block, from the end.
                let table: Vec<BlockId> = (0..(pos + 1).div_ceil(bs))
                    .map(|b| (num_blocks - 1 - 2 * b) as BlockId)
                    .collect();
                let row = shape.slot_len();
                let (keys, vals) = (values((pos + 1) * row, 1), values((pos + 1) * row, 2));
                for j in 0..=pos {
                    let slot = table[j / bs] as usize * bs + j % bs;
                    let span = j * row..(j + 1) * row;
                    cache.store(0, slot, &keys[span.clone()], &vals[span]);
                }
                let kernel = Kernel {
                    k: &cache.k[0],
                    v: &cache.v[0],
                    shape,
                    scale: 1.0 / (d as f32).sqrt(),
                };
                for kv_head in 0..kv_heads {
                    let q = values(group * d, 3 + kv_head as u64);
                    let mut out = vec![f32::NAN; group * d];
                    kernel.attend_group(cpu, &q, kv_head, pos, &table, &mut out);
                    for h in 0..group {
                        let q_h = &q[h * d..(h + 1) * d];
                        let at =
                            |x: &[f32], j: usize, i: usize| x[j * row + kv_head * d + i] as f64;
                        let s: Vec<f64> = (0..=pos)
                            .map(|j| {
                                let dot: f64 =
                                    (0..d).map(|i| q_h[i] as f64 * at(&keys, j, i)).sum();
                                dot / (d as f64).sqrt()
                            })
                            .collect();
                        let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                        let z: f64 = s.iter().map(|x| (x - max).exp()).sum();
                        for i in 0..d {
                            let want: f64 = (0..=pos)
                                .map(|j| (s[j] - max).exp() / z * at(&vals, j, i))
                                .sum();
                            let got = out[h * d + i] as f64;
                            assert!(
                                (got - want).abs() < 1e-5,
                                "{cpu}, bs {bs}, d {d}, group {group}, head {h}, dim {i}: \
                                 {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
