//! AdamW's update of f32 CPU tensors in place: three passes (first moment, second moment,
//! parameter; parallel when rayon has several threads) instead of a dozen tensor ops that
//! each allocate a parameter-sized tensor. On SmolLM2-135M the allocating version spent
//! more time in page faults than in arithmetic. Other devices and dtypes take the tensor-op
//! path in [`super::AdamW::step`].

use candle_core::{bail, CpuStorage, DType, InplaceOp2, InplaceOp3, Layout, Result, Tensor};
use dppo_model::parallel::multi_threaded;
use rayon::prelude::*;

/// Elements per parallel chunk.
const CHUNK: usize = 1 << 15;

/// The scalars of one AdamW update.
#[derive(Debug, Clone, Copy)]
pub(super) struct Update {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub lr: f64,
    /// `1 - lr * weight_decay` for decaying parameters, 1 otherwise.
    pub decay: f64,
    pub bias1: f64,
    pub bias2: f64,
}

/// Whether `tensors` can be updated in place: contiguous f32 on the CPU.
pub(super) fn applies(tensors: &[&Tensor]) -> bool {
    tensors
        .iter()
        .all(|t| t.device().is_cpu() && t.dtype() == DType::F32 && t.is_contiguous())
}

/// `m <- beta1 m + (1 - beta1) g`, `v <- beta2 v + (1 - beta2) g^2`, then
/// `theta <- decay theta - lr (m / bias1) / (sqrt(v / bias2) + eps)`, all in place.
pub(super) fn step(theta: &Tensor, m: &Tensor, v: &Tensor, g: &Tensor, u: Update) -> Result<()> {
    m.inplace_op2(
        g,
        &Moment {
            beta: u.beta1,
            square: false,
        },
    )?;
    v.inplace_op2(
        g,
        &Moment {
            beta: u.beta2,
            square: true,
        },
    )?;
    theta.inplace_op3(m, v, &Parameter(u))
}

/// An exponential moving average of the gradient (or of its square).
struct Moment {
    beta: f64,
    square: bool,
}

impl InplaceOp2 for Moment {
    fn name(&self) -> &'static str {
        "adamw-moment"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<()> {
        let (avg, g) = (f32_mut(s1, l1)?, f32_ref(s2, l2)?);
        if avg.len() != g.len() {
            bail!(
                "adamw: moment has {} elements, gradient {}",
                avg.len(),
                g.len()
            );
        }
        let (beta, rest) = (self.beta as f32, (1.0 - self.beta) as f32);
        let square = self.square;
        let update = |(avg, g): (&mut [f32], &[f32])| {
            for (a, &g) in avg.iter_mut().zip(g) {
                let x = if square { g * g } else { g };
                *a = *a * beta + x * rest;
            }
        };
        if multi_threaded() {
            avg.par_chunks_mut(CHUNK)
                .zip(g.par_chunks(CHUNK))
                .for_each(update);
        } else {
            avg.chunks_mut(CHUNK).zip(g.chunks(CHUNK)).for_each(update);
        }
        Ok(())
    }
}

/// The parameter update from the new moments.
struct Parameter(Update);

impl InplaceOp3 for Parameter {
    fn name(&self) -> &'static str {
        "adamw-parameter"
    }

    fn cpu_fwd(
        &self,
        s1: &mut CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<()> {
        let theta = f32_mut(s1, l1)?;
        let (m, v) = (f32_ref(s2, l2)?, f32_ref(s3, l3)?);
        if theta.len() != m.len() || theta.len() != v.len() {
            bail!("adamw: parameter and moments differ in size");
        }
        let u = self.0;
        let (bias1, bias2) = (u.bias1 as f32, u.bias2 as f32);
        let (eps, lr, decay) = (u.eps as f32, u.lr as f32, u.decay as f32);
        let update = |(theta, (m, v)): (&mut [f32], (&[f32], &[f32]))| {
            for ((t, &m), &v) in theta.iter_mut().zip(m).zip(v) {
                let update = (m / bias1) / ((v / bias2).sqrt() + eps);
                *t = *t * decay - update * lr;
            }
        };
        if multi_threaded() {
            theta
                .par_chunks_mut(CHUNK)
                .zip(m.par_chunks(CHUNK).zip(v.par_chunks(CHUNK)))
                .for_each(update);
        } else {
            theta
                .chunks_mut(CHUNK)
                .zip(m.chunks(CHUNK).zip(v.chunks(CHUNK)))
                .for_each(update);
        }
        Ok(())
    }
}

fn f32_mut<'a>(s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(data), Some((start, end))) => Ok(&mut data[start..end]),
        _ => bail!("adamw: in-place update needs contiguous f32 storage"),
    }
}

fn f32_ref<'a>(s: &'a CpuStorage, l: &Layout) -> Result<&'a [f32]> {
    match (s, l.contiguous_offsets()) {
        (CpuStorage::F32(data), Some((start, end))) => Ok(&data[start..end]),
        _ => bail!("adamw: in-place update needs contiguous f32 storage"),
    }
}
