//! The test every fused op passes: same values and gradients as its composite, and
//! gradients that agree with f64 central finite differences.

use candle_core::{DType, Device, Result, Tensor, Var};
use rand::{Rng, SeedableRng};

/// A tensor's elements as f64, in order.
pub(crate) fn values(t: &Tensor) -> Vec<f64> {
    t.flatten_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// Random operands of `shapes` as vars of `dtype`.
fn operands(shapes: &[&[usize]], dtype: DType) -> Vec<Var> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(17);
    shapes
        .iter()
        .map(|&shape| {
            let n: usize = shape.iter().product();
            let v: Vec<f64> = (0..n).map(|_| rng.random_range(-1.5..1.5)).collect();
            let t = Tensor::from_vec(v, shape, &Device::Cpu).unwrap();
            Var::from_tensor(&t.to_dtype(dtype).unwrap()).unwrap()
        })
        .collect()
}

/// `sum(probe * f(operands))` with a fixed probe of distinct weights (so no gradient
/// cancels) and the gradient of every operand; with `detached`, also checks that no
/// gradient records ops (the composites' gradients do).
fn loss_and_grads(
    f: &dyn Fn(&[Tensor]) -> Result<Tensor>,
    vars: &[Var],
    detached: bool,
) -> (Tensor, Vec<Vec<f64>>, Vec<f64>) {
    let inputs: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let out = f(&inputs).unwrap();
    let n = out.elem_count();
    let probe: Vec<f64> = (0..n)
        .map(|i| 1.0 + 0.37 * ((i * 7) % 11) as f64 - 1.9)
        .collect();
    let probe = Tensor::from_vec(probe, out.shape(), &Device::Cpu)
        .unwrap()
        .to_dtype(out.dtype())
        .unwrap();
    let loss = (&out * probe).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    let grads = vars
        .iter()
        .map(|v| {
            let g = grads.get(v).expect("an operand got no gradient");
            assert!(!(detached && g.track_op()), "a gradient records ops");
            values(g)
        })
        .collect();
    (loss, grads, values(&out))
}

/// Checks `fused` against `composite` on random operands of `shapes`: outputs and gradients
/// of a weighted sum agree within 1e-5 (relative to the largest magnitude) in f32 and f64;
/// and in f64 the fused gradient of every operand matches central finite differences.
pub(crate) fn fused_matches_composite(
    shapes: &[&[usize]],
    fused: impl Fn(&[Tensor]) -> Result<Tensor>,
    composite: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    let close = |a: &[f64], b: &[f64], what: &str| {
        assert_eq!(a.len(), b.len(), "{what}");
        let scale = b.iter().fold(1e-12f64, |m, x| m.max(x.abs()));
        for (i, (x, y)) in a.iter().zip(b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * scale,
                "{what}[{i}]: fused {x}, composite {y}"
            );
        }
    };
    for dtype in [DType::F32, DType::F64] {
        let vars = operands(shapes, dtype);
        let (_, gf, of) = loss_and_grads(&fused, &vars, true);
        let (_, gc, oc) = loss_and_grads(&composite, &vars, false);
        close(&of, &oc, &format!("{dtype:?} output"));
        for (k, (a, b)) in gf.iter().zip(&gc).enumerate() {
            close(a, b, &format!("{dtype:?} gradient of operand {k}"));
        }
    }
    let vars = operands(shapes, DType::F64);
    let (_, grads, _) = loss_and_grads(&fused, &vars, true);
    for (k, var) in vars.iter().enumerate() {
        let base = values(var.as_tensor());
        for idx in 0..base.len() {
            let at = |delta: f64| {
                let mut v = base.clone();
                v[idx] += delta;
                let shifted = Var::from_vec(v, var.shape(), &Device::Cpu).unwrap();
                let mut others = vars.clone();
                others[k] = shifted;
                let (loss, _, _) = loss_and_grads(&fused, &others, true);
                loss.to_scalar::<f64>().unwrap()
            };
            let h = 1e-6;
            let numeric = (at(h) - at(-h)) / (2.0 * h);
            let analytic = grads[k][idx];
            assert!(
                (analytic - numeric).abs() <= 1e-8 + 1e-6 * numeric.abs().max(analytic.abs()),
                "operand {k}[{idx}]: fused backward {analytic}, finite differences {numeric}"
            );
        }
    }
}
