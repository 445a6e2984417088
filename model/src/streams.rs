//! Ordering device work across threads and streams. On a GPU each role (the learner, the
//! engine, weight publication) gets a device of its own stream ([`own_stream`]), so work
//! queued on one device runs in the order it was queued, whichever thread queued it.
//! A tensor made on one stream and read on another is ordered by cudarc's per-allocation
//! events (the reader's stream waits for the last write; a free waits for the last read);
//! [`wait_for`] orders what those events cannot see, and [`enter`] makes a thread able to
//! free device memory at all. On the CPU every function is the identity or a plain copy:
//! the same code paths run in the CPU tests.

use candle_core::{bail, CpuStorage, Device, InplaceOp1, Layout, Result, Tensor};

/// A device on `device`'s GPU with a stream of its own (the CPU for the CPU).
pub fn own_stream(device: &Device) -> Result<Device> {
    match device.location() {
        candle_core::DeviceLocation::Cuda { gpu_id } => Device::new_cuda_with_stream(gpu_id),
        _ => Ok(device.clone()),
    }
}

/// Makes `device`'s GPU context current on the calling thread. Every thread that may drop a
/// device tensor calls it first: cudarc frees memory without binding the context, and a
/// free on a thread with none fails (`CUDA_ERROR_INVALID_CONTEXT`, reported later, by an
/// unrelated call).
pub fn enter(device: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        cuda.cuda_stream()
            .context()
            .bind_to_thread()
            .map_err(candle_core::Error::wrap)?;
    }
    let _ = device;
    Ok(())
}

/// Makes `consumer`'s stream wait for everything queued so far on `producer`'s stream (an
/// event recorded on the producer, waited on by the consumer). Needed where a per-allocation
/// event does not suffice: a tensor read on two streams keeps only its latest reader's
/// event, so a writer on one stream would not wait for a read on the other.
pub fn wait_for(consumer: &Device, producer: &Device) -> Result<()> {
    #[cfg(feature = "cuda")]
    if let (Device::Cuda(c), Device::Cuda(p)) = (consumer, producer) {
        if !consumer.same_device(producer) {
            c.cuda_stream()
                .join(&p.cuda_stream())
                .map_err(candle_core::Error::wrap)?;
        }
    }
    let _ = (consumer, producer);
    Ok(())
}

/// Copies `src` into `dst` in place on `src`'s stream (same shape and dtype, both
/// contiguous). `dst` may belong to another device of the same GPU: this is how weights
/// cast on the publication stream land in the engine's buffers without queueing work on
/// the engine's stream.
pub fn copy_into(dst: &Tensor, src: &Tensor) -> Result<()> {
    if dst.shape() != src.shape() || dst.dtype() != src.dtype() {
        bail!(
            "copy_into: destination {:?} {:?}, source {:?} {:?}",
            dst.shape(),
            dst.dtype(),
            src.shape(),
            src.dtype()
        );
    }
    let src = src.contiguous()?;
    dst.inplace_op1(&CopyFrom(src))
}

/// The in-place op behind [`copy_into`]: its source.
struct CopyFrom(Tensor);

/// The destination's contiguous element range.
fn whole(layout: &Layout) -> Result<std::ops::Range<usize>> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(start..end),
        None => bail!("copy_into: the destination is not contiguous"),
    }
}

impl InplaceOp1 for CopyFrom {
    fn name(&self) -> &'static str {
        "copy-from"
    }

    fn cpu_fwd(&self, dst: &mut CpuStorage, layout: &Layout) -> Result<()> {
        let range = whole(layout)?;
        let (storage, src_layout) = self.0.storage_and_layout();
        let candle_core::Storage::Cpu(src) = &*storage else {
            bail!("copy_into: the source is not on the CPU");
        };
        let from = whole(src_layout)?;
        macro_rules! copy {
            ($($v:ident),*) => {
                match (dst, src) {
                    $((CpuStorage::$v(d), CpuStorage::$v(s)) => {
                        d[range].copy_from_slice(&s[from])
                    })*
                    _ => bail!("copy_into: unsupported dtype {:?}", self.0.dtype()),
                }
            };
        }
        copy!(U8, U32, I64, BF16, F16, F32, F64);
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, dst: &mut candle_core::CudaStorage, layout: &Layout) -> Result<()> {
        use candle_core::cuda_backend::cudarc::driver::CudaSlice;
        use candle_core::cuda_backend::CudaDType;

        fn copy<T: CudaDType>(
            dst: &mut candle_core::CudaStorage,
            range: std::ops::Range<usize>,
            src: &candle_core::CudaStorage,
            from: std::ops::Range<usize>,
        ) -> Result<()> {
            let stream = src.device.cuda_stream();
            let s: &CudaSlice<T> = src.as_cuda_slice::<T>()?;
            let d: &mut CudaSlice<T> = dst.as_cuda_slice_mut::<T>()?;
            let mut d = d.slice_mut(range);
            stream
                .memcpy_dtod(&s.slice(from), &mut d)
                .map_err(candle_core::Error::wrap)?;
            Ok(())
        }

        let range = whole(layout)?;
        let (storage, src_layout) = self.0.storage_and_layout();
        let candle_core::Storage::Cuda(src) = &*storage else {
            bail!("copy_into: the source is not on a GPU");
        };
        let from = whole(src_layout)?;
        match self.0.dtype() {
            candle_core::DType::F32 => copy::<f32>(dst, range, src, from),
            candle_core::DType::BF16 => copy::<half::bf16>(dst, range, src, from),
            candle_core::DType::F16 => copy::<half::f16>(dst, range, src, from),
            candle_core::DType::U32 => copy::<u32>(dst, range, src, from),
            dtype => bail!("copy_into: unsupported dtype {dtype:?} on a GPU"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    #[test]
    fn copy_into_writes_every_element_in_place_and_checks_shapes() {
        let dst = Tensor::full(f32::NAN, (3, 4), &Device::Cpu).unwrap();
        let id = dst.id();
        let src = Tensor::arange(0f32, 12.0, &Device::Cpu)
            .unwrap()
            .reshape((4, 3))
            .unwrap()
            .t()
            .unwrap();
        copy_into(&dst, &src).unwrap();
        assert_eq!(dst.id(), id);
        assert_eq!(dst.to_vec2::<f32>().unwrap(), src.to_vec2::<f32>().unwrap());
        let wrong = Tensor::zeros((4, 3), DType::F32, &Device::Cpu).unwrap();
        let err = copy_into(&dst, &wrong).unwrap_err().to_string();
        assert!(err.contains("[3, 4]") && err.contains("[4, 3]"), "{err}");
        let cast = Tensor::zeros((3, 4), DType::F64, &Device::Cpu).unwrap();
        assert!(copy_into(&dst, &cast).is_err());
    }

    #[test]
    fn on_the_cpu_roles_share_the_device_and_ordering_is_a_no_op() {
        let cpu = own_stream(&Device::Cpu).unwrap();
        assert!(cpu.same_device(&Device::Cpu));
        enter(&cpu).unwrap();
        wait_for(&cpu, &Device::Cpu).unwrap();
    }
}
