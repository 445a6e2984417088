//! Block-diagonal causal attention of a packed row, forward and backward, on slices: one
//! task per sequence (its rows of every buffer are contiguous, so tasks own disjoint
//! slices). The forward lays each sequence's keys and values out in blocks and runs the
//! engine's kernel ([`crate::block_attn`]) at every position, so that a token's attention
//! is the engine's to the bit; it keeps the probabilities for the backward pass. The
//! backward runs one small product per query head, reading its kv head in place, and the
//! softmax's gradient kernel of [`crate::fused`].

use candle_core::Result;
use rayon::prelude::*;

use super::matmul::{matmul, Threads, View};
use crate::block_attn::{BlockAttention, BlockId, BlockLayout};
use crate::fused::{CausalSoftmax, Kernel, SoftmaxGrad};

/// Token slots per block of a sequence's keys and values in the forward: a multiple of
/// every kernel's vector width (the results do not depend on it).
const BLOCK: usize = 16;

/// The head layout of a layer's attention.
#[derive(Debug, Clone, Copy)]
pub(super) struct Heads {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl Heads {
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }
    /// Query heads per kv head (the HF `repeat_kv` order: kv head `g` serves query heads
    /// `g * rep .. (g + 1) * rep`).
    fn rep(&self) -> usize {
        self.heads / self.kv_heads
    }
    fn softmax(&self, len: usize) -> CausalSoftmax {
        CausalSoftmax {
            scale: 1.0 / (self.head_dim as f64).sqrt(),
            q_len: len,
            k_len: len,
            num_cached: 0,
        }
    }
}

/// Sequence lengths of `cu_seqlens`.
fn lengths(cu_seqlens: &[usize]) -> Vec<usize> {
    cu_seqlens.windows(2).map(|w| w[1] - w[0]).collect()
}

/// `buf` cut into one mutable part per sequence, `per_seq(len)` floats each.
fn split<'a>(
    mut buf: &'a mut [f32],
    lens: &[usize],
    per_seq: impl Fn(usize) -> usize,
) -> Vec<&'a mut [f32]> {
    let mut parts = Vec::with_capacity(lens.len());
    for &len in lens {
        let (part, rest) = std::mem::take(&mut buf).split_at_mut(per_seq(len));
        parts.push(part);
        buf = rest;
    }
    parts
}

/// The same cut of a shared buffer.
fn split_ref<'a>(
    mut buf: &'a [f32],
    lens: &[usize],
    per_seq: impl Fn(usize) -> usize,
) -> Vec<&'a [f32]> {
    let mut parts = Vec::with_capacity(lens.len());
    for &len in lens {
        let (part, rest) = buf.split_at(per_seq(len));
        parts.push(part);
        buf = rest;
    }
    parts
}

/// Floats of the probabilities of every head of the packed row.
fn probs_len(h: &Heads, lens: &[usize]) -> usize {
    lens.iter().map(|l| h.heads * l * l).sum()
}

/// Head `head`'s columns of a (len, `width`) buffer.
fn head_view<'a>(data: &'a [f32], head: usize, h: &Heads, width: usize) -> View<'a> {
    View {
        data,
        offset: head * h.head_dim,
        rs: width,
        cs: 1,
    }
}

/// Attention output (tokens, q_dim) and the probabilities (per sequence, per head, a
/// (len, len) matrix, zero above the diagonal) of roped `q` (tokens, q_dim) over `k`, `v`
/// (tokens, kv_dim).
pub(super) fn forward(
    h: &Heads,
    cu_seqlens: &[usize],
    q: &[f32],
    k: &[f32],
    v: &[f32],
) -> Result<(Vec<f32>, Vec<f32>)> {
    let cpu = crate::cpu_kernel().map_err(candle_core::Error::wrap)?;
    let lens = lengths(cu_seqlens);
    let (qd, kd, d, rep) = (h.q_dim(), h.kv_dim(), h.head_dim, h.rep());
    let layout = BlockLayout {
        block_size: BLOCK,
        kv_heads: h.kv_heads,
        head_dim: d,
    };
    let mut out = vec![0f32; q.len()];
    let mut probs = vec![0f32; probs_len(h, &lens)];
    let tasks: Vec<_> = split(&mut out, &lens, |l| l * qd)
        .into_iter()
        .zip(split(&mut probs, &lens, |l| h.heads * l * l))
        .zip(split_ref(q, &lens, |l| l * qd))
        .zip(split_ref(k, &lens, |l| l * kd))
        .zip(split_ref(v, &lens, |l| l * kd))
        .zip(&lens)
        .collect();
    tasks
        .into_par_iter()
        .for_each(|(((((o, p), q), k), v), &len)| {
            let blocks = len.div_ceil(BLOCK);
            let mut k_pool = vec![0f32; blocks * layout.block_len()];
            let mut v_pool = vec![0f32; blocks * layout.block_len()];
            for j in 0..len {
                let span = j * kd..(j + 1) * kd;
                layout.store(&mut k_pool, &mut v_pool, j, &k[span.clone()], &v[span]);
            }
            let table: Vec<BlockId> = (0..blocks as BlockId).collect();
            let kernel = BlockAttention::new(&k_pool, &v_pool, layout);
            let mut weights = vec![0f32; rep * len];
            for i in 0..len {
                for g in 0..h.kv_heads {
                    let heads = i * qd + g * rep * d..i * qd + (g + 1) * rep * d;
                    let weights = &mut weights[..rep * (i + 1)];
                    let (q, out) = (&q[heads.clone()], &mut o[heads]);
                    kernel.attend_group(cpu, q, g, i, &table, out, Some(&mut *weights));
                    for (r, w) in weights.chunks_exact(i + 1).enumerate() {
                        let head = g * rep + r;
                        p[(head * len + i) * len..][..=i].copy_from_slice(w);
                    }
                }
            }
        });
    Ok((out, probs))
}

/// Gradients `(dq, dk, dv)` of [`forward`]'s inputs from the gradient `d_out` of its
/// output, its inputs and its probabilities.
pub(super) fn backward(
    h: &Heads,
    cu_seqlens: &[usize],
    (q, k, v): (&[f32], &[f32], &[f32]),
    probs: &[f32],
    d_out: &[f32],
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let lens = lengths(cu_seqlens);
    let (qd, kd, d) = (h.q_dim(), h.kv_dim(), h.head_dim);
    let mut dq = vec![0f32; q.len()];
    let mut dk = vec![0f32; k.len()];
    let mut dv = vec![0f32; v.len()];
    let tasks: Vec<_> = split(&mut dq, &lens, |l| l * qd)
        .into_iter()
        .zip(split(&mut dk, &lens, |l| l * kd))
        .zip(split(&mut dv, &lens, |l| l * kd))
        .zip(split_ref(q, &lens, |l| l * qd))
        .zip(split_ref(k, &lens, |l| l * kd))
        .zip(split_ref(v, &lens, |l| l * kd))
        .zip(split_ref(probs, &lens, |l| h.heads * l * l))
        .zip(split_ref(d_out, &lens, |l| l * qd))
        .zip(&lens)
        .collect();
    tasks
        .into_par_iter()
        .for_each(|((((((((dq, dk), dv), q), k), v), p), d_out), &len)| {
            let grad = SoftmaxGrad(h.softmax(len));
            let mut d_probs = vec![0f32; len * len];
            let mut d_scores = vec![0f32; len * len];
            for head in 0..h.heads {
                let (g, first_of_group) = (head / h.rep(), head % h.rep() == 0);
                let p = &p[head * len * len..][..len * len];
                let d_o = head_view(d_out, head, h, qd);
                matmul(
                    &mut d_probs,
                    0,
                    len,
                    d_o,
                    head_view(v, g, h, kd).t(),
                    (len, len, d),
                    false,
                    Threads::Caller,
                );
                for (i, ((row, p), dp)) in d_scores
                    .chunks_exact_mut(len)
                    .zip(p.chunks_exact(len))
                    .zip(d_probs.chunks_exact(len))
                    .enumerate()
                {
                    grad.run(i, &[p, dp], row);
                }
                let ds = View::rows(&d_scores, len);
                let product = (len, d, len);
                matmul(
                    dq,
                    head * d,
                    qd,
                    ds,
                    head_view(k, g, h, kd),
                    product,
                    false,
                    Threads::Caller,
                );
                // A kv head's gradients sum over the query heads it serves.
                let add = !first_of_group;
                let q_head = head_view(q, head, h, qd);
                matmul(dk, g * d, kd, ds.t(), q_head, product, add, Threads::Caller);
                let pt = View::rows(p, len).t();
                matmul(dv, g * d, kd, pt, d_o, product, add, Threads::Caller);
            }
        });
    (dq, dk, dv)
}
