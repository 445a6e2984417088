//! Queues kernels/paged_attention.cu on candle's CUDA stream: the K/V writes as in-place ops
//! on the pool's tensors, the attention and the merge of its splits as one custom op whose
//! output is a new tensor, and with `engine.rope_kernel` the projection's bias and rotation as
//! one custom op before them (`super::rotate`; `engine.layer_kernels`' ops are
//! `super::layer_ops`). What they read on the device besides the pool is
//! `super::device_buffers`'.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaFunction, CudaSlice, DeviceRepr};
use candle_core::cuda_backend::{CudaDType, CudaStorage, WrapErr};
use candle_core::{
    bail, CpuStorage, CustomOp3, DType, InplaceOp1, InplaceOp2, Layout, Result, Shape, Tensor,
};
use dppo_model::{AttentionBackend, LayerKernels, Projection, RopeAt};

use super::copies::{self, SlotCopies};
use super::device_buffers::{cuda, CudaIndex, DeviceTables};
use super::gpu::{attention_function, config, function, gpu_only_cpu_fwd};
use super::params::{self, Scalars};
use super::rotate::Rotate;
use super::{rotated, AttentionKernel, Extras, KernelPlan};
use crate::generic_attn::TensorKvCache;

/// The backend over the pool's tensors for one iteration.
pub struct CudaPagedAttention<'a> {
    pub cache: &'a mut TensorKvCache,
    pub index: &'a CudaIndex,
    pub tables: &'a DeviceTables,
    /// The rope and layer kernels.
    pub(crate) extras: Extras,
    /// The attention kernel's variant.
    pub(crate) variant: AttentionKernel,
}

impl AttentionBackend for CudaPagedAttention<'_> {
    fn attend(&mut self, layer_idx: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let (kc, vc) = self.cache.layer(layer_idx);
        kc.inplace_op2(&k.contiguous()?, &WriteSlots(self.index))?;
        vc.inplace_op2(&v.contiguous()?, &WriteSlots(self.index))?;
        self.extras.slot_writes += 2;
        self.attend_pools(layer_idx, q)
    }

    fn takes_projection(&self, qk_norms: bool) -> bool {
        self.extras.takes_projection(qk_norms)
    }

    fn attend_projected(
        &mut self,
        layer_idx: usize,
        projection: Projection<'_>,
        rope: &RopeAt,
    ) -> Result<Tensor> {
        let index = self.index;
        self.extras.rotations += 1;
        let into_pools = self.extras.rope_writes_kv;
        let (kc, vc) = self.cache.layer(layer_idx);
        let rotate = Rotate {
            index,
            bias: projection.bias,
            norms: projection.norms,
            pools: into_pools.then_some([kc, vc]),
        };
        match rotated(
            &rotate,
            index.plan.heads,
            (projection.qkv, rope),
            into_pools,
        )? {
            (q, Some((k, v))) => self.attend(layer_idx, &q, &k, &v),
            (q, None) => self.attend_pools(layer_idx, &q),
        }
    }

    fn layer_kernels(&self) -> Option<&dyn LayerKernels> {
        self.extras.layer_kernels()
    }
}

impl CudaPagedAttention<'_> {
    /// The attention of `q` over the layer's pools, its K and V already in them.
    fn attend_pools(&self, layer_idx: usize, q: &Tensor) -> Result<Tensor> {
        let (kc, vc) = self.cache.layer(layer_idx);
        let attend = Attend {
            index: self.index,
            tables: &self.tables.table,
            variant: self.variant,
        };
        q.contiguous()?.apply_op3_no_bwd(kc, vc, &attend)
    }
}

/// Copy-on-write: `copies` in every layer's pool, one upload and a launch per pool tensor.
pub fn copy_slots(cache: &TensorKvCache, copies: &SlotCopies, plan: &KernelPlan) -> Result<()> {
    if copies.is_empty() {
        return Ok(());
    }
    let device = cuda(cache.layer(0).0.device())?;
    let op = CopySlots {
        pairs: device.cuda_stream().clone_htod(&copies.pairs).w()?,
        geometry: copies.geometry(),
        scalars: Scalars::of(plan),
    };
    copies::in_every_layer(cache, &op)
}

/// `copy_slots` on one layer's K (or V) pool tensor.
struct CopySlots {
    pairs: CudaSlice<u32>,
    geometry: super::Geometry,
    scalars: Scalars,
}

impl InplaceOp1 for CopySlots {
    fn name(&self) -> &'static str {
        "paged-copy-slots"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        bail!("paged-copy-slots runs on a GPU only")
    }

    fn cuda_fwd(&self, cache: &mut CudaStorage, layout: &Layout) -> Result<()> {
        if layout.start_offset() != 0 {
            bail!("paged-copy-slots: a pool that does not start its storage");
        }
        let dtype = cache.dtype();
        let func = function(&cache.device, "copy_slots", Some(dtype))?;
        match dtype {
            DType::F32 => self.copy::<f32>(&func, cache),
            DType::BF16 => self.copy::<half::bf16>(&func, cache),
            DType::F16 => self.copy::<half::f16>(&func, cache),
            other => bail!("cuda attention: no kernels for {other:?}"),
        }
    }
}

impl CopySlots {
    fn copy<T: CudaDType + DeviceRepr>(
        &self,
        func: &CudaFunction,
        cache: &mut CudaStorage,
    ) -> Result<()> {
        let stream = cache.device.cuda_stream();
        let cache = cache.as_cuda_slice_mut::<T>()?;
        let mut launch = stream.launch_builder(func);
        params::CopySlots {
            cache,
            pairs: &self.pairs,
            scalars: &self.scalars,
        }
        .push_to(&mut launch);
        // SAFETY: the arguments are `copy_slots`'s list in kernels/paged_attention.cu; every
        // slot of a copy lies in the pool (the scheduler's blocks), and no destination is
        // another copy's source.
        unsafe { launch.launch(config(self.geometry)) }.w()?;
        Ok(())
    }
}

/// Writes the batch's K (or V) rows into their slots of one layer's pool tensor.
struct WriteSlots<'a>(&'a CudaIndex);

impl InplaceOp2 for WriteSlots<'_> {
    fn name(&self) -> &'static str {
        "paged-write-slots"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
        bail!("paged-write-slots runs on a GPU only")
    }

    fn cuda_fwd(
        &self,
        cache: &mut CudaStorage,
        cache_layout: &Layout,
        src: &CudaStorage,
        src_layout: &Layout,
    ) -> Result<()> {
        let dtype = cache.dtype();
        if src.dtype() != dtype || cache_layout.start_offset() != 0 {
            bail!("paged-write-slots: the pool and the new rows differ in dtype or layout");
        }
        let func = function(&cache.device, "write_slots", Some(dtype))?;
        match dtype {
            DType::F32 => write::<f32>(&func, cache, src, src_layout, self.0),
            DType::BF16 => write::<half::bf16>(&func, cache, src, src_layout, self.0),
            DType::F16 => write::<half::f16>(&func, cache, src, src_layout, self.0),
            other => bail!("cuda attention: no kernels for {other:?}"),
        }
    }
}

fn write<T: CudaDType + DeviceRepr>(
    func: &CudaFunction,
    cache: &mut CudaStorage,
    src: &CudaStorage,
    src_layout: &Layout,
    index: &CudaIndex,
) -> Result<()> {
    let Some((start, end)) = src_layout.contiguous_offsets() else {
        bail!("paged-write-slots: the new rows are not contiguous");
    };
    let plan = &index.plan;
    let (rows, row) = (plan.rows, plan.heads.num_kv_heads * plan.heads.head_dim);
    if end - start != rows * row {
        bail!(
            "paged-write-slots: {} elements for {rows} rows of {row}",
            end - start
        );
    }
    let src = src.as_cuda_slice::<T>()?.slice(start..end);
    let stream = cache.device.cuda_stream();
    let cache = cache.as_cuda_slice_mut::<T>()?;
    let cfg = config(plan.write_geometry());
    let scalars = Scalars::of(plan);
    let mut launch = stream.launch_builder(func);
    params::WriteSlots {
        src: &src,
        cache,
        slots: &index.slots,
        scalars: &scalars,
    }
    .push_to(&mut launch);
    // SAFETY: the arguments are `write_slots`'s list in kernels/paged_attention.cu; `src`
    // holds `rows` rows of `row` elements and every slot of the plan lies inside the pool.
    unsafe { launch.launch(cfg) }.w()?;
    Ok(())
}

/// Attention of the batch's queries over the pool, merged over the context's splits.
struct Attend<'a> {
    index: &'a CudaIndex,
    tables: &'a CudaSlice<u32>,
    variant: AttentionKernel,
}

impl CustomOp3 for Attend<'_> {
    fn name(&self) -> &'static str {
        "paged-attention"
    }

    gpu_only_cpu_fwd!("paged-attention");

    fn cuda_fwd(
        &self,
        q: &CudaStorage,
        q_layout: &Layout,
        k: &CudaStorage,
        k_layout: &Layout,
        v: &CudaStorage,
        v_layout: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        let dtype = q.dtype();
        if k.dtype() != dtype || v.dtype() != dtype {
            bail!("paged-attention: queries and pool differ in dtype");
        }
        if q_layout.contiguous_offsets().is_none()
            || k_layout.start_offset() != 0
            || v_layout.start_offset() != 0
        {
            bail!("paged-attention: queries or pool not contiguous");
        }
        let out = match dtype {
            DType::F32 => attend::<f32>(q, q_layout, k, v, self)?,
            DType::BF16 => attend::<half::bf16>(q, q_layout, k, v, self)?,
            DType::F16 => attend::<half::f16>(q, q_layout, k, v, self)?,
            other => bail!("cuda attention: no kernels for {other:?}"),
        };
        Ok((out, q_layout.shape().clone()))
    }
}

fn attend<T: CudaDType + DeviceRepr>(
    q: &CudaStorage,
    q_layout: &Layout,
    k: &CudaStorage,
    v: &CudaStorage,
    op: &Attend<'_>,
) -> Result<CudaStorage> {
    let (index, plan) = (op.index, &op.index.plan);
    let device = &q.device;
    let dtype = q.dtype();
    let (start, end) = q_layout.contiguous_offsets().expect("checked contiguous");
    if op.variant.is_mma() && !start.is_multiple_of(2) {
        // Its queries are read two elements at a time, in 4-byte words.
        bail!(
            "paged-attention: {} needs queries that start at an even element, not {start}",
            op.variant
        );
    }
    let q = q.as_cuda_slice::<T>()?.slice(start..end);
    let (k, v) = (k.as_cuda_slice::<T>()?, v.as_cuda_slice::<T>()?);
    let heads = plan.heads;
    let pair_rows = plan.rows * heads.num_heads;
    // SAFETY: every element is written before it is read: by the attention block of its
    // tile where the plan has one split, by the merge otherwise.
    let mut out = unsafe { device.alloc::<T>(pair_rows * heads.head_dim) }?;
    let parts = &mut *index.partials.borrow_mut();
    let scalars = Scalars::of(plan);
    let stream = device.cuda_stream();

    let func = attention_function(device, (dtype, plan.heads.head_dim), op.variant)?;
    let cfg = config(plan.attention_geometry(op.variant));
    let mut launch = stream.launch_builder(&func);
    params::Attention {
        q: &q,
        k,
        v,
        tiles: &index.tiles,
        tables: op.tables,
        scalars: &scalars,
        acc: &mut parts.acc,
        max: &mut parts.max,
        sum: &mut parts.sum,
        out: &mut out,
    }
    .push_to(&mut launch);
    // SAFETY: the arguments are `paged_attention`'s list in kernels/paged_attention.cu; the
    // plan sized the partial buffers (written only where it has several splits) and the
    // shared memory (at most 48 KiB, checked by `Heads::check`), and its tiles and block
    // tables address only the pool's slots.
    unsafe { launch.launch(cfg) }.w()?;
    if plan.splits == 1 {
        return Ok(T::wrap_cuda_slice(out, device.clone()));
    }

    let func = function(device, "paged_reduce", Some(dtype))?;
    let cfg = config(plan.reduce_geometry());
    let mut launch = stream.launch_builder(&func);
    params::Reduce {
        acc: &parts.acc,
        max: &parts.max,
        sum: &parts.sum,
        scalars: &scalars,
        out: &mut out,
    }
    .push_to(&mut launch);
    // SAFETY: the arguments are `paged_reduce`'s list; the partials were written above.
    unsafe { launch.launch(cfg) }.w()?;
    Ok(T::wrap_cuda_slice(out, device.clone()))
}
