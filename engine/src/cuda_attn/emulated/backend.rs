//! The emulated kernels as the engine's attention backend on the CPU (its unit tests), as
//! `launch.rs`'s `CudaPagedAttention` is on a GPU: the K/V writes in place on the pool's
//! tensors, the attention and its merge as one op, with `rope_kernel` the projection's
//! bias and rotation as one op before them, and with `layer_kernels` the layer's add-and-norm
//! and gated product.

use std::any::Any;

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp3, DType, InplaceOp1, InplaceOp2, Layout, Result, Shape, Tensor,
};
use dppo_model::{AttentionBackend, LayerKernels, Projection, QkNorms, RopeAt};

use super::{attend, copy_slots, qkv_rope, write_slots, RopeExtras, Stored};
use crate::cuda_attn::copies::{self, SlotCopies};
use crate::cuda_attn::pools::with_pools;
use crate::cuda_attn::{rotated, AttentionKernel, Extras, KernelPlan};
use crate::generic_attn::TensorKvCache;

/// One iteration's backend (`tables`: the emulation's copy of the block tables).
pub(in crate::cuda_attn) struct Backend<'a> {
    pub(in crate::cuda_attn) cache: &'a mut TensorKvCache,
    pub(in crate::cuda_attn) plan: &'a KernelPlan,
    pub(in crate::cuda_attn) tables: &'a [u32],
    /// The rope and layer kernels.
    pub(in crate::cuda_attn) extras: Extras,
    /// The attention kernel's variant.
    pub(in crate::cuda_attn) variant: AttentionKernel,
}

impl AttentionBackend for Backend<'_> {
    fn attend(&mut self, layer_idx: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let (kc, vc) = self.cache.layer(layer_idx);
        kc.inplace_op2(&k.contiguous()?, &WriteSlots(self.plan))?;
        vc.inplace_op2(&v.contiguous()?, &WriteSlots(self.plan))?;
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
        let plan = self.plan;
        self.extras.rotations += 1;
        let into_pools = self.extras.rope_writes_kv;
        let (kc, vc) = self.cache.layer(layer_idx);
        let rotate = Rotate {
            plan,
            bias: projection.bias,
            norms: projection.norms,
            pools: into_pools.then_some([kc, vc]),
        };
        match rotated(&rotate, plan.heads, (projection.qkv, rope), into_pools)? {
            (q, Some((k, v))) => self.attend(layer_idx, &q, &k, &v),
            (q, None) => self.attend_pools(layer_idx, &q),
        }
    }

    fn layer_kernels(&self) -> Option<&dyn LayerKernels> {
        self.extras.layer_kernels()
    }
}

impl Backend<'_> {
    /// The attention of `q` over the layer's pools, its K and V already in them.
    fn attend_pools(&self, layer_idx: usize, q: &Tensor) -> Result<Tensor> {
        let (kc, vc) = self.cache.layer(layer_idx);
        let op = Attend {
            plan: self.plan,
            tables: self.tables,
            variant: self.variant,
        };
        q.contiguous()?.apply_op3_no_bwd(kc, vc, &op)
    }
}

/// `qkv_rope` of the projection (the op's first input) by the angles (the other two), its q
/// and k heads normed by `norms` and k and v into the layer's `pools` where given.
struct Rotate<'a> {
    plan: &'a KernelPlan,
    bias: Option<&'a Tensor>,
    norms: Option<QkNorms<'a>>,
    pools: Option<[&'a Tensor; 2]>,
}

impl Rotate<'_> {
    fn run<T: Stored>(
        &self,
        (qkv, l): (&CpuStorage, &Layout),
        (cos, cl): (&CpuStorage, &Layout),
        (sin, sl): (&CpuStorage, &Layout),
    ) -> Result<(CpuStorage, Shape)> {
        let bias = self.bias.map(Tensor::storage_and_layout);
        let norms = self
            .norms
            .map(|n| [n.q.storage_and_layout(), n.k.storage_and_layout()]);
        let norms = match &norms {
            Some([(q, ql), (k, kl)]) => {
                let eps = self.norms.map_or(0.0, |n| n.eps as f32);
                Some((
                    [cpu_values(q, ql, "q norm")?, cpu_values(k, kl, "k norm")?],
                    eps,
                ))
            }
            None => None,
        };
        let bias = match &bias {
            Some((storage, layout)) => Some(cpu_values(storage, layout, "bias")?),
            None => None,
        };
        let qkv = contiguous(T::cpu_storage_as_slice(qkv)?, l)?;
        let angles = (
            contiguous(T::cpu_storage_as_slice(cos)?, cl)?,
            contiguous(T::cpu_storage_as_slice(sin)?, sl)?,
        );
        let out = match self.pools {
            None => {
                let extras = RopeExtras {
                    bias,
                    norms,
                    pools: None,
                };
                qkv_rope(self.plan, qkv, angles, extras)?
            }
            Some([k, v]) => with_pools(k, v, |[k, v]: [&mut CpuStorage; 2]| {
                let pools = Some([values_mut::<T>(k)?, values_mut::<T>(v)?]);
                qkv_rope(self.plan, qkv, angles, RopeExtras { bias, norms, pools })
            })?,
        };
        let shape = Shape::from(out.len());
        Ok((T::to_cpu_storage_owned(out), shape))
    }
}

/// The values of `what`, a tensor's `storage` on the CPU, as `T`s (contiguous).
fn cpu_values<'s, T: Stored>(
    storage: &'s candle_core::Storage,
    layout: &Layout,
    what: &str,
) -> Result<&'s [T]> {
    match storage {
        candle_core::Storage::Cpu(s) => contiguous(T::cpu_storage_as_slice(s)?, layout),
        _ => bail!("emulated qkv_rope: a {what} off the CPU"),
    }
}

impl CustomOp3 for Rotate<'_> {
    fn name(&self) -> &'static str {
        "emulated-qkv-rope"
    }

    fn cpu_fwd(
        &self,
        qkv: &CpuStorage,
        l: &Layout,
        cos: &CpuStorage,
        cl: &Layout,
        sin: &CpuStorage,
        sl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let args = ((qkv, l), (cos, cl), (sin, sl));
        match qkv.dtype() {
            DType::F32 => self.run::<f32>(args.0, args.1, args.2),
            DType::BF16 => self.run::<half::bf16>(args.0, args.1, args.2),
            DType::F16 => self.run::<half::f16>(args.0, args.1, args.2),
            other => bail!("cuda attention: no kernels for {other:?}"),
        }
    }
}

/// A pool's values as `T`s, writable.
fn values_mut<T: Stored>(storage: &mut CpuStorage) -> Result<&mut [T]> {
    let dtype = storage.dtype();
    let values: Option<&mut Vec<T>> = match storage {
        CpuStorage::F32(v) => (v as &mut dyn Any).downcast_mut(),
        CpuStorage::BF16(v) => (v as &mut dyn Any).downcast_mut(),
        CpuStorage::F16(v) => (v as &mut dyn Any).downcast_mut(),
        _ => None,
    };
    match values {
        Some(values) => Ok(values),
        None => bail!(
            "emulated qkv_rope: a {dtype:?} pool for {} values",
            T::SUFFIX
        ),
    }
}

/// The values `layout` spans in `data`, which must be contiguous.
fn contiguous<'a, T>(data: &'a [T], layout: &Layout) -> Result<&'a [T]> {
    let Some((start, end)) = layout.contiguous_offsets() else {
        bail!("emulated kernels: a non-contiguous input");
    };
    Ok(&data[start..end])
}

/// Copy-on-write by the emulated `copy_slots`: `copies` in every layer's pool.
pub(in crate::cuda_attn) fn copy_blocks(
    cache: &TensorKvCache,
    copies: &SlotCopies,
    plan: &KernelPlan,
) -> Result<()> {
    if copies.is_empty() {
        return Ok(());
    }
    copies::in_every_layer(cache, &CopySlots { plan, copies })
}

struct CopySlots<'a> {
    plan: &'a KernelPlan,
    copies: &'a SlotCopies,
}

impl InplaceOp1 for CopySlots<'_> {
    fn name(&self) -> &'static str {
        "emulated-copy-slots"
    }

    fn cpu_fwd(&self, c: &mut CpuStorage, cl: &Layout) -> Result<()> {
        if cl.start_offset() != 0 {
            bail!("copy_slots: a pool that does not start its storage");
        }
        let (plan, copies) = (self.plan, self.copies);
        match c {
            CpuStorage::F32(c) => copy_slots(plan, copies, c),
            CpuStorage::BF16(c) => copy_slots(plan, copies, c),
            CpuStorage::F16(c) => copy_slots(plan, copies, c),
            c => bail!(
                "copy_slots: a {:?} pool (kernels exist for f32, bf16 and f16)",
                c.dtype()
            ),
        }
    }
}

struct WriteSlots<'a>(&'a KernelPlan);

impl InplaceOp2 for WriteSlots<'_> {
    fn name(&self) -> &'static str {
        "emulated-write-slots"
    }

    fn cpu_fwd(&self, c: &mut CpuStorage, cl: &Layout, s: &CpuStorage, sl: &Layout) -> Result<()> {
        if cl.start_offset() != 0 {
            bail!("write_slots: a pool that does not start its storage");
        }
        match (c, s) {
            (CpuStorage::F32(c), CpuStorage::F32(s)) => write_slots(self.0, contiguous(s, sl)?, c),
            (CpuStorage::BF16(c), CpuStorage::BF16(s)) => {
                write_slots(self.0, contiguous(s, sl)?, c)
            }
            (CpuStorage::F16(c), CpuStorage::F16(s)) => write_slots(self.0, contiguous(s, sl)?, c),
            (c, s) => bail!(
                "write_slots: a {:?} pool and {:?} rows (kernels exist for f32, bf16 and f16)",
                c.dtype(),
                s.dtype()
            ),
        }
    }
}

struct Attend<'a> {
    plan: &'a KernelPlan,
    tables: &'a [u32],
    variant: AttentionKernel,
}

impl Attend<'_> {
    fn run<T: Stored>(
        &self,
        (q, ql): (&CpuStorage, &Layout),
        k: &CpuStorage,
        v: &CpuStorage,
    ) -> Result<CpuStorage> {
        let q = contiguous(T::cpu_storage_as_slice(q)?, ql)?;
        let (k, v) = (T::cpu_storage_as_slice(k)?, T::cpu_storage_as_slice(v)?);
        let out = attend(self.plan, q, (k, v), self.tables, self.variant)?;
        Ok(T::to_cpu_storage_owned(out))
    }
}

impl CustomOp3 for Attend<'_> {
    fn name(&self) -> &'static str {
        "emulated-paged-attention"
    }

    fn cpu_fwd(
        &self,
        q: &CpuStorage,
        ql: &Layout,
        k: &CpuStorage,
        kl: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        if kl.start_offset() != 0 || vl.start_offset() != 0 {
            bail!("paged_attention: a pool that does not start its storage");
        }
        let out = match q.dtype() {
            DType::F32 => self.run::<f32>((q, ql), k, v)?,
            DType::BF16 => self.run::<half::bf16>((q, ql), k, v)?,
            DType::F16 => self.run::<half::f16>((q, ql), k, v)?,
            other => bail!("cuda attention: no kernels for {other:?}"),
        };
        Ok((out, ql.shape().clone()))
    }
}
