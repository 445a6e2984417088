//! The sampling kernels launched on a GPU: the draws' inputs up, one launch, the tokens back.

#[cfg(feature = "cuda")]
use std::sync::Arc;

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use candle_core::{Result, Tensor};

#[cfg(feature = "cuda")]
use super::{parts, push_args, DrawInputs, DrawOutputs, PART_WORDS, SOURCE, THREADS};
use super::{DeviceDraw, SampleKernel};
use crate::gumbel::Drawn;
#[cfg(feature = "cuda")]
use crate::sampler::MAX_TOP_LOGPROBS;

/// [`super::sample`] by the kernel.
#[cfg(feature = "cuda")]
pub(super) fn on_gpu(
    logits: &Tensor,
    draws: &[DeviceDraw],
    kernel: SampleKernel,
) -> Result<Vec<Drawn>> {
    use candle_core::{bail, DType, Storage};

    let candle_core::Device::Cuda(device) = logits.device() else {
        bail!("device sampling: the logits are on neither the CPU nor a GPU");
    };
    if logits.rank() != 2 {
        bail!("device sampling: expected (rows, vocab) logits");
    }
    // The kernel reads f32 and bf16 as they are; another dtype is cast to f32 first.
    let logits = match logits.dtype() {
        DType::F32 | DType::BF16 => logits.contiguous()?,
        _ => logits.to_dtype(DType::F32)?,
    };
    let vocab = logits.dim(1)? as u32;
    let (storage, layout) = logits.storage_and_layout();
    let (Storage::Cuda(storage), Some((start, end))) = (&*storage, layout.contiguous_offsets())
    else {
        bail!("device sampling: the logits are not contiguous on a GPU");
    };
    match logits.dtype() {
        DType::BF16 => {
            let slice = storage.as_cuda_slice::<half::bf16>()?.slice(start..end);
            launch(device, "bf16", &slice, vocab, draws, kernel)
        }
        _ => {
            let slice = storage.as_cuda_slice::<f32>()?.slice(start..end);
            launch(device, "f32", &slice, vocab, draws, kernel)
        }
    }
}

/// `kernel`, for logits of `dtype` ("f32" or "bf16"), over `logits` (rows of `vocab`) for
/// `draws`: uploads their inputs, launches a block a draw (or a draw's parts) and brings the
/// results back.
#[cfg(feature = "cuda")]
fn launch<T: DeviceRepr>(
    device: &candle_core::CudaDevice,
    dtype: &str,
    logits: &candle_core::cuda_backend::cudarc::driver::CudaView<'_, T>,
    vocab: u32,
    draws: &[DeviceDraw],
    kernel: SampleKernel,
) -> Result<Vec<Drawn>> {
    use candle_core::cuda_backend::cudarc::driver::LaunchConfig;

    let name = if kernel.split {
        format!("gumbel_sample_split_{dtype}")
    } else {
        format!("gumbel_sample_{dtype}")
    };
    let func = MODULE.function(device, &name)?;
    let stream = device.cuda_stream();
    let w = candle_core::Error::wrap;
    let inputs = DrawInputs::of(draws);
    let on_device = DrawInputs {
        rows: upload(&stream, &inputs.rows)?,
        keys: upload(&stream, &inputs.keys)?,
        counters: upload(&stream, &inputs.counters)?,
        inv_temps: upload(&stream, &inputs.inv_temps)?,
        top_ks: upload(&stream, &inputs.top_ks)?,
        top_ps: upload(&stream, &inputs.top_ps)?,
        min_ps: upload(&stream, &inputs.min_ps)?,
        n_tops: upload(&stream, &inputs.n_tops)?,
    };
    let n = draws.len();
    let mut out = DrawOutputs {
        tokens: stream.alloc_zeros::<u32>(n).map_err(w)?,
        logprobs: stream.alloc_zeros::<f32>(n).map_err(w)?,
        model_logprobs: stream.alloc_zeros::<f32>(n).map_err(w)?,
        top: (
            stream.alloc_zeros::<u32>(n * MAX_TOP_LOGPROBS).map_err(w)?,
            stream.alloc_zeros::<f32>(n * MAX_TOP_LOGPROBS).map_err(w)?,
        ),
    };
    let parts = if kernel.split {
        let on_each = func
            .occupancy_max_active_blocks_per_multiprocessor(THREADS, 0, None)
            .map_err(w)?;
        let resident = crate::cuda_attn::multiprocessors(device)? * on_each as usize;
        parts(n, vocab as usize, resident)
    } else {
        1
    };
    let cfg = LaunchConfig {
        grid_dim: (n as u32, parts, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // The split kernel's scratch: PART_WORDS words a part, and a count a draw, zero.
    let mut scratch = if kernel.split {
        let partials = nan_words(&stream, n * parts as usize * PART_WORDS)?;
        Some((partials, stream.alloc_zeros::<u32>(n).map_err(w)?))
    } else {
        None
    };
    let mut launch = stream.launch_builder(&func);
    let lazy = kernel.noise.kernel_arg();
    let args = (&vocab, &lazy);
    push_args(
        &mut launch,
        logits,
        args,
        &on_device,
        &mut out,
        scratch.as_mut(),
    );
    // SAFETY: the arguments are the kernel's list in kernels/sample*.cu; every buffer holds
    // `n` draws (rows: `rows * vocab` elements; top logprobs MAX_TOP_LOGPROBS slots each, the
    // kernel's MAX_TOP; the split kernel's PART_WORDS words for each of a draw's `parts`
    // parts, the grid's y, and its counts zeroed), and each draw's outputs are written by one
    // block of its own.
    unsafe { launch.launch(cfg) }.map_err(w)?;
    let out = DrawOutputs {
        tokens: download(&stream, &out.tokens)?,
        logprobs: download(&stream, &out.logprobs)?,
        model_logprobs: download(&stream, &out.model_logprobs)?,
        // The top logprobs come back only when some draw asked for them.
        top: if inputs.n_tops.iter().any(|&k| k > 0) {
            (
                download(&stream, &out.top.0)?,
                download(&stream, &out.top.1)?,
            )
        } else {
            (Vec::new(), Vec::new())
        },
    };
    Ok(out.drawn(&inputs.n_tops))
}

/// `len` words of 0xFF bytes (NaN as floats) on `stream`: a part the merge read before its
/// block wrote it would show as a NaN logprob, where zeros would pass for a plausible part.
#[cfg(feature = "cuda")]
fn nan_words(stream: &Arc<CudaStream>, len: usize) -> Result<CudaSlice<u32>> {
    use candle_core::cuda_backend::cudarc::driver::{result, DevicePtrMut};
    let w = candle_core::Error::wrap;
    stream.context().bind_to_thread().map_err(w)?;
    // SAFETY: every bit pattern is a u32, and the memset below fills the words before any
    // read, in the stream's order.
    let mut words = unsafe { stream.alloc::<u32>(len) }.map_err(w)?;
    {
        // The guard records the memset on the words' event where the context tracks them.
        let (ptr, _record) = words.device_ptr_mut(stream);
        // SAFETY: `ptr` holds `len` words allocated on `stream`, not freed.
        unsafe { result::memset_d8_async(ptr, 0xFF, len * 4, stream.cu_stream()) }.map_err(w)?;
    }
    Ok(words)
}

/// `host` copied to the device on `stream`.
#[cfg(feature = "cuda")]
fn upload<T: DeviceRepr>(stream: &Arc<CudaStream>, host: &[T]) -> Result<CudaSlice<T>> {
    stream.clone_htod(host).map_err(candle_core::Error::wrap)
}

/// `device` copied back to the host on `stream`.
#[cfg(feature = "cuda")]
fn download<T: DeviceRepr>(stream: &Arc<CudaStream>, device: &CudaSlice<T>) -> Result<Vec<T>> {
    stream.clone_dtoh(device).map_err(candle_core::Error::wrap)
}

/// kernels/sample.cu and sample_split.cu as the GPU loads them.
#[cfg(feature = "cuda")]
static MODULE: crate::nvrtc::Module =
    crate::nvrtc::Module::new("dppo_sample", "kernels/sample.cu", SOURCE);

/// Without CUDA the only device is the CPU, which [`super::sample`] serves itself.
#[cfg(not(feature = "cuda"))]
pub(super) fn on_gpu(
    logits: &Tensor,
    _draws: &[DeviceDraw],
    _kernel: SampleKernel,
) -> Result<Vec<Drawn>> {
    candle_core::bail!(
        "device sampling: no kernel for {:?} in this build",
        logits.device()
    )
}
