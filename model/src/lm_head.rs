//! The lm-head, log-softmax and target gather as one op with its own backward, chunked over
//! rows, so that the (tokens, vocab) logits (49152 wide for SmolLM2) are never held whole:
//! the forward keeps two numbers per row, the backward recomputes one chunk of logits at a
//! time. The composite of differentiable ops it replaces keeps the logits and three more
//! tensors of their size alive until the backward pass.

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Tensor, D};

use crate::linear::linear;
use crate::ops::{at_least_f32, log_softmax_last_dim};

/// Logits materialised at once: 8 Mi elements (32 MiB of f32), 170 rows of SmolLM2's vocab.
const CHUNK_ELEMS: usize = 1 << 23;

/// Per-row results of the lm-head over hidden states.
#[derive(Debug, Clone)]
pub struct TokenStats {
    /// (rows,) log-probability of each row's target token; differentiable.
    pub logprobs: Tensor,
    /// (rows,) entropy of each row's next-token distribution; a metric, no gradient.
    pub entropy: Tensor,
}

/// A logit outside the nucleus: its exp is 0 and 0 times it is 0 (an infinity would make
/// the entropy's `p * log p` NaN).
const DROPPED: f64 = -1e30;

/// Log-probabilities of `targets` (rows,) u32 under `hidden` (rows, hidden) `@ weight^T`
/// (weight: (vocab, hidden)), and the entropies, of the full softmax when `top_p >= 1`,
/// else of the softmax renormalised over each row's nucleus ([`nucleus_mask`]). On the CPU
/// it is one fused, chunked op; elsewhere the composite of differentiable ops (same values,
/// all logits held).
pub fn lm_head_token_stats(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    top_p: f64,
) -> Result<TokenStats> {
    if hidden.device().is_cpu() {
        let rows = (CHUNK_ELEMS / weight.dim(0)?.max(1)).max(1);
        fused(hidden, weight, targets, rows, top_p)
    } else {
        composite(hidden, weight, targets, top_p)
    }
}

/// An additive (rows, vocab) mask over `logits`: 0 on each row's nucleus, [`DROPPED`]
/// elsewhere. The nucleus is the engine's top-p set: the most likely tokens (lower id first
/// on ties) up to the first whose cumulative probability reaches `top_p`, and the row's
/// target always (the engine drew it, so it was in the engine's nucleus; rounding may
/// place it just outside the learner's). Computed on the host from detached logits.
pub fn nucleus_mask(logits: &Tensor, targets: &Tensor, top_p: f64) -> Result<Tensor> {
    let (rows, vocab) = logits.dims2()?;
    let values = logits
        .detach()
        .to_dtype(candle_core::DType::F64)?
        .to_vec2::<f64>()?;
    let targets = targets.to_vec1::<u32>()?;
    let mut mask = vec![DROPPED; rows * vocab];
    for (r, row) in values.iter().enumerate() {
        let mut order: Vec<usize> = (0..vocab).collect();
        order.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
        let max = row[order[0]];
        let z: f64 = row.iter().map(|l| (l - max).exp()).sum();
        let mut mass = 0.0;
        for &i in &order {
            mask[r * vocab + i] = 0.0;
            mass += (row[i] - max).exp() / z;
            if mass >= top_p {
                break;
            }
        }
        mask[r * vocab + targets[r] as usize] = 0.0;
    }
    Tensor::from_vec(mask, (rows, vocab), logits.device())?.to_dtype(logits.dtype())
}

/// `logits` restricted to the nucleus when `top_p < 1`.
fn truncated(logits: Tensor, targets: &Tensor, top_p: f64) -> Result<Tensor> {
    if top_p >= 1.0 {
        return Ok(logits);
    }
    let mask = nucleus_mask(&logits, targets, top_p)?;
    logits + mask
}

/// The fused op with `chunk_rows` rows of logits per chunk.
fn fused(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
    top_p: f64,
) -> Result<TokenStats> {
    let op = FusedLmHead {
        hidden: hidden.detach(),
        weight: weight.detach(),
        targets: targets.clone(),
        chunk_rows,
        top_p,
    };
    // (rows, 2): column 0 the logprobs, column 1 the entropies.
    let out = hidden.apply_op2(weight, op)?;
    Ok(TokenStats {
        logprobs: out.narrow(1, 0, 1)?.squeeze(1)?,
        entropy: out.narrow(1, 1, 1)?.squeeze(1)?.detach(),
    })
}

/// The same results from differentiable primitive ops, holding the whole logits.
fn composite(hidden: &Tensor, weight: &Tensor, targets: &Tensor, top_p: f64) -> Result<TokenStats> {
    let logits = truncated(
        at_least_f32(&linear(hidden, weight, None)?)?,
        targets,
        top_p,
    )?;
    let logp = log_softmax_last_dim(&logits)?;
    let logprobs = logp.gather(&targets.unsqueeze(1)?, 1)?.squeeze(1)?;
    let p_logp = (logp.detach().exp()? * logp.detach())?;
    Ok(TokenStats {
        logprobs,
        entropy: p_logp.sum(D::Minus1)?.neg()?,
    })
}

/// `hidden @ weight^T`, log-softmax and gather, chunk by chunk. It carries detached
/// handles of its operands: the forward computes with tensor ops (any float dtype, the
/// projection through [`linear`]'s kernels) rather than on raw storage.
struct FusedLmHead {
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    chunk_rows: usize,
    /// Nucleus of the logits (1: the full softmax).
    top_p: f64,
}

impl FusedLmHead {
    /// Row ranges of at most `chunk_rows` rows covering `0..rows`.
    fn chunks(&self, rows: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        (0..rows)
            .step_by(self.chunk_rows)
            .map(move |start| (start, self.chunk_rows.min(rows - start)))
    }

    /// (rows, 2): each row's target logprob and entropy.
    fn forward(&self) -> Result<Tensor> {
        let rows = self.hidden.dim(0)?;
        let mut outs = Vec::new();
        for (start, len) in self.chunks(rows) {
            let chunk_targets = self.targets.narrow(0, start, len)?;
            // The softmax in f32 at least, as the composite path and PyTorch's autocast do: a
            // bf16 sum over the vocabulary is too coarse for the loss and its gradient.
            let logits = linear(&self.hidden.narrow(0, start, len)?, &self.weight, None)?;
            let logits = truncated(at_least_f32(&logits)?, &chunk_targets, self.top_p)?;
            let targets = chunk_targets.unsqueeze(1)?;
            // The same arithmetic as the composite log-softmax, for the target column only.
            let shifted = logits.broadcast_sub(&logits.max_keepdim(D::Minus1)?)?;
            let e = shifted.exp()?;
            let sum = e.sum_keepdim(D::Minus1)?;
            let lse = sum.log()?;
            let logprob = shifted.gather(&targets, 1)?.sub(&lse)?;
            // H = lse - sum(p * shifted), p = e / sum.
            let mean_shifted = (e * shifted)?.sum_keepdim(D::Minus1)?.div(&sum)?;
            outs.push(Tensor::cat(&[logprob, (lse - mean_shifted)?], 1)?);
        }
        Tensor::cat(&outs, 0)
    }
}

impl CustomOp2 for FusedLmHead {
    fn name(&self) -> &'static str {
        "dppo-lm-head-logprobs"
    }

    fn cpu_fwd(
        &self,
        _hs: &CpuStorage,
        hl: &Layout,
        _ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        // The storages are those of `self.hidden` and `self.weight`, read through them.
        if hl.shape() != self.hidden.shape() || wl.shape() != self.weight.shape() {
            candle_core::bail!("lm-head op: operands differ from the tensors it was built with");
        }
        let out = self.forward()?;
        let shape = out.shape().clone();
        let (storage, layout) = out.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            candle_core::bail!("lm-head op: CPU forward produced a non-CPU tensor");
        };
        if !layout.is_contiguous() || layout.start_offset() != 0 {
            candle_core::bail!("lm-head op: the forward's output is not contiguous");
        }
        Ok((cpu.clone(), shape))
    }

    fn bwd(
        &self,
        hidden: &Tensor,
        weight: &Tensor,
        _out: &Tensor,
        grad_out: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // Detached, as in the projection's backward: the weight is a var and must not
        // record ops that would keep the graph alive. The entropy column has no gradient.
        let (hidden, weight) = (hidden.detach(), weight.detach());
        let grad = grad_out.narrow(1, 0, 1)?;
        let mut grad_hidden = Vec::new();
        let mut grad_weight: Option<Tensor> = None;
        for (start, len) in self.chunks(hidden.dim(0)?) {
            let h = hidden.narrow(0, start, len)?;
            let chunk_targets = self.targets.narrow(0, start, len)?;
            let targets = chunk_targets.unsqueeze(1)?;
            // d logprob / d logits = onehot(target) - softmax(logits), 0 off the nucleus; in
            // the forward's precision, then back to the operands' dtype for the matmuls.
            let logits = at_least_f32(&linear(&h, &weight, None)?)?;
            let logits = truncated(logits, &chunk_targets, self.top_p)?;
            let g = grad
                .narrow(0, start, len)?
                .to_dtype(logits.dtype())?
                .contiguous()?;
            let probs = candle_nn::ops::softmax_last_dim(&logits)?;
            let grad_logits = probs
                .broadcast_mul(&g.neg()?)?
                .scatter_add(&targets, &g, 1)?
                .to_dtype(h.dtype())?;
            grad_hidden.push(grad_logits.matmul(&weight)?);
            let gw = grad_logits.t()?.matmul(&h)?;
            grad_weight = Some(match grad_weight {
                Some(acc) => (acc + gw)?,
                None => gw,
            });
        }
        Ok((Some(Tensor::cat(&grad_hidden, 0)?), grad_weight))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::check::values;
    use candle_core::{DType, Device, Var};
    use rand::{Rng, SeedableRng};

    const ROWS: usize = 11;
    const HIDDEN: usize = 6;
    const VOCAB: usize = 23;

    fn inputs(dtype: DType) -> (Var, Var, Tensor, Tensor) {
        let dev = Device::Cpu;
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let mut random = |shape: (usize, usize)| {
            let v: Vec<f32> = (0..shape.0 * shape.1)
                .map(|_| rng.random_range(-1.5f32..1.5))
                .collect();
            Tensor::from_vec(v, shape, &dev).unwrap()
        };
        let (h, w) = (random((ROWS, HIDDEN)), random((VOCAB, HIDDEN)));
        let targets: Vec<u32> = (0..ROWS).map(|i| ((i * 7 + 3) % VOCAB) as u32).collect();
        // Distinct coefficients, some negative, so that no gradient can cancel out.
        let coef: Vec<f32> = (0..ROWS).map(|i| 0.5 - 0.13 * i as f32).collect();
        (
            Var::from_tensor(&h.to_dtype(dtype).unwrap()).unwrap(),
            Var::from_tensor(&w.to_dtype(dtype).unwrap()).unwrap(),
            Tensor::new(targets, &dev).unwrap(),
            Tensor::new(coef, &dev).unwrap().to_dtype(dtype).unwrap(),
        )
    }

    /// Loss `sum(coef * logprobs)` through `stats`, its gradients w.r.t. hidden and
    /// weight, and the entropies.
    fn run(
        stats: impl Fn(&Tensor, &Tensor, &Tensor) -> Result<TokenStats>,
        dtype: DType,
    ) -> [Vec<f64>; 5] {
        let (h, w, targets, coef) = inputs(dtype);
        let s = stats(h.as_tensor(), w.as_tensor(), &targets).unwrap();
        let coef = coef.to_dtype(s.logprobs.dtype()).unwrap();
        let loss = (&s.logprobs * &coef).unwrap().sum_all().unwrap();
        let grads = loss.backward().unwrap();
        assert!(
            !grads.get(&w).unwrap().track_op(),
            "w's gradient tracks ops"
        );
        [
            values(&s.logprobs),
            values(&s.entropy),
            values(&loss),
            values(grads.get(&h).unwrap()),
            values(grads.get(&w).unwrap()),
        ]
    }

    fn assert_rel_close(a: &[f64], b: &[f64], tol: f64, what: &str) {
        let scale = b.iter().fold(1e-12f64, |m, x| m.max(x.abs()));
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!((x - y).abs() <= tol * scale, "{what}[{i}]: {x} vs {y}");
        }
    }

    #[test]
    fn fused_matches_the_composite_path_in_value_and_gradient() {
        // Chunks of 4, 4 and 3 rows; one chunk of all rows; f32, f64, and bf16, whose
        // softmax both paths compute in f32 (the gradients' matmuls stay bf16).
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::F64, 1e-5), (DType::BF16, 2e-2)] {
            let want = run(|h, w, t| composite(h, w, t, 1.0), dtype);
            for chunk_rows in [4, ROWS, 64] {
                let got = run(|h, w, t| fused(h, w, t, chunk_rows, 1.0), dtype);
                let what = ["logprobs", "entropy", "loss", "grad hidden", "grad weight"];
                for ((g, w), what) in got.iter().zip(&want).zip(what) {
                    assert_eq!(g.len(), w.len(), "{what}");
                    assert_rel_close(g, w, tol, &format!("{dtype:?} chunk {chunk_rows} {what}"));
                }
            }
        }
        let (h, w, targets, _) = inputs(DType::BF16);
        let stats = fused(h.as_tensor(), w.as_tensor(), &targets, 4, 1.0).unwrap();
        assert_eq!(
            stats.logprobs.dtype(),
            DType::F32,
            "bf16 logits softmaxed in f32"
        );
    }

    /// With a nucleus, the fused op still matches the composite in value and gradient, and
    /// each logprob is the target's under the softmax renormalised over the tokens whose
    /// cumulative probability (most likely first) first reaches top_p, plus the target.
    #[test]
    fn nucleus_logprobs_renormalise_over_the_top_p_set() {
        let top_p = 0.6;
        for dtype in [DType::F32, DType::F64] {
            let want = run(|h, w, t| composite(h, w, t, top_p), dtype);
            let got = run(|h, w, t| fused(h, w, t, 4, top_p), dtype);
            for (g, w) in got.iter().zip(&want) {
                assert_rel_close(g, w, 1e-5, &format!("{dtype:?} nucleus"));
            }
        }
        let (h, w, targets, _) = inputs(DType::F64);
        let logits = linear(h.as_tensor(), w.as_tensor(), None)
            .unwrap()
            .to_vec2::<f64>()
            .unwrap();
        let got = fused(h.as_tensor(), w.as_tensor(), &targets, 4, top_p).unwrap();
        let got = values(&got.logprobs);
        let targets = targets.to_vec1::<u32>().unwrap();
        let mut truncated = 0;
        for (r, row) in logits.iter().enumerate() {
            let mut order: Vec<usize> = (0..VOCAB).collect();
            order.sort_by(|&a, &b| row[b].partial_cmp(&row[a]).unwrap());
            let z: f64 = row.iter().map(|l| l.exp()).sum();
            let (mut kept, mut mass) = (Vec::new(), 0.0);
            for &i in &order {
                kept.push(i);
                mass += row[i].exp() / z;
                if mass >= top_p {
                    break;
                }
            }
            let t = targets[r] as usize;
            if !kept.contains(&t) {
                kept.push(t);
            }
            truncated += usize::from(kept.len() < VOCAB);
            let lse = kept.iter().map(|&i| row[i].exp()).sum::<f64>().ln();
            assert!((got[r] - (row[t] - lse)).abs() < 1e-9, "row {r}");
        }
        assert_eq!(truncated, ROWS, "every row's nucleus leaves tokens out");
    }

    #[test]
    fn fused_gradient_matches_finite_differences() {
        let (h, w, targets, coef) = inputs(DType::F64);
        let loss_at = |h: &Tensor, w: &Tensor| {
            let s = fused(h, w, &targets, 4, 1.0).unwrap();
            (&s.logprobs * &coef).unwrap().sum_all().unwrap()
        };
        let grads = loss_at(h.as_tensor(), w.as_tensor()).backward().unwrap();
        for (which, var) in [("hidden", &h), ("weight", &w)] {
            let analytic = values(grads.get(var).unwrap());
            let base = values(var.as_tensor());
            for idx in (0..base.len()).step_by(5) {
                let shifted = |delta: f64| {
                    let mut v = base.clone();
                    v[idx] += delta;
                    let t = Tensor::from_vec(v, var.shape(), &Device::Cpu).unwrap();
                    let loss = match which {
                        "hidden" => loss_at(&t, w.as_tensor()),
                        _ => loss_at(h.as_tensor(), &t),
                    };
                    loss.to_scalar::<f64>().unwrap()
                };
                let eps = 1e-5;
                let numeric = (shifted(eps) - shifted(-eps)) / (2.0 * eps);
                let tol = 1e-8 + 1e-6 * numeric.abs();
                assert!(
                    (analytic[idx] - numeric).abs() <= tol,
                    "{which}[{idx}]: op backward {}, finite differences {numeric}",
                    analytic[idx]
                );
            }
        }
    }
}
