//! A layer's K and V pools lent mutably together to a kernel that writes both (`qkv_rope`
//! with `engine.rope_writes_kv`). candle lends one tensor's storage at a time, to an in-place
//! op, so the V pool's op runs inside the K pool's.

use std::cell::RefCell;

#[cfg(feature = "cuda")]
use candle_core::CudaStorage;
use candle_core::{bail, CpuStorage, InplaceOp1, Layout, Result, Tensor};

/// A storage type the pools may live in: the CPU's (the emulated kernels) or a GPU's.
pub(crate) trait PoolStorage {
    /// Where this type lives, for errors.
    const PLACE: &'static str;

    /// `storage` as this type, where it is of it.
    fn of_cpu(_storage: &mut CpuStorage) -> Option<&mut Self> {
        None
    }

    /// `storage` as this type, where it is of it.
    #[cfg(feature = "cuda")]
    fn of_cuda(_storage: &mut CudaStorage) -> Option<&mut Self> {
        None
    }
}

impl PoolStorage for CpuStorage {
    const PLACE: &'static str = "the CPU";

    fn of_cpu(storage: &mut CpuStorage) -> Option<&mut Self> {
        Some(storage)
    }
}

#[cfg(feature = "cuda")]
impl PoolStorage for CudaStorage {
    const PLACE: &'static str = "a GPU";

    fn of_cuda(storage: &mut CudaStorage) -> Option<&mut Self> {
        Some(storage)
    }
}

/// `f` of the storages of `k` and `v` (K then V), two tensors each the whole of its own
/// storage (as the pools are; one storage lent twice would wait on its own lock), both on the
/// place `S` stands for.
pub(crate) fn with_pools<S, R, F>(k: &Tensor, v: &Tensor, f: F) -> Result<R>
where
    S: PoolStorage,
    F: FnOnce([&mut S; 2]) -> Result<R>,
{
    let shared = std::ptr::eq(&*k.storage_and_layout().0, &*v.storage_and_layout().0);
    if shared {
        bail!("with_pools: both pools in one storage");
    }
    let outer = Outer {
        v,
        f: RefCell::new(Some(f)),
        out: RefCell::new(None),
        storage: std::marker::PhantomData::<S>,
    };
    k.inplace_op1(&outer)?;
    match outer.out.into_inner() {
        Some(out) => Ok(out),
        None => bail!("with_pools: the V pool's op did not run"),
    }
}

/// `storage` as `S`, after checking that `layout` spans it whole.
fn lent<'a, S: PoolStorage>(storage: Option<&'a mut S>, layout: &Layout) -> Result<&'a mut S> {
    if !layout.is_contiguous() || layout.start_offset() != 0 {
        bail!("with_pools: a pool that is not the whole of its storage");
    }
    match storage {
        Some(storage) => Ok(storage),
        None => bail!("with_pools: a pool that is not on {}", S::PLACE),
    }
}

/// The K pool's op: lends its storage to the V pool's.
struct Outer<'t, S, F, R> {
    v: &'t Tensor,
    f: RefCell<Option<F>>,
    out: RefCell<Option<R>>,
    storage: std::marker::PhantomData<S>,
}

impl<S, F, R> Outer<'_, S, F, R>
where
    S: PoolStorage,
    F: FnOnce([&mut S; 2]) -> Result<R>,
{
    fn lend(&self, k: Option<&mut S>, layout: &Layout) -> Result<()> {
        let k = lent(k, layout)?;
        self.v.inplace_op1(&Inner {
            k: RefCell::new(Some(k)),
            outer: self,
        })
    }
}

impl<S, F, R> InplaceOp1 for Outer<'_, S, F, R>
where
    S: PoolStorage,
    F: FnOnce([&mut S; 2]) -> Result<R>,
{
    fn name(&self) -> &'static str {
        "pools-k"
    }

    fn cpu_fwd(&self, k: &mut CpuStorage, layout: &Layout) -> Result<()> {
        self.lend(S::of_cpu(k), layout)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, k: &mut CudaStorage, layout: &Layout) -> Result<()> {
        self.lend(S::of_cuda(k), layout)
    }
}

/// The V pool's op: runs `f` of both storages.
struct Inner<'a, 'o, 't, S, F, R> {
    k: RefCell<Option<&'a mut S>>,
    outer: &'o Outer<'t, S, F, R>,
}

impl<S, F, R> Inner<'_, '_, '_, S, F, R>
where
    S: PoolStorage,
    F: FnOnce([&mut S; 2]) -> Result<R>,
{
    fn run(&self, v: Option<&mut S>, layout: &Layout) -> Result<()> {
        let v = lent(v, layout)?;
        let (Some(k), Some(f)) = (self.k.take(), self.outer.f.take()) else {
            bail!("with_pools: the V pool's op ran twice");
        };
        *self.outer.out.borrow_mut() = Some(f([k, v])?);
        Ok(())
    }
}

impl<S, F, R> InplaceOp1 for Inner<'_, '_, '_, S, F, R>
where
    S: PoolStorage,
    F: FnOnce([&mut S; 2]) -> Result<R>,
{
    fn name(&self) -> &'static str {
        "pools-v"
    }

    fn cpu_fwd(&self, v: &mut CpuStorage, layout: &Layout) -> Result<()> {
        self.run(S::of_cpu(v), layout)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, v: &mut CudaStorage, layout: &Layout) -> Result<()> {
        self.run(S::of_cuda(v), layout)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use super::*;

    /// The closure writes both pools through the storages it is lent, and its result comes
    /// back.
    #[test]
    fn both_pools_are_written_through_one_call() {
        let k = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        let v = Tensor::zeros((2, 3), DType::F32, &Device::Cpu).unwrap();
        let got = with_pools(&k, &v, |[k, v]: [&mut CpuStorage; 2]| {
            let (CpuStorage::F32(k), CpuStorage::F32(v)) = (k, v) else {
                bail!("not f32");
            };
            k[1] = 1.0;
            v[5] = 2.0;
            Ok(7)
        })
        .unwrap();
        assert_eq!(got, 7);
        let host = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert_eq!(host(&k), [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]);
        assert_eq!(host(&v), [0.0, 0.0, 0.0, 0.0, 0.0, 2.0]);
    }

    /// A view into a pool is refused, and so is one storage as both pools (the tensor itself,
    /// or a reshape of it).
    #[test]
    fn a_view_or_one_tensor_twice_is_refused() {
        let k = Tensor::zeros((4, 3), DType::F32, &Device::Cpu).unwrap();
        let v = Tensor::zeros((4, 3), DType::F32, &Device::Cpu).unwrap();
        let nothing = |_: [&mut CpuStorage; 2]| Ok(());
        let err = with_pools(&k.narrow(0, 1, 2).unwrap(), &v, nothing)
            .unwrap_err()
            .to_string();
        assert!(err.contains("not the whole of its storage"), "{err}");
        let err = with_pools(&k, &v.narrow(0, 1, 2).unwrap(), nothing)
            .unwrap_err()
            .to_string();
        assert!(err.contains("not the whole of its storage"), "{err}");
        for same in [k.clone(), k.reshape(12).unwrap()] {
            let err = with_pools(&k, &same, nothing).unwrap_err().to_string();
            assert!(err.contains("both pools in one storage"), "{err}");
        }
    }
}
