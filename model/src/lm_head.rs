//! The lm-head, log-softmax and target gather as one op with its own backward, chunked over
//! rows, so that the (tokens, vocab) logits (49152 wide for SmolLM2) are never held whole:
//! the forward keeps two numbers per row, the backward recomputes one chunk of logits at a
//! time. The composite of differentiable ops it replaces keeps the logits and three more
//! tensors of their size alive until the backward pass.
//!
//! Both compute the behaviour policy's logprobs: the softmax of the logits divided by the
//! rollout's temperature, over the tokens its min-p, top-k and top-p keep ([`Shaping`]). On f32 logits the fused op
//! takes each value from [`crate::behaviour`], the sampler's own arithmetic, so that the
//! learner's logprob of a sampled token is the engine's bit for bit.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, D};
use rayon::prelude::*;

use crate::behaviour::{self, Shaping};
use crate::host_data::with_f32;
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

/// A logit the shaping drops: its exp is 0 and 0 times it is 0 (an infinity would make
/// the entropy's `p * log p` NaN).
const DROPPED: f64 = -1e30;

/// Log-probabilities of `targets` (rows,) u32 under `hidden` (rows, hidden) `@ weight^T`
/// (weight: (vocab, hidden)) shaped by `shaping` (temperature, min-p, top-k, top-p), and the
/// entropies. On the CPU it is one fused, chunked op; elsewhere the composite of
/// differentiable ops (the same values up to rounding, all logits held).
pub fn lm_head_token_stats(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    shaping: Shaping,
) -> Result<TokenStats> {
    if hidden.device().is_cpu() {
        let rows = (CHUNK_ELEMS / weight.dim(0)?.max(1)).max(1);
        fused(hidden, weight, targets, rows, shaping)
    } else {
        composite(hidden, weight, targets, shaping)
    }
}

/// An additive (rows, vocab) mask over `logits`: 0 on the tokens each row's behaviour
/// distribution keeps ([`behaviour::kept`], the row's target always), [`DROPPED`]
/// elsewhere; `None` when nothing is left out. Computed on the host from detached logits.
fn kept_mask(logits: &Tensor, targets: &Tensor, shaping: &Shaping) -> Result<Option<Tensor>> {
    if !shaping.truncates() {
        return Ok(None);
    }
    let (rows, vocab) = logits.dims2()?;
    let values = logits.detach().to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let targets = targets.to_vec1::<u32>()?;
    let mut mask = vec![DROPPED; rows * vocab];
    for (r, row) in values.iter().enumerate() {
        let kept = behaviour::kept(row, targets[r] as usize, shaping).expect("it truncates");
        for i in kept {
            mask[r * vocab + i] = 0.0;
        }
    }
    let mask = Tensor::from_vec(mask, (rows, vocab), logits.device())?;
    Ok(Some(mask.to_dtype(logits.dtype())?))
}

/// The logits in at least f32, divided by the temperature and restricted to the kept
/// tokens: the log-softmax of the result is the behaviour logprob (up to rounding).
fn shaped(logits: &Tensor, targets: &Tensor, shaping: &Shaping) -> Result<Tensor> {
    let logits = at_least_f32(logits)?;
    let mask = kept_mask(&logits, targets, shaping)?;
    let logits = if shaping.temperature == 1.0 {
        logits
    } else {
        (logits * f64::from(shaping.inv_temperature()))?
    };
    match mask {
        Some(mask) => logits + mask,
        None => Ok(logits),
    }
}

/// The fused op with `chunk_rows` rows of logits per chunk.
fn fused(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    chunk_rows: usize,
    shaping: Shaping,
) -> Result<TokenStats> {
    let op = FusedLmHead {
        hidden: hidden.detach(),
        weight: weight.detach(),
        targets: targets.clone(),
        chunk_rows,
        shaping,
    };
    // (rows, 2): column 0 the logprobs, column 1 the entropies.
    let out = hidden.apply_op2(weight, op)?;
    Ok(TokenStats {
        logprobs: out.narrow(1, 0, 1)?.squeeze(1)?,
        entropy: out.narrow(1, 1, 1)?.squeeze(1)?.detach(),
    })
}

/// The same results from differentiable primitive ops, holding the whole logits.
fn composite(
    hidden: &Tensor,
    weight: &Tensor,
    targets: &Tensor,
    shaping: Shaping,
) -> Result<TokenStats> {
    let logits = shaped(&linear(hidden, weight, None)?, targets, &shaping)?;
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
    shaping: Shaping,
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
            let logits = at_least_f32(&logits)?;
            outs.push(if logits.dtype() == DType::F32 {
                self.behaviour_stats(&logits, &chunk_targets)?
            } else {
                self.softmax_stats(&logits, &chunk_targets)?
            });
        }
        Tensor::cat(&outs, 0)
    }

    /// (len, 2) from f32 logits (len, vocab): each row's values from the sampler's
    /// arithmetic ([`behaviour::target_stats`]), rows in parallel.
    fn behaviour_stats(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let (len, vocab) = logits.dims2()?;
        let targets = targets.to_vec1::<u32>()?;
        let stats: Vec<[f32; 2]> = with_f32(logits, |values| {
            values
                .par_chunks(vocab)
                .zip(targets.par_iter())
                .map(|(row, &t)| {
                    let (logprob, entropy) =
                        behaviour::target_stats(row, t as usize, &self.shaping);
                    [logprob, entropy as f32]
                })
                .collect()
        })?;
        Tensor::from_vec(stats.concat(), (len, 2), logits.device())
    }

    /// (len, 2) from wider logits, by tensor ops: the composite's log-softmax arithmetic,
    /// for the target column only.
    fn softmax_stats(&self, logits: &Tensor, targets: &Tensor) -> Result<Tensor> {
        let logits = shaped(logits, targets, &self.shaping)?;
        let targets = targets.unsqueeze(1)?;
        let shifted = logits.broadcast_sub(&logits.max_keepdim(D::Minus1)?)?;
        let e = shifted.exp()?;
        let sum = e.sum_keepdim(D::Minus1)?;
        let lse = sum.log()?;
        let logprob = shifted.gather(&targets, 1)?.sub(&lse)?;
        // H = lse - sum(p * shifted), p = e / sum.
        let mean_shifted = (e * shifted)?.sum_keepdim(D::Minus1)?.div(&sum)?;
        Tensor::cat(&[logprob, (lse - mean_shifted)?], 1)
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
        let inv_t = f64::from(self.shaping.inv_temperature());
        let mut grad_hidden = Vec::new();
        let mut grad_weight: Option<Tensor> = None;
        for (start, len) in self.chunks(hidden.dim(0)?) {
            let h = hidden.narrow(0, start, len)?;
            let chunk_targets = self.targets.narrow(0, start, len)?;
            let targets = chunk_targets.unsqueeze(1)?;
            // d logprob / d logits = (onehot(target) - softmax(shaped logits)) / t, 0 off
            // the kept tokens; in the forward's precision, then back to the operands' dtype
            // for the matmuls.
            let logits = shaped(&linear(&h, &weight, None)?, &chunk_targets, &self.shaping)?;
            let g =
                (grad.narrow(0, start, len)?.to_dtype(logits.dtype())? * inv_t)?.contiguous()?;
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
            let want = run(|h, w, t| composite(h, w, t, Shaping::NONE), dtype);
            for chunk_rows in [4, ROWS, 64] {
                let got = run(|h, w, t| fused(h, w, t, chunk_rows, Shaping::NONE), dtype);
                let what = ["logprobs", "entropy", "loss", "grad hidden", "grad weight"];
                for ((g, w), what) in got.iter().zip(&want).zip(what) {
                    assert_eq!(g.len(), w.len(), "{what}");
                    assert_rel_close(g, w, tol, &format!("{dtype:?} chunk {chunk_rows} {what}"));
                }
            }
        }
        let (h, w, targets, _) = inputs(DType::BF16);
        let stats = fused(h.as_tensor(), w.as_tensor(), &targets, 4, Shaping::NONE).unwrap();
        assert_eq!(
            stats.logprobs.dtype(),
            DType::F32,
            "bf16 logits softmaxed in f32"
        );
    }

    /// With a temperature and a nucleus, the fused op still matches the composite in value
    /// and gradient, and each logprob is the target's under the softmax of the logits over
    /// the temperature renormalised over the tokens whose cumulative probability (most
    /// likely first) first reaches top_p, plus the target.
    #[test]
    fn nucleus_logprobs_renormalise_over_the_top_p_set() {
        let (temperature, top_p) = (0.7, 0.6);
        let shaping = Shaping::nucleus(temperature, top_p);
        for dtype in [DType::F32, DType::F64] {
            let want = run(|h, w, t| composite(h, w, t, shaping), dtype);
            let got = run(|h, w, t| fused(h, w, t, 4, shaping), dtype);
            for (g, w) in got.iter().zip(&want) {
                assert_rel_close(g, w, 1e-5, &format!("{dtype:?} nucleus"));
            }
        }
        let (h, w, targets, _) = inputs(DType::F64);
        let logits = (linear(h.as_tensor(), w.as_tensor(), None).unwrap() / f64::from(temperature))
            .unwrap()
            .to_vec2::<f64>()
            .unwrap();
        let got = fused(h.as_tensor(), w.as_tensor(), &targets, 4, shaping).unwrap();
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
                if mass >= f64::from(top_p) {
                    break;
                }
            }
            let t = targets[r] as usize;
            if !kept.contains(&t) {
                kept.push(t);
            }
            truncated += usize::from(kept.len() < VOCAB);
            let lse = kept.iter().map(|&i| row[i].exp()).sum::<f64>().ln();
            assert!((got[r] - (row[t] - lse)).abs() < 1e-6, "row {r}");
        }
        assert_eq!(truncated, ROWS, "every row's nucleus leaves tokens out");
    }

    /// At temperature 1 and at 0.7.
    #[test]
    fn fused_gradient_matches_finite_differences() {
        for shaping in [Shaping::NONE, Shaping::nucleus(0.7, 1.0)] {
            gradient_matches_finite_differences(shaping);
        }
    }

    fn gradient_matches_finite_differences(shaping: Shaping) {
        let (h, w, targets, coef) = inputs(DType::F64);
        let loss_at = |h: &Tensor, w: &Tensor| {
            let s = fused(h, w, &targets, 4, shaping).unwrap();
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
