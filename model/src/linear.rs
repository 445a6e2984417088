//! `x @ w^T + b`, the projection every layer is made of.
//!
//! On the CPU the forward runs our kernels ([`crate::cpu_kernel`]: AVX-512, AVX2 or portable,
//! whichever the CPU has), which are several times faster than candle's CPU matmul on the
//! engine's decode shapes and make a row's result independent of the other rows in the
//! batch; the backward pass is candle's matmuls either way. Other devices use candle's
//! matmul for both.

use candle_core::{Result, Tensor};

/// `x @ w^T + b` for `x` (tokens, in), `w` (out, in), `b` (out,).
pub fn linear(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let y = projection(x, w)?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

fn projection(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    if crate::cpu_kernel::applies(x, w) {
        x.apply_op2(w, crate::cpu_kernel::NtMatmul)
    } else {
        x.matmul(&w.t()?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};
    use rand::{Rng, SeedableRng};

    fn random(len: usize, rng: &mut rand::rngs::StdRng) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    #[test]
    fn linear_matches_candle_forward_and_backward() {
        let dev = Device::Cpu;
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let (m, n, k) = (9, 13, 40);
        let x = Var::from_vec(random(m * k, &mut rng), (m, k), &dev).unwrap();
        let w = Var::from_vec(random(n * k, &mut rng), (n, k), &dev).unwrap();
        let b = Var::from_vec(random(n, &mut rng), n, &dev).unwrap();
        let probe = Tensor::from_vec(random(m * n, &mut rng), (m, n), &dev).unwrap();
        let run = |ours: bool| {
            let y = if ours {
                linear(x.as_tensor(), w.as_tensor(), Some(b.as_tensor())).unwrap()
            } else {
                x.matmul(&w.t().unwrap())
                    .unwrap()
                    .broadcast_add(b.as_tensor())
                    .unwrap()
            };
            let loss = (&y * &probe).unwrap().sum_all().unwrap();
            let grads = loss.backward().unwrap();
            // A var's gradient must not record ops: it would keep the forward graph alive.
            assert!(
                !grads.get(&w).unwrap().track_op(),
                "w's gradient tracks ops"
            );
            let g = |v: &Var| grads.get(v).unwrap().flatten_all().unwrap();
            let g = |v: &Var| g(v).to_vec1::<f32>().unwrap();
            (
                y.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                g(&x),
                g(&w),
                g(&b),
            )
        };
        let (ours, theirs) = (run(true), run(false));
        let close = |a: &[f32], b: &[f32], what: &str| {
            for (i, (a, b)) in a.iter().zip(b).enumerate() {
                assert!((a - b).abs() < 1e-4, "{what}[{i}]: {a} vs {b}");
            }
        };
        close(&ours.0, &theirs.0, "y");
        close(&ours.1, &theirs.1, "grad x");
        close(&ours.2, &theirs.2, "grad w");
        close(&ours.3, &theirs.3, "grad b");
    }
}
