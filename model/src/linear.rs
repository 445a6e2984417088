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
    with_bias(projection(x, w)?, b)
}

/// `y + b`, broadcast over the rows, where there is a bias.
pub(crate) fn with_bias(y: Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// `x @ w_i^T + b_i` for several projections of one input (q, k, v; gate, up), with the
/// same values as [`linear`] on each. Outside autograd on the CPU kernel they run as one
/// pass, `x` packed once; anything else goes through [`linear`] one by one.
pub fn linear_many<const N: usize>(
    x: &Tensor,
    ws: [&Tensor; N],
    bs: [Option<&Tensor>; N],
) -> Result<[Tensor; N]> {
    let together = ws
        .iter()
        .all(|w| crate::cpu_kernel::applies(x, w) && !w.track_op())
        && !x.track_op();
    let ys = if together {
        crate::cpu_kernel::products(x, &ws)?
            .into_iter()
            .zip(bs)
            .map(|(y, b)| with_bias(y, b))
            .collect::<Result<Vec<_>>>()?
    } else {
        ws.iter()
            .zip(bs)
            .map(|(w, b)| linear(x, w, b))
            .collect::<Result<Vec<_>>>()?
    };
    Ok(ys.try_into().expect("one output per weight"))
}

pub(crate) fn projection(x: &Tensor, w: &Tensor) -> Result<Tensor> {
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

    /// Outside autograd, the projections of one input run together and give exactly what
    /// [`linear`] gives for each; tracked, they still get their gradients.
    #[test]
    fn linear_many_equals_linear_bit_for_bit_and_keeps_gradients() {
        let dev = Device::Cpu;
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (m, k) = (70, 33);
        let x = Tensor::from_vec(random(m * k, &mut rng), (m, k), &dev).unwrap();
        let ws: Vec<Tensor> = [5, 200, 97]
            .iter()
            .map(|&n| Tensor::from_vec(random(n * k, &mut rng), (n, k), &dev).unwrap())
            .collect();
        let b = Tensor::from_vec(random(200, &mut rng), 200, &dev).unwrap();
        let bs = [None, Some(&b), None];
        let many = linear_many(&x, [&ws[0], &ws[1], &ws[2]], bs).unwrap();
        for ((y, w), b) in many.iter().zip(&ws).zip(bs) {
            let alone = linear(&x, w, b).unwrap();
            let bits = |t: &Tensor| -> Vec<u32> {
                let v = t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                v.iter().map(|f| f.to_bits()).collect()
            };
            assert_eq!(bits(y), bits(&alone));
        }
        let wv = Var::from_tensor(&ws[1]).unwrap();
        let [y0, y1] = linear_many(&x, [&ws[0], wv.as_tensor()], [None, None]).unwrap();
        let grads = (y0.sum_all().unwrap() + y1.sum_all().unwrap())
            .unwrap()
            .backward()
            .unwrap();
        let g = grads.get(&wv).expect("the tracked weight gets a gradient");
        assert!(
            g.abs()
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                > 0.0
        );
    }
}
