//! The decoder layer's forward and backward passes on slices.
//!
//! The forward runs the projections on [`crate::cpu_kernel`] (q/k/v and gate/up each as one
//! pass over their shared input) and the row ops on the kernels of [`crate::fused`], so it
//! computes what the op-by-op model computes; it keeps what the backward needs. The
//! backward runs its products on `gemm` and adds every weight gradient onto its buffer in
//! the product itself.

use candle_core::Result;
use rayon::prelude::*;

use super::attention::{self, Heads};
use super::matmul::{matmul, Threads, View};
use super::Param;
use crate::fused::{apply, NormGradX, NormRows, RmsNorm, Rotate, SiluMulGrad, SiluMulRows};

/// A layer's sizes.
#[derive(Debug, Clone, Copy)]
pub(super) struct Dims {
    pub hidden: usize,
    pub inter: usize,
    pub heads: Heads,
    pub eps: f64,
}

/// The layer's weights as slices, `None` where the model has no such weight.
pub(super) struct Weights<'a>(pub [Option<&'a [f32]>; Param::COUNT]);

impl<'a> Weights<'a> {
    /// A weight every layer has.
    fn get(&self, p: Param) -> &'a [f32] {
        self.0[p as usize].unwrap_or_else(|| panic!("the layer has no {p:?}"))
    }
    fn opt(&self, p: Param) -> Option<&'a [f32]> {
        self.0[p as usize]
    }
}

/// Adds onto the gradient of a weight through the closure given.
pub(super) type Sink<'a> = dyn Fn(Param, &mut dyn FnMut(&mut [f32])) + 'a;

/// What the backward pass needs of the forward.
pub(super) struct Saved {
    n1: Vec<f32>,
    /// q and k before their per-head norm (Qwen3 only).
    qk_lin: Option<(Vec<f32>, Vec<f32>)>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    probs: Vec<f32>,
    attn: Vec<f32>,
    h: Vec<f32>,
    n2: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    act: Vec<f32>,
}

/// The packed row: its sequences' boundaries and the rotation tables at its positions,
/// `(tokens, head_dim / 2)` each.
pub(super) struct Packed<'a> {
    pub cu_seqlens: &'a [usize],
    pub cos: &'a [f32],
    pub sin: &'a [f32],
}

/// Rows of this many elements are one task of the elementwise passes.
const BLOCK: usize = 1 << 14;
/// Rows summed by one task of the column sums.
const SUM_ROWS: usize = 64;

/// `dst += src`, in parallel blocks.
fn add_into(dst: &mut [f32], src: &[f32]) {
    let add = |(d, s): (&mut [f32], &[f32])| {
        for (d, s) in d.iter_mut().zip(s) {
            *d += s;
        }
    };
    if crate::parallel::multi_threaded() {
        dst.par_chunks_mut(BLOCK)
            .zip(src.par_chunks(BLOCK))
            .for_each(add);
    } else {
        dst.chunks_mut(BLOCK).zip(src.chunks(BLOCK)).for_each(add);
    }
}

/// Adds `b` to every row of `y`.
fn add_bias(y: &mut [f32], b: Option<&[f32]>) {
    if let Some(b) = b {
        y.par_chunks_mut(b.len()).for_each(|row| {
            for (y, b) in row.iter_mut().zip(b) {
                *y += b;
            }
        });
    }
}

/// `out += sum over rows r of f(r)`, where `f(r, partial)` adds row `r`'s terms onto a
/// `width`-wide partial sum. Rows are summed in blocks of [`SUM_ROWS`] in parallel and the
/// blocks in order: the same bits whatever the number of threads.
fn sum_rows(rows: usize, out: &mut [f32], f: impl Fn(usize, &mut [f32]) + Sync) {
    let width = out.len();
    let partials: Vec<Vec<f32>> = (0..rows.div_ceil(SUM_ROWS))
        .into_par_iter()
        .map(|b| {
            let mut partial = vec![0f32; width];
            for r in b * SUM_ROWS..((b + 1) * SUM_ROWS).min(rows) {
                f(r, &mut partial);
            }
            partial
        })
        .collect();
    for partial in partials {
        add_into(out, &partial);
    }
}

/// The gradient of an RMSNorm's weight, added onto `out`: the sum over rows of `x` of
/// `dn * x / rms(x)`.
fn norm_weight_grad(x: &[f32], dn: &[f32], norm: RmsNorm, out: &mut [f32]) {
    let width = out.len();
    sum_rows(x.len() / width, out, |r, partial| {
        let (x, dn) = (&x[r * width..][..width], &dn[r * width..][..width]);
        let inv = norm.inv_rms(x);
        for ((p, &x), &g) in partial.iter_mut().zip(x).zip(dn) {
            *p += g * x * inv;
        }
    });
}

/// A bias's gradient added onto `out`: the column sums of `dy`.
fn bias_grad(dy: &[f32], out: &mut [f32]) {
    let width = out.len();
    sum_rows(dy.len() / width, out, |r, partial| {
        for (p, &g) in partial.iter_mut().zip(&dy[r * width..][..width]) {
            *p += g;
        }
    });
}

/// `x @ w_i^T` for each `(w_i, n_i)`, `x` (m, k), on the process's CPU kernel.
fn projections<const N: usize>(
    x: &[f32],
    k: usize,
    ws: [(&[f32], usize); N],
) -> Result<[Vec<f32>; N]> {
    let out = crate::cpu_kernel::outputs(x, x.len() / k, k, &ws)?;
    Ok(out.try_into().expect("one output per weight"))
}

/// `dst (m, n) [+]= a (m, k) @ w (k, n)`, all row-major: an input gradient from an output
/// gradient `a` and a weight `w` (out = k, in = n).
fn input_grad(dst: &mut [f32], a: &[f32], w: &[f32], k: usize, add: bool) {
    let n = w.len() / k;
    let dims = (a.len() / k, n, k);
    let (a, w) = (View::rows(a, k), View::rows(w, n));
    matmul(dst, 0, n, a, w, dims, add, Threads::Pool);
}

/// `grad (out, in) += dy (m, out)^T @ x (m, in)`: a weight's gradient from its output's
/// gradient and its input.
fn weight_grad(grad: &mut [f32], dy: &[f32], x: &[f32], out: usize) {
    let (m, inp) = (dy.len() / out, grad.len() / out);
    let (dy, x) = (View::rows(dy, out).t(), View::rows(x, inp));
    matmul(grad, 0, inp, dy, x, (out, inp, m), true, Threads::Pool);
}

impl Dims {
    fn norm(&self) -> RmsNorm {
        RmsNorm { eps: self.eps }
    }
    fn rope(&self, heads: usize, inverse: bool) -> Rotate {
        Rotate {
            heads,
            head_dim: self.heads.head_dim,
            inverse,
        }
    }
}

/// The layer's output for input `x` (tokens, hidden), and what its backward needs.
pub(super) fn forward(d: &Dims, w: &Weights, x: &[f32], row: &Packed) -> Result<(Vec<f32>, Saved)> {
    let (hid, hd) = (d.hidden, &d.heads);
    let (qd, kd) = (hd.q_dim(), hd.kv_dim());
    let norm = |width| NormRows {
        op: d.norm(),
        width,
    };
    let n1 = apply(&norm(hid), &[x, w.get(Param::InNorm)]);
    let qkv = [(Param::Q, qd), (Param::K, kd), (Param::V, kd)].map(|(p, n)| (w.get(p), n));
    let [mut q, mut k, mut v] = projections(&n1, hid, qkv)?;
    add_bias(&mut q, w.opt(Param::QBias));
    add_bias(&mut k, w.opt(Param::KBias));
    add_bias(&mut v, w.opt(Param::VBias));
    let qk_lin = match (w.opt(Param::QNorm), w.opt(Param::KNorm)) {
        (Some(qn), Some(kn)) => {
            let (qn, kn) = (
                apply(&norm(hd.head_dim), &[&q, qn]),
                apply(&norm(hd.head_dim), &[&k, kn]),
            );
            Some((std::mem::replace(&mut q, qn), std::mem::replace(&mut k, kn)))
        }
        _ => None,
    };
    let q = apply(&d.rope(hd.heads, false), &[&q, row.cos, row.sin]);
    let k = apply(&d.rope(hd.kv_heads, false), &[&k, row.cos, row.sin]);
    let (attn, probs) = attention::forward(hd, row.cu_seqlens, &q, &k, &v)?;
    let [mut h] = projections(&attn, qd, [(w.get(Param::O), hid)])?;
    add_bias(&mut h, w.opt(Param::OBias));
    add_into(&mut h, x);
    let n2 = apply(&norm(hid), &[&h, w.get(Param::PostNorm)]);
    let gate_up = [Param::Gate, Param::Up].map(|p| (w.get(p), d.inter));
    let [gate, up] = projections(&n2, hid, gate_up)?;
    let act = apply(&SiluMulRows, &[&gate, &up]);
    let [mut y] = projections(&act, d.inter, [(w.get(Param::Down), hid)])?;
    add_into(&mut y, &h);
    let saved = Saved {
        n1,
        qk_lin,
        q,
        k,
        v,
        probs,
        attn,
        h,
        n2,
        gate,
        up,
        act,
    };
    Ok((y, saved))
}

/// The gradient of the layer's input from the gradient `dy` of its output; the weights'
/// gradients go to `sink`, each added onto what it holds.
pub(super) fn backward(
    d: &Dims,
    w: &Weights,
    x: &[f32],
    s: Saved,
    dy: &[f32],
    row: &Packed,
    sink: &Sink,
) -> Vec<f32> {
    let (hid, inter, hd) = (d.hidden, d.inter, &d.heads);
    let (qd, kd) = (hd.q_dim(), hd.kv_dim());
    let grad_x = |width| NormGradX {
        op: d.norm(),
        width,
    };
    // The MLP: y = h + down(silu(gate) * up).
    let mut d_act = vec![0f32; s.act.len()];
    input_grad(&mut d_act, dy, w.get(Param::Down), hid, false);
    sink(Param::Down, &mut |g| weight_grad(g, dy, &s.act, hid));
    let d_gate = apply(&SiluMulGrad { wrt_gate: true }, &[&s.gate, &s.up, &d_act]);
    let d_up = apply(&SiluMulGrad { wrt_gate: false }, &[&s.gate, &s.up, &d_act]);
    drop(d_act);
    let mut dn2 = vec![0f32; s.n2.len()];
    input_grad(&mut dn2, &d_gate, w.get(Param::Gate), inter, false);
    input_grad(&mut dn2, &d_up, w.get(Param::Up), inter, true);
    sink(Param::Gate, &mut |g| weight_grad(g, &d_gate, &s.n2, inter));
    sink(Param::Up, &mut |g| weight_grad(g, &d_up, &s.n2, inter));
    drop((d_gate, d_up));
    // The residual h = x + o(attn), normalised before the MLP.
    let mut dh = apply(&grad_x(hid), &[&s.h, w.get(Param::PostNorm), &dn2]);
    add_into(&mut dh, dy);
    sink(Param::PostNorm, &mut |g| {
        norm_weight_grad(&s.h, &dn2, d.norm(), g)
    });
    drop(dn2);
    // Attention.
    let mut d_attn = vec![0f32; s.attn.len()];
    input_grad(&mut d_attn, &dh, w.get(Param::O), hid, false);
    sink(Param::O, &mut |g| weight_grad(g, &dh, &s.attn, hid));
    if w.opt(Param::OBias).is_some() {
        sink(Param::OBias, &mut |g| bias_grad(&dh, g));
    }
    let (dq, dk, dv) =
        attention::backward(hd, row.cu_seqlens, (&s.q, &s.k, &s.v), &s.probs, &d_attn);
    drop((d_attn, s.probs, s.q, s.k, s.v));
    let mut dq = apply(&d.rope(hd.heads, true), &[&dq, row.cos, row.sin]);
    let mut dk = apply(&d.rope(hd.kv_heads, true), &[&dk, row.cos, row.sin]);
    if let Some((q_lin, k_lin)) = &s.qk_lin {
        let head_norm = |p: Param, lin: &[f32], dn: &mut Vec<f32>| {
            sink(p, &mut |g| norm_weight_grad(lin, dn, d.norm(), g));
            *dn = apply(&grad_x(hd.head_dim), &[lin, w.get(p), dn]);
        };
        head_norm(Param::QNorm, q_lin, &mut dq);
        head_norm(Param::KNorm, k_lin, &mut dk);
    }
    for (p, grad) in [
        (Param::QBias, &dq),
        (Param::KBias, &dk),
        (Param::VBias, &dv),
    ] {
        if w.opt(p).is_some() {
            sink(p, &mut |g| bias_grad(grad, g));
        }
    }
    let mut dn1 = vec![0f32; s.n1.len()];
    input_grad(&mut dn1, &dq, w.get(Param::Q), qd, false);
    input_grad(&mut dn1, &dk, w.get(Param::K), kd, true);
    input_grad(&mut dn1, &dv, w.get(Param::V), kd, true);
    sink(Param::Q, &mut |g| weight_grad(g, &dq, &s.n1, qd));
    sink(Param::K, &mut |g| weight_grad(g, &dk, &s.n1, kd));
    sink(Param::V, &mut |g| weight_grad(g, &dv, &s.n1, kd));
    // The residual x, normalised before attention.
    let mut dx = apply(&grad_x(hid), &[x, w.get(Param::InNorm), &dn1]);
    add_into(&mut dx, &dh);
    sink(Param::InNorm, &mut |g| {
        norm_weight_grad(x, &dn1, d.norm(), g)
    });
    dx
}
