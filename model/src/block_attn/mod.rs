//! Attention of single query positions over keys and values stored in blocks, on the CPU.
//! The engine's paged attention reads its KV cache with it, and the learner's training
//! layer reads each packed sequence with it (laid out in blocks for the purpose), so that
//! both compute a token's attention in the same operations and the same order: on the CPU
//! in f32 the learner's logprobs are the engine's to the bit. The
//! result does not depend on the block size or on where the blocks lie.

use crate::cpu_kernel::CpuKernel;
use crate::fast_exp::exp_nonpositive;

/// A block's index in its pool; a block holds `block_size` consecutive token slots.
pub type BlockId = u32;

/// How K and V lie in blocks of `block_size` token slots: each block holds its KV heads one
/// after another, so that what one KV head reads of a block is contiguous. V is (blocks,
/// kv_heads, block_size, head_dim); K is (blocks, kv_heads, head_dim, block_size): keys
/// transposed, so that one query's dot products with a block's keys are vector operations
/// across the keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockLayout {
    pub block_size: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl BlockLayout {
    /// Floats of one token slot's K (or V): every KV head's vector.
    pub fn slot_len(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Floats of one block of K (or V).
    pub fn block_len(&self) -> usize {
        self.block_size * self.slot_len()
    }

    /// Writes one token's keys and values (`kv_heads x head_dim` each) into slot `slot` of
    /// the pools `keys` and `values`.
    pub fn store(&self, keys: &mut [f32], values: &mut [f32], slot: usize, k: &[f32], v: &[f32]) {
        let (bs, d) = (self.block_size, self.head_dim);
        let (block, offset) = (slot / bs, slot % bs);
        let span = block * self.block_len()..(block + 1) * self.block_len();
        // Element `kv_head * head_dim + i` of the token's keys goes to row of the same index
        // in the block's (kv_heads * head_dim, block_size) transposed keys.
        let keys = &mut keys[span.clone()];
        for (dim, &x) in k.iter().enumerate() {
            keys[dim * bs + offset] = x;
        }
        let values = &mut values[span];
        for (kv_head, v) in v.chunks_exact(d).enumerate() {
            let start = (kv_head * bs + offset) * d;
            values[start..start + d].copy_from_slice(v);
        }
    }
}

/// Read-only view of K and V pools (one layer's) for the attention of single positions.
pub struct BlockAttention<'a> {
    k: &'a [f32],
    v: &'a [f32],
    layout: BlockLayout,
    scale: f32,
}

impl<'a> BlockAttention<'a> {
    /// The pools `k` and `v`, laid out as `layout` says; scores scaled by
    /// `1 / sqrt(head_dim)`.
    pub fn new(k: &'a [f32], v: &'a [f32], layout: BlockLayout) -> Self {
        Self {
            k,
            v,
            layout,
            scale: 1.0 / (layout.head_dim as f32).sqrt(),
        }
    }
}

impl BlockAttention<'_> {
    /// Attention at position `pos` over keys `0..=pos` of a sequence, for the query heads
    /// `q` (`group x head_dim`, consecutive heads) that share KV head `kv_head`, into `out`
    /// (`group x head_dim`); with `probs` (`group x (pos + 1)`) each head's attention
    /// weights too. Compiled for the widest vectors of the CPU kernel `cpu`. Every path
    /// computes the same operations in the same order; the AVX2 and AVX-512 paths fuse each
    /// multiply-add (and so agree bit for bit), the portable one rounds the product first.
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
    #[allow(clippy::too_many_arguments)]
    pub fn attend_group(
        &self,
        cpu: CpuKernel,
        q: &[f32],
        kv_head: usize,
        pos: usize,
        block_table: &[BlockId],
        out: &mut [f32],
        probs: Option<&mut [f32]>,
    ) {
        #[cfg(target_arch = "x86_64")]
        {
            #[target_feature(enable = "avx512f,fma")]
            fn avx512(
                kernel: &BlockAttention,
                q: &[f32],
                h: usize,
                p: usize,
                t: &[BlockId],
                o: &mut [f32],
                w: Option<&mut [f32]>,
            ) {
                kernel.group::<16, 4, true>(q, h, p, t, o, w)
            }
            #[target_feature(enable = "avx2,fma")]
            fn avx2(
                kernel: &BlockAttention,
                q: &[f32],
                h: usize,
                p: usize,
                t: &[BlockId],
                o: &mut [f32],
                w: Option<&mut [f32]>,
            ) {
                kernel.group::<8, 2, true>(q, h, p, t, o, w)
            }
            match cpu {
                // SAFETY: the process's kernel is one this CPU has (`cpu_kernel`).
                CpuKernel::Avx512 => {
                    return unsafe { avx512(self, q, kv_head, pos, block_table, out, probs) }
                }
                // SAFETY: as above.
                CpuKernel::Avx2 => {
                    return unsafe { avx2(self, q, kv_head, pos, block_table, out, probs) }
                }
                CpuKernel::Portable => {}
            }
        }
        self.group::<4, 2, false>(q, kv_head, pos, block_table, out, probs)
    }
    /// [`BlockAttention::attend_group`]'s arithmetic, inlined into each of its compilations with
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
        mut probs: Option<&mut [f32]>,
    ) {
        let d = self.layout.head_dim;
        let mut heads = 0;
        while heads < q.len() / d {
            let (q, out) = (&q[heads * d..], &mut out[heads * d..]);
            let w = probs.as_deref_mut().map(|p| &mut p[heads * (pos + 1)..]);
            let t = block_table;
            heads += match q.len() / d {
                n if n >= 4 && G >= 4 => self.heads::<W, 4, FUSED>(q, kv_head, pos, t, out, w),
                3 if G >= 3 => self.heads::<W, 3, FUSED>(q, kv_head, pos, t, out, w),
                n if n >= 2 && G >= 2 => self.heads::<W, 2, FUSED>(q, kv_head, pos, t, out, w),
                _ => self.heads::<W, 1, FUSED>(q, kv_head, pos, t, out, w),
            };
        }
    }

    /// Attention of the first `H` heads of `q` into the first `H` of `out` (and their
    /// weights into the first `H` rows of `probs`); returns `H`.
    #[inline(always)]
    fn heads<const W: usize, const H: usize, const FUSED: bool>(
        &self,
        q: &[f32],
        kv_head: usize,
        pos: usize,
        block_table: &[BlockId],
        out: &mut [f32],
        probs_out: Option<&mut [f32]>,
    ) -> usize {
        let d = self.layout.head_dim;
        let (q, out) = (&q[..H * d], &mut out[..H * d]);
        let len = pos + 1;
        let (bs, row) = (self.layout.block_size, self.layout.slot_len());
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
        if let Some(probs_out) = probs_out {
            for (to, from) in probs_out.chunks_mut(len).zip(probs.chunks_exact(padded)) {
                to.copy_from_slice(&from[..len]);
            }
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
mod tests;
