//! Block-diagonal causal attention of a packed row, forward and backward, on slices: one
//! task per sequence (its rows of every buffer are contiguous, so tasks own disjoint
//! slices), and within it one small product per query head, reading its kv head in place
//! (no repeated keys, no transposed copies). The probabilities are kept for the backward
//! pass; the softmax and its gradient are the kernels of [`crate::fused`].

use rayon::prelude::*;

use super::matmul::{matmul, Threads, View};
use crate::fused::{CausalSoftmax, Kernel, SoftmaxGrad};

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
/// (len, len) matrix) of roped `q` (tokens, q_dim) over `k`, `v` (tokens, kv_dim).
pub(super) fn forward(
    h: &Heads,
    cu_seqlens: &[usize],
    q: &[f32],
    k: &[f32],
    v: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let lens = lengths(cu_seqlens);
    let (qd, kd, d) = (h.q_dim(), h.kv_dim(), h.head_dim);
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
            let softmax = h.softmax(len);
            let mut scores = vec![0f32; len * len];
            for head in 0..h.heads {
                let g = head / h.rep();
                matmul(
                    &mut scores,
                    0,
                    len,
                    head_view(q, head, h, qd),
                    head_view(k, g, h, kd).t(),
                    (len, len, d),
                    false,
                    Threads::Caller,
                );
                let p = &mut p[head * len * len..][..len * len];
                for (i, (row, s)) in p
                    .chunks_exact_mut(len)
                    .zip(scores.chunks_exact(len))
                    .enumerate()
                {
                    softmax.run(i, &[s], row);
                }
                matmul(
                    o,
                    head * d,
                    qd,
                    View::rows(p, len),
                    head_view(v, g, h, kd),
                    (len, d, len),
                    false,
                    Threads::Caller,
                );
            }
        });
    (out, probs)
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
