//! Queues kernels/qkv_rope.cu's `qkv_rope` on candle's CUDA stream
//! (`engine.rope_kernel`): the q/k/v projection's bias, its q/k norms
//! (`engine.rope_qk_norm`) and rotation as one custom op, which writes k and v into the
//! layer's pools with `engine.rope_writes_kv`. `super::launch`'s backend calls it.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaView, DevicePtrMut, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, CudaStorage, WrapErr};
use candle_core::{bail, CustomOp3, DType, Layout, Result, Shape, Tensor};
use dppo_model::QkNorms;

use super::device_buffers::CudaIndex;
use super::gpu::{config, elements, function, gpu_only_cpu_fwd};
use super::params::{self, Scalars};
use super::pools::with_pools;

/// `qkv_rope` of the projection (the op's first input) by the angles (the other two), its q
/// and k heads normed by `norms` and k and v into the layer's `pools` where given.
pub(super) struct Rotate<'a> {
    pub(super) index: &'a CudaIndex,
    pub(super) bias: Option<&'a Tensor>,
    pub(super) norms: Option<QkNorms<'a>>,
    pub(super) pools: Option<[&'a Tensor; 2]>,
}

impl CustomOp3 for Rotate<'_> {
    fn name(&self) -> &'static str {
        "paged-qkv-rope"
    }

    gpu_only_cpu_fwd!("paged-qkv-rope");

    fn cuda_fwd(
        &self,
        qkv: &CudaStorage,
        l: &Layout,
        cos: &CudaStorage,
        cl: &Layout,
        sin: &CudaStorage,
        sl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let args = ((qkv, l), (cos, cl), (sin, sl));
        match qkv.dtype() {
            DType::F32 => rotate::<f32>(self, args),
            DType::BF16 => rotate::<half::bf16>(self, args),
            DType::F16 => rotate::<half::f16>(self, args),
            other => bail!("cuda attention: no kernels for {other:?}"),
        }
    }
}

/// One storage and its layout.
type Operand<'a> = (&'a CudaStorage, &'a Layout);

fn rotate<T: CudaDType + DeviceRepr>(
    op: &Rotate<'_>,
    ((qkv, l), (cos, cl), (sin, sl)): (Operand<'_>, Operand<'_>, Operand<'_>),
) -> Result<(CudaStorage, Shape)> {
    let plan = &op.index.plan;
    let heads = plan.heads;
    let kv_row = heads.num_kv_heads * heads.head_dim;
    let width = heads.num_heads * heads.head_dim + 2 * kv_row;
    let half = plan.rows * heads.head_dim / 2;
    if l.shape().elem_count() != plan.rows * width
        || cl.shape().elem_count() != half
        || sl.shape().elem_count() != half
    {
        bail!(
            "paged-qkv-rope: {} projected values and {} angles for {} rows of {width}",
            l.shape().elem_count(),
            cl.shape().elem_count(),
            plan.rows
        );
    }
    let (device, dtype) = (&qkv.device, qkv.dtype());
    let qkv = elements::<T>(qkv, l, "qkv_rope's projection")?;
    let (cos, sin) = (
        elements::<T>(cos, cl, "qkv_rope's cos")?,
        elements::<T>(sin, sl, "qkv_rope's sin")?,
    );
    let bias = op.bias.map(Tensor::storage_and_layout);
    let bias = match &bias {
        Some((storage, layout)) => Some(gpu_values::<T>(storage, layout, (width, "bias"))?),
        None => None,
    };
    let norms = op
        .norms
        .map(|n| [n.q.storage_and_layout(), n.k.storage_and_layout()]);
    let d = heads.head_dim;
    let norms = match &norms {
        Some([(q, ql), (k, kl)]) => Some([
            gpu_values::<T>(q, ql, (d, "q norm"))?,
            gpu_values::<T>(k, kl, (d, "k norm"))?,
        ]),
        None => None,
    };
    let out_len = match op.pools {
        Some(_) => plan.rows * (width - 2 * kv_row),
        None => plan.rows * width,
    };
    // SAFETY: the kernel writes every element: each row's q, and its k and v segments where
    // they are not written into the pools.
    let mut out = unsafe { device.alloc::<T>(out_len) }?;
    let scalars = Scalars::of(plan);
    let has_bias = u32::from(bias.is_some());
    let has_norm = u32::from(norms.is_some());
    let eps = op.norms.map_or(0.0, |n| n.eps as f32);
    let stream = device.cuda_stream();
    let func = function(device, "qkv_rope", Some(dtype))?;
    let launch = |pools: [&u64; 2], out: &mut CudaSlice<T>| -> Result<()> {
        let mut launch = stream.launch_builder(&func);
        params::QkvRope {
            qkv: &qkv,
            bias: bias.as_ref().unwrap_or(&qkv),
            cos: &cos,
            sin: &sin,
            out,
            pools,
            slots: &op.index.slots,
            norms: match &norms {
                Some([q, k]) => [q, k],
                None => [&qkv, &qkv],
            },
            scalars: &scalars,
            has_bias: &has_bias,
            has_norm: &has_norm,
            eps: &eps,
        }
        .push_to(&mut launch);
        // SAFETY: the arguments are `qkv_rope`'s list in kernels/qkv_rope.cu; the
        // sizes of the projection, the bias, the angles and the output were checked against
        // the plan, the pools are null or the layer's whole pools, and every slot of the plan
        // lies inside them (the scheduler's blocks).
        unsafe { launch.launch(config(plan.rope_geometry())) }.w()?;
        Ok(())
    };
    match op.pools {
        None => launch([&0, &0], &mut out)?,
        Some([k, v]) => with_pools(k, v, |[k, v]: [&mut CudaStorage; 2]| {
            if k.dtype() != dtype || v.dtype() != dtype {
                bail!("paged-qkv-rope: the pools and the projection differ in dtype");
            }
            let (k, v) = (k.as_cuda_slice_mut::<T>()?, v.as_cuda_slice_mut::<T>()?);
            // The guards record the writes on the stream once the kernel is queued.
            let (k, _k_written) = k.device_ptr_mut(&stream);
            let (v, _v_written) = v.device_ptr_mut(&stream);
            launch([&k, &v], &mut out)
        })?,
    }
    Ok((
        T::wrap_cuda_slice(out, device.clone()),
        Shape::from(out_len),
    ))
}

/// The `len` values of a tensor's `storage` on the GPU (`what` names it in errors).
fn gpu_values<'s, T: CudaDType>(
    storage: &'s candle_core::Storage,
    layout: &Layout,
    (len, what): (usize, &str),
) -> Result<CudaView<'s, T>> {
    match storage {
        candle_core::Storage::Cuda(s) if layout.shape().elem_count() == len => {
            elements::<T>(s, layout, what)
        }
        _ => bail!("paged-qkv-rope: a {what} that is not {len} values on the GPU"),
    }
}
