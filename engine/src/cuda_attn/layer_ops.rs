//! The layer's elementwise steps by kernels/layer_ops.cu's `add_rms_norm` and
//! `silu_mul` (`engine.layer_kernels`): the residual sum with the RMSNorm that reads it, and
//! the gated MLP's product straight from the concatenated gate/up projection, one launch
//! each where candle takes two or three ops (two of them over strided halves). On a GPU they
//! launch on candle's stream; in the engine's unit tests the CPU runs the same source
//! (`super::emulated`).

use std::cell::Cell;

use candle_core::{bail, CpuStorage, CustomOp1, CustomOp3, Layout, Result, Shape, Tensor};

/// The kernels, as the backends hand them to the model, counting their launches.
#[derive(Debug, Default)]
pub struct LayerOps {
    pub launches: Cell<u64>,
}

impl dppo_model::LayerKernels for LayerOps {
    fn add_rms_norm(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        weight: &Tensor,
        eps: f64,
    ) -> Result<(Tensor, Tensor)> {
        let x = x.contiguous()?;
        let op = AddNorm {
            has_residual: residual.is_some(),
            eps: eps as f32,
        };
        let r = match residual {
            Some(r) => r.contiguous()?,
            None => x.clone(),
        };
        let out = x.apply_op3_no_bwd(&r, &weight.contiguous()?, &op)?;
        self.launches.set(self.launches.get() + 1);
        let (sum, normed) = (out.get(0)?, out.get(1)?);
        Ok((if residual.is_some() { sum } else { x }, normed))
    }

    fn silu_mul_halves(&self, gate_up: &Tensor) -> Result<Tensor> {
        let out = gate_up.contiguous()?.apply_op1_no_bwd(&SiluMul)?;
        self.launches.set(self.launches.get() + 1);
        Ok(out)
    }
}

/// `add_rms_norm` of x, the residual (x itself when `!has_residual`) and the norm's weight:
/// out (2, rows, width), the sum then the normed rows.
pub(super) struct AddNorm {
    pub(super) has_residual: bool,
    pub(super) eps: f32,
}

impl AddNorm {
    /// Rows and width of `x` (rows, width), checked against the residual and the weight.
    fn dims(&self, (xl, rl, wl): (&Layout, &Layout, &Layout)) -> Result<(usize, usize)> {
        let (rows, width) = xl.shape().dims2()?;
        if 2 * rows * width > u32::MAX as usize {
            bail!("add_rms_norm: {rows} rows of {width} is more than the kernel indexes");
        }
        if rl.shape() != xl.shape() || wl.shape().elem_count() != width {
            bail!(
                "add_rms_norm: x {:?}, residual {:?} and weight {:?} do not agree",
                xl.shape(),
                rl.shape(),
                wl.shape()
            );
        }
        Ok((rows, width))
    }
}

impl CustomOp3 for AddNorm {
    fn name(&self) -> &'static str {
        "dppo-add-rms-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        r: &CpuStorage,
        rl: &Layout,
        w: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (rows, width) = self.dims((xl, rl, wl))?;
        #[cfg(all(test, target_os = "linux"))]
        {
            let op = (self.has_residual, self.eps);
            let out = super::emulated::layer::add_rms_norm(op, (x, xl), (r, rl), (w, wl))?;
            Ok((out, Shape::from((2, rows, width))))
        }
        #[cfg(not(all(test, target_os = "linux")))]
        {
            let _ = (x, r, w, rows, width);
            bail!("add_rms_norm runs on a GPU only")
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        r: &candle_core::CudaStorage,
        rl: &Layout,
        w: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, width) = self.dims((xl, rl, wl))?;
        let out = on_gpu::add_rms_norm(self, (x, xl), (r, rl), (w, wl), rows)?;
        Ok((out, Shape::from((2, rows, width))))
    }
}

/// `silu_mul` of the (rows, 2 * width) projection: out (rows, width).
pub(super) struct SiluMul;

impl SiluMul {
    /// Rows and the output's width of a (rows, 2 * width) projection.
    fn dims(layout: &Layout) -> Result<(usize, usize)> {
        let (rows, both) = layout.shape().dims2()?;
        if both % 2 != 0 {
            bail!("silu_mul: a projection of odd width {both}");
        }
        // The kernel's row and column indices (u32, strided) must not wrap.
        if rows.max(both) > (u32::MAX / 2) as usize {
            bail!("silu_mul: {rows} rows of {both} is more than the kernel indexes");
        }
        Ok((rows, both / 2))
    }
}

impl CustomOp1 for SiluMul {
    fn name(&self) -> &'static str {
        "dppo-silu-mul"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let (rows, width) = Self::dims(l)?;
        #[cfg(all(test, target_os = "linux"))]
        {
            let out = super::emulated::layer::silu_mul((s, l), width)?;
            Ok((out, Shape::from((rows, width))))
        }
        #[cfg(not(all(test, target_os = "linux")))]
        {
            let _ = (s, rows, width);
            bail!("silu_mul runs on a GPU only")
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (rows, width) = Self::dims(l)?;
        let out = on_gpu::silu_mul((s, l), rows, width)?;
        Ok((out, Shape::from((rows, width))))
    }
}

/// The launches on candle's stream.
#[cfg(feature = "cuda")]
mod on_gpu {
    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::DeviceRepr;
    use candle_core::cuda_backend::{CudaDType, CudaStorage, WrapErr};
    use candle_core::{bail, DType, Layout, Result};

    use super::AddNorm;
    use crate::cuda_attn::gpu::{config, elements, function};
    use crate::cuda_attn::params;
    use crate::cuda_attn::{norm_geometry, silu_geometry};

    /// `add_rms_norm` of `rows` rows: (2, rows, width) out.
    pub(super) fn add_rms_norm(
        op: &AddNorm,
        x: (&CudaStorage, &Layout),
        r: (&CudaStorage, &Layout),
        w: (&CudaStorage, &Layout),
        rows: usize,
    ) -> Result<CudaStorage> {
        match x.0.dtype() {
            DType::F32 => norm::<f32>(op, x, r, w, rows),
            DType::BF16 => norm::<half::bf16>(op, x, r, w, rows),
            DType::F16 => norm::<half::f16>(op, x, r, w, rows),
            other => bail!("add_rms_norm: no kernel for {other:?}"),
        }
    }

    fn norm<T: CudaDType + DeviceRepr>(
        op: &AddNorm,
        (x, xl): (&CudaStorage, &Layout),
        (r, rl): (&CudaStorage, &Layout),
        (w, wl): (&CudaStorage, &Layout),
        rows: usize,
    ) -> Result<CudaStorage> {
        let width = wl.shape().elem_count();
        let device = &x.device;
        let (xs, rs, ws) = (
            elements::<T>(x, xl, "add_rms_norm's x")?,
            elements::<T>(r, rl, "add_rms_norm's residual")?,
            elements::<T>(w, wl, "add_rms_norm's weight")?,
        );
        // SAFETY: the kernel writes every element: each row's sum and normed values.
        let mut out = unsafe { device.alloc::<T>(2 * rows * width) }?;
        let (width_arg, has_residual) = (width as u32, u32::from(op.has_residual));
        let stream = device.cuda_stream();
        let func = function(device, "add_rms_norm", Some(x.dtype()))?;
        let mut launch = stream.launch_builder(&func);
        params::AddRmsNorm {
            x: &xs,
            r: &rs,
            weight: &ws,
            out: &mut out,
            width: &width_arg,
            has_residual: &has_residual,
            eps: &op.eps,
        }
        .push_to(&mut launch);
        // SAFETY: the arguments are `add_rms_norm`'s list in kernels/layer_ops.cu; x,
        // the residual and the output hold `rows` rows of `width`, the weight `width`.
        unsafe { launch.launch(config(norm_geometry(rows))) }.w()?;
        Ok(T::wrap_cuda_slice(out, device.clone()))
    }

    /// `silu_mul` of a (rows, 2 * width) projection: (rows, width) out.
    pub(super) fn silu_mul(
        s: (&CudaStorage, &Layout),
        rows: usize,
        width: usize,
    ) -> Result<CudaStorage> {
        match s.0.dtype() {
            DType::F32 => gated::<f32>(s, rows, width),
            DType::BF16 => gated::<half::bf16>(s, rows, width),
            DType::F16 => gated::<half::f16>(s, rows, width),
            other => bail!("silu_mul: no kernel for {other:?}"),
        }
    }

    fn gated<T: CudaDType + DeviceRepr>(
        (s, l): (&CudaStorage, &Layout),
        rows: usize,
        width: usize,
    ) -> Result<CudaStorage> {
        let device = &s.device;
        let gate_up = elements::<T>(s, l, "silu_mul's projection")?;
        let total = rows * width;
        // SAFETY: the kernel writes every element (its threads stride over all of them).
        let mut out = unsafe { device.alloc::<T>(total) }?;
        let (width_arg, rows_arg) = (width as u32, rows as u32);
        let stream = device.cuda_stream();
        let func = function(device, "silu_mul", Some(s.dtype()))?;
        let mut launch = stream.launch_builder(&func);
        params::SiluMul {
            gate_up: &gate_up,
            out: &mut out,
            width: &width_arg,
            rows: &rows_arg,
        }
        .push_to(&mut launch);
        let geometry = silu_geometry(rows, width, std::mem::size_of::<T>());
        // SAFETY: the arguments are `silu_mul`'s list in kernels/layer_ops.cu; the
        // projection holds `rows` rows of 2 * width, the output `total` values.
        unsafe { launch.launch(config(geometry)) }.w()?;
        Ok(T::wrap_cuda_slice(out, device.clone()))
    }
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use candle_core::{DType, Device, Tensor};
    use dppo_model::LayerKernels;

    use super::LayerOps;

    /// Largest difference between `a` and `b` relative to `b`'s magnitude (at least 1).
    fn worst(a: &Tensor, b: &Tensor) -> f32 {
        let f = |t: &Tensor| {
            let t = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            t.to_vec1::<f32>().unwrap()
        };
        f(a).iter()
            .zip(f(b))
            .map(|(x, y)| (x - y).abs() / y.abs().max(1.0))
            .fold(
                0f32,
                |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
            )
    }

    /// The kernels compute what the model's ops compute: the residual sum exactly, its
    /// RMSNorm within two of the dtype's rounding steps of candle-nn's (which also rounds
    /// once), without a residual too; silu(gate) * up from the projection's halves within one
    /// step of silu computed in f32 and rounded, times up, rounded. Widths that leave threads
    /// idle, and projections wider and taller than the silu kernel's grid, so that its blocks
    /// stride across columns and down rows.
    #[test]
    fn the_layer_kernels_compute_the_models_ops() {
        let dev = Device::Cpu;
        // A dtype's rounding step, relative: f32's reduction order is another matter, 1e-6.
        let dtypes = [
            (DType::F32, 1e-6),
            (DType::BF16, 7.9e-3),
            (DType::F16, 9.8e-4),
        ];
        // Widths of whole 16-byte vectors (the kernels' vector path), and 90, 302 and 4500,
        // which are not (their one-element path; 4500 is whole vectors of f32 only). 302, 1544
        // and 2056 take a norm thread round its row twice (one element, f32 vectors, bf16 and
        // f16 vectors); 32776 takes a silu thread across its row twice in every dtype.
        let cases = [
            (5, 96),
            (3, 896),
            (130, 40),
            (4, 90),
            (4, 302),
            (3, 1544),
            (2, 2056),
            (3, 4500),
            (2, 32776),
            (1100, 40),
        ];
        for (rows, width) in cases {
            let x = Tensor::randn(0f32, 1.0, (rows, width), &dev).unwrap();
            let r = Tensor::randn(0f32, 1.0, (rows, width), &dev).unwrap();
            let w = Tensor::randn(1f32, 0.2, width, &dev).unwrap();
            let gate_up = Tensor::randn(0f32, 2.0, (rows, 2 * width), &dev).unwrap();
            // The tallest case is for the silu kernel's row stride, in f32 only.
            let dtypes = if rows > 256 {
                &dtypes[..1]
            } else {
                &dtypes[..]
            };
            // The widest cases are for the silu kernel's column stride: norms are checked at
            // hidden sizes, since f32's difference in reduction order grows with the width.
            let residuals = if width > 2100 { 0 } else { 2 };
            for &(dtype, tol) in dtypes {
                let c = |t: &Tensor| t.to_dtype(dtype).unwrap();
                for residual in [None, Some(c(&r))].into_iter().take(residuals) {
                    let (sum, normed) = LayerOps::default()
                        .add_rms_norm(&c(&x), residual.as_ref(), &c(&w), 1e-6)
                        .unwrap();
                    let want_sum = match &residual {
                        Some(r) => {
                            let want = (c(&x) + r).unwrap();
                            // Rounded as candle's add rounds it.
                            assert_eq!(worst(&sum, &want), 0.0, "{dtype:?} sum");
                            want
                        }
                        None => c(&x),
                    };
                    let want = candle_nn::ops::rms_norm(&want_sum, &c(&w), 1e-6).unwrap();
                    let d = worst(&normed, &want);
                    assert!(d <= 2.0 * tol, "{dtype:?} {rows}x{width} norm: {d}");
                }
                let got = LayerOps::default().silu_mul_halves(&c(&gate_up)).unwrap();
                let (gate, up) = (
                    c(&gate_up).narrow(1, 0, width).unwrap(),
                    c(&gate_up).narrow(1, width, width).unwrap(),
                );
                // silu in f32 from the stored inputs, rounded to the dtype, then the product
                // rounded: the kernel's two roundings.
                let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
                let silu = c(&dppo_model::ops::silu(&f(&gate)).unwrap());
                let want = c(&(f(&silu) * f(&up)).unwrap());
                let d = worst(&got, &want);
                assert!(d <= tol, "{dtype:?} {rows}x{width} silu_mul: {d}");
            }
        }
    }

    /// Rows that do not start on a 16-byte vector (a view one element into its buffer) take
    /// the kernels' one-element path: the same gated product and residual sum, bit for bit,
    /// and the same norm within rounding (its squares summed in another order).
    #[test]
    fn rows_off_a_vector_boundary_take_the_one_element_path() {
        let dev = Device::Cpu;
        let (rows, width) = (3, 896);
        let ops = LayerOps::default();
        for dtype in [DType::F32, DType::BF16] {
            let c = |t: Tensor| t.to_dtype(dtype).unwrap();
            // A (rows, width) view one element into its buffer, and an aligned copy of it.
            let shifted = |cols: usize| {
                let n = rows * cols;
                let buf = c(Tensor::randn(0f32, 1.0, n + 1, &dev).unwrap());
                let view = buf.narrow(0, 1, n).unwrap().reshape((rows, cols)).unwrap();
                let copy = c(view.to_dtype(DType::F32).unwrap());
                (view, copy)
            };
            let (gate_up, aligned) = shifted(2 * width);
            let got = ops.silu_mul_halves(&gate_up).unwrap();
            let want = ops.silu_mul_halves(&aligned).unwrap();
            assert_eq!(worst(&got, &want), 0.0, "{dtype:?} silu_mul");
            let ((x, x_copy), (r, r_copy)) = (shifted(width), shifted(width));
            let w = c(Tensor::randn(1f32, 0.2, width, &dev).unwrap());
            let (sum, normed) = ops.add_rms_norm(&x, Some(&r), &w, 1e-6).unwrap();
            let (want_sum, want_normed) =
                ops.add_rms_norm(&x_copy, Some(&r_copy), &w, 1e-6).unwrap();
            assert_eq!(worst(&sum, &want_sum), 0.0, "{dtype:?} sum");
            let tol = if dtype == DType::F32 { 2e-6 } else { 1.6e-2 };
            assert!(worst(&normed, &want_normed) <= tol, "{dtype:?} norm");
        }
    }

    /// Without a residual the op's first half is x itself, written in full (the model is
    /// handed x, but the kernel writes every element it allocates).
    #[test]
    fn without_a_residual_the_sum_is_x() {
        let x = Tensor::randn(0f32, 1.0, (7, 40), &Device::Cpu).unwrap();
        let w = Tensor::randn(1f32, 0.2, 40, &Device::Cpu).unwrap();
        let op = super::AddNorm {
            has_residual: false,
            eps: 1e-6,
        };
        for dtype in [DType::F32, DType::BF16] {
            let x = x.to_dtype(dtype).unwrap();
            let out = x
                .apply_op3_no_bwd(&x, &w.to_dtype(dtype).unwrap(), &op)
                .unwrap();
            assert_eq!(worst(&out.get(0).unwrap(), &x), 0.0, "{dtype:?}");
        }
    }

    /// The launch's block is the kernel's `NORM_THREADS`, which sizes its warp sums.
    #[test]
    fn the_norm_block_is_the_kernels() {
        let define = crate::cuda_attn::SOURCE
            .lines()
            .find_map(|l| l.strip_prefix("#define NORM_THREADS "))
            .expect("NORM_THREADS in the kernel source");
        let threads: u32 = define.trim().parse().unwrap();
        assert_eq!(crate::cuda_attn::norm_geometry(3).block, (threads, 1, 1));
    }

    /// Each call counts its launch.
    #[test]
    fn each_kernel_call_counts_a_launch() {
        let ops = LayerOps::default();
        let x = Tensor::ones((2, 64), DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::ones(64, DType::F32, &Device::Cpu).unwrap();
        ops.add_rms_norm(&x, None, &w, 1e-6).unwrap();
        ops.add_rms_norm(&x, Some(&x), &w, 1e-6).unwrap();
        ops.silu_mul_halves(&x).unwrap();
        assert_eq!(ops.launches.get(), 3);
    }
}
