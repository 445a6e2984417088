//! Sampling on the GPU (`engine.sampling = "device"`): the iteration's f32 logits stay on
//! the device and one kernel launch (kernels/sample.cu, compiled once per process by NVRTC)
//! draws every sample by the Gumbel-max trick, top-k and top-p applied as a threshold and
//! top logprobs found on the device; 12 bytes per draw come back (plus 160 per draw when
//! some draw asks for top logprobs) instead of a vocabulary-sized row. [`crate::gumbel`] is
//! the kernel's reference.

use candle_core::{Result, Tensor};
use serde::{Deserialize, Serialize};

use crate::gumbel::{self, DrawKey, DrawParams, Drawn};

/// The kernel's CUDA source, compiled by NVRTC at run time (and in CI by
/// `scripts/check-kernels`).
pub const SOURCE: &str = include_str!("../kernels/sample.cu");

/// Where the engine samples (`engine.sampling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SamplingPlace {
    /// On the host, from the logits rows copied there: every sampling option.
    #[default]
    Host,
    /// On a GPU, by one kernel: every sampling option. On the CPU the kernel's host
    /// reference draws instead (the same tokens; for tests).
    Device,
}

/// One draw: the logits row it reads, its noise and what it asks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceDraw {
    pub row: u32,
    pub key: DrawKey,
    pub params: DrawParams,
}

/// Draws `draws` from `logits` ((rows, vocab) f32). On a GPU by the kernel; on the CPU by
/// its reference, [`crate::gumbel::draw`], so that the CPU tests run every other step of
/// this path.
pub fn sample(logits: &Tensor, draws: &[DeviceDraw]) -> Result<Vec<Drawn>> {
    if draws.is_empty() {
        return Ok(Vec::new());
    }
    if logits.device().is_cpu() {
        let rows = logits.to_dtype(candle_core::DType::F32)?.to_vec2::<f32>()?;
        return Ok(draws
            .iter()
            .map(|d| gumbel::draw(&rows[d.row as usize], &d.params, &d.key))
            .collect());
    }
    on_gpu(logits, draws)
}

/// [`sample`] by the kernel.
#[cfg(feature = "cuda")]
fn on_gpu(logits: &Tensor, draws: &[DeviceDraw]) -> Result<Vec<Drawn>> {
    use crate::sampler::MAX_TOP_LOGPROBS;
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::{bail, DType, Storage};

    let candle_core::Device::Cuda(device) = logits.device() else {
        bail!("device sampling: the logits are on neither the CPU nor a GPU");
    };
    if logits.dtype() != DType::F32 || logits.rank() != 2 {
        bail!("device sampling: expected (rows, vocab) f32 logits");
    }
    let logits = logits.contiguous()?;
    let vocab = logits.dim(1)? as u32;
    let (storage, layout) = logits.storage_and_layout();
    let (Storage::Cuda(storage), Some((start, end))) = (&*storage, layout.contiguous_offsets())
    else {
        bail!("device sampling: the logits are not contiguous on a GPU");
    };
    let slice = storage.as_cuda_slice::<f32>()?.slice(start..end);
    let func = MODULE.function(device, "gumbel_sample")?;
    let stream = device.cuda_stream();
    let w = candle_core::Error::wrap;
    let rows: Vec<u32> = draws.iter().map(|d| d.row).collect();
    let keys: Vec<u32> = draws.iter().flat_map(|d| d.key.key_words()).collect();
    let counters: Vec<u32> = draws
        .iter()
        .flat_map(|d| [d.key.position, d.key.sample_index])
        .collect();
    let inv_temps: Vec<f32> = draws.iter().map(|d| d.params.inv_temperature).collect();
    let top_ks: Vec<u32> = draws.iter().map(|d| d.params.top_k).collect();
    let top_ps: Vec<f32> = draws.iter().map(|d| d.params.top_p).collect();
    let min_ps: Vec<f32> = draws.iter().map(|d| d.params.min_p).collect();
    let n_tops: Vec<u32> = draws.iter().map(|d| d.params.top_logprobs).collect();
    let rows = stream.clone_htod(&rows).map_err(w)?;
    let keys = stream.clone_htod(&keys).map_err(w)?;
    let counters = stream.clone_htod(&counters).map_err(w)?;
    let inv_temps = stream.clone_htod(&inv_temps).map_err(w)?;
    let top_ks = stream.clone_htod(&top_ks).map_err(w)?;
    let top_ps = stream.clone_htod(&top_ps).map_err(w)?;
    let min_ps = stream.clone_htod(&min_ps).map_err(w)?;
    let n_tops_d = stream.clone_htod(&n_tops).map_err(w)?;
    let n = draws.len();
    let mut tokens = stream.alloc_zeros::<u32>(n).map_err(w)?;
    let mut logprobs = stream.alloc_zeros::<f32>(n).map_err(w)?;
    let mut model = stream.alloc_zeros::<f32>(n).map_err(w)?;
    let mut top_ids = stream.alloc_zeros::<u32>(n * MAX_TOP_LOGPROBS).map_err(w)?;
    let mut top_logprobs = stream.alloc_zeros::<f32>(n * MAX_TOP_LOGPROBS).map_err(w)?;
    let cfg = LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut launch = stream.launch_builder(&func);
    launch
        .arg(&slice)
        .arg(&vocab)
        .arg(&rows)
        .arg(&keys)
        .arg(&counters)
        .arg(&inv_temps)
        .arg(&top_ks)
        .arg(&top_ps)
        .arg(&min_ps)
        .arg(&n_tops_d)
        .arg(&mut tokens)
        .arg(&mut logprobs)
        .arg(&mut model)
        .arg(&mut top_ids)
        .arg(&mut top_logprobs);
    // SAFETY: the arguments match the kernel's signature in kernels/sample.cu, every
    // buffer holds `n` draws (rows: `rows * vocab` floats; top logprobs MAX_TOP_LOGPROBS
    // slots each, the kernel's MAX_TOP), and each block writes only its own draw's outputs.
    unsafe { launch.launch(cfg) }.map_err(w)?;
    let tokens = stream.clone_dtoh(&tokens).map_err(w)?;
    let logprobs = stream.clone_dtoh(&logprobs).map_err(w)?;
    let model = stream.clone_dtoh(&model).map_err(w)?;
    // The top logprobs come back only when some draw asked for them.
    let (ids, lps) = if n_tops.iter().any(|&k| k > 0) {
        (
            stream.clone_dtoh(&top_ids).map_err(w)?,
            stream.clone_dtoh(&top_logprobs).map_err(w)?,
        )
    } else {
        (Vec::new(), Vec::new())
    };
    Ok((0..n)
        .map(|i| Drawn {
            token: tokens[i],
            logprob: logprobs[i],
            model_logprob: model[i],
            top_logprobs: (0..n_tops[i] as usize)
                .map(|j| (ids[i * MAX_TOP_LOGPROBS + j], lps[i * MAX_TOP_LOGPROBS + j]))
                .collect(),
        })
        .collect())
}

/// Threads per block: the kernel's `THREADS`.
#[cfg(feature = "cuda")]
const THREADS: u32 = 256;

/// kernels/sample.cu as the GPU loads it.
#[cfg(feature = "cuda")]
static MODULE: crate::nvrtc::Module =
    crate::nvrtc::Module::new("dppo_sample", "kernels/sample.cu", SOURCE);

/// Without CUDA the only device is the CPU, which [`sample`] serves itself.
#[cfg(not(feature = "cuda"))]
fn on_gpu(logits: &Tensor, _draws: &[DeviceDraw]) -> Result<Vec<Drawn>> {
    candle_core::bail!(
        "device sampling: no kernel for {:?} in this build",
        logits.device()
    )
}
