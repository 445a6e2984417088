//! Sampling on the GPU (`engine.sampling = "device"`, or `auto` on a GPU): the iteration's
//! logits stay on the device (read as the model computed them, f32 or bf16) and one kernel launch (kernels/sample.cu, compiled once per
//! process by NVRTC) draws every sample by the Gumbel-max trick, top-k and top-p applied as
//! a threshold and top logprobs found on the device; 12 bytes per draw come back (plus 160
//! per draw when some draw asks for top logprobs) instead of a vocabulary-sized row.
//! [`crate::gumbel`] is the kernel's reference.

#[cfg(feature = "cuda")]
use std::sync::Arc;

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DeviceRepr};
use candle_core::{Device, Result, Tensor};
use serde::{Deserialize, Serialize};

use crate::diff::abs_diff;
use crate::gumbel::{self, DrawKey, DrawParams, Drawn};
#[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
use crate::kernel_args::ArgList;
#[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
use crate::sampler::MAX_TOP_LOGPROBS;

/// The kernels' CUDA source, kernels/sample.cu then kernels/sample_split.cu, compiled by NVRTC
/// at run time (and in CI by `scripts/check-kernels`).
pub const SOURCE: &str = concat!(
    include_str!("../../kernels/sample.cu"),
    include_str!("../../kernels/sample_split.cu")
);

/// Where the engine samples (`engine.sampling`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SamplingPlace {
    /// The device kernel on a GPU of a CUDA build, the host elsewhere.
    #[default]
    Auto,
    /// On the host, from the logits rows copied there: every sampling option.
    Host,
    /// On a GPU, by one kernel: every sampling option. On the CPU the kernel's host
    /// reference draws instead (the same tokens; for tests).
    Device,
}

impl SamplingPlace {
    /// Whether the draws on `device` follow the device kernel's scheme (`Auto` resolved).
    pub fn on_device(self, device: &Device) -> bool {
        match self {
            Self::Auto => device.is_cuda() && cfg!(feature = "cuda"),
            Self::Host => false,
            Self::Device => true,
        }
    }
}

/// How the kernel computes each score's Gumbel noise (`engine.lazy_noise`). Both draw the
/// same tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Noise {
    /// Every score's noise, exactly (two logs each).
    #[default]
    Every,
    /// A score's exact noise only where one fast exp cannot show that it stays below the
    /// best score its warp has drawn: far fewer logs where many scores are close (an
    /// untrained model's). `engine.lazy_noise`'s default, passed by `dppo doctor` on an H200.
    Lazy,
}

impl Noise {
    /// `engine.lazy_noise`'s setting.
    pub fn lazy(on: bool) -> Self {
        if on {
            Self::Lazy
        } else {
            Self::Every
        }
    }

    /// The kernel's `lazy_noise` argument.
    #[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
    fn kernel_arg(self) -> u32 {
        (self == Self::Lazy) as u32
    }
}

/// How the kernel draws: its noise, and whether an untruncated draw's row is split over
/// several blocks (`engine.split_draws`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SampleKernel {
    pub noise: Noise,
    /// Each untruncated draw over [`parts`] blocks, merged by the last to finish, where the
    /// one-block kernel gives a decode batch of a few hundred draws one block each, too few
    /// for the GPU. The same tokens. Off by default until `dppo doctor` has passed it on a GPU.
    pub split: bool,
}

/// Rounds of its block's threads over groups of four logits that a split draw's part takes at
/// least, so that the merge stays a small share of a part's work.
const MIN_ROUNDS: usize = 8;
/// Waves of resident blocks a split launch aims at, so that the last, partial wave is a small
/// share of the launch.
const WAVES: usize = 4;

/// Blocks each untruncated draw of `draws` over `vocab` logits is split over, where the GPU
/// holds `resident` blocks at once (its multiprocessors times the kernel's blocks on each):
/// about [`WAVES`] waves in all, each part at least [`MIN_ROUNDS`] rounds.
pub fn parts(draws: usize, vocab: usize, resident: usize) -> u32 {
    let most = (vocab.div_ceil(4) / (MIN_ROUNDS * THREADS as usize)).max(1);
    // The grid's y holds at most 65,535 blocks.
    let most = most.min(65_535);
    (WAVES * resident).div_ceil(draws.max(1)).clamp(1, most) as u32
}

/// One draw: the logits row it reads, its noise and what it asks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DeviceDraw {
    pub row: u32,
    pub key: DrawKey,
    pub params: DrawParams,
}

/// Share of the checked draws that must pick the host reference's token and top logprobs:
/// only a near-tie of two noisy scores, where the kernel's and the host's `log` round
/// differently, may part them.
pub const MIN_AGREEMENT: f64 = 0.99;
/// Largest logprob difference where a draw agrees (the reductions' orders differ).
pub const LOGPROB_TOL: f32 = 1e-4;

/// The draws the kernel is checked on (by `dppo doctor` on a GPU, in its emulation on the
/// CPU by tests): 8 per row of `rows`; temperatures 1, 0.7 and greedy, each plain, with
/// top-k 50, with top-p 0.9 and with both and min-p 0.05; 5 top logprobs on some.
pub fn checked_draws(rows: usize) -> Vec<DeviceDraw> {
    let inv_temperatures = [1.0f32, 1.0 / 0.7, 0.0];
    let truncations = [
        (0, 1.0f32, 0.0f32),
        (50, 1.0, 0.0),
        (0, 0.9, 0.0),
        (50, 0.9, 0.05),
    ];
    let mut draws = Vec::new();
    for row in 0..rows {
        for sample in 0..8u32 {
            let (top_k, top_p, min_p) = truncations[(row / 3 + sample as usize) % 4];
            draws.push(DeviceDraw {
                row: row as u32,
                key: DrawKey {
                    key: 0x5eed_0000 + row as u64,
                    position: 17 + sample,
                    sample_index: sample,
                },
                params: DrawParams {
                    inv_temperature: inv_temperatures[(row + sample as usize) % 3],
                    top_k,
                    top_p,
                    min_p,
                    top_logprobs: if sample % 3 == 0 { 5 } else { 0 },
                },
            });
        }
    }
    draws
}

/// How draws agree with their host reference, [`gumbel::draw`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Agreement {
    /// Draws with the reference's token and top-logprob ids.
    pub agreed: usize,
    pub draws: usize,
    /// The largest logprob difference over the draws that agree (infinite where the two
    /// differ and either is NaN).
    pub worst: f32,
    /// The first draw that picked another token or other top-logprob ids.
    pub first_disagreement: Option<usize>,
}

impl Agreement {
    /// `got[i]` against the reference's draw `draws[i]` from `rows` (the logits).
    pub fn of(rows: &[Vec<f32>], draws: &[DeviceDraw], got: &[Drawn]) -> Self {
        let (mut agreed, mut worst, mut first_disagreement) = (0usize, 0f32, None);
        let diff = |a: f32, b: f32| abs_diff(a as f64, b as f64) as f32;
        for (i, (d, got)) in draws.iter().zip(got).enumerate() {
            let want = gumbel::draw(&rows[d.row as usize], &d.params, &d.key);
            let same_tops = want.top_logprobs.len() == got.top_logprobs.len()
                && want
                    .top_logprobs
                    .iter()
                    .zip(&got.top_logprobs)
                    .all(|(a, b)| a.0 == b.0);
            if want.token == got.token && same_tops {
                agreed += 1;
                worst = worst
                    .max(diff(want.logprob, got.logprob))
                    .max(diff(want.model_logprob, got.model_logprob));
                for (a, b) in want.top_logprobs.iter().zip(&got.top_logprobs) {
                    worst = worst.max(diff(a.1, b.1));
                }
            } else {
                first_disagreement = first_disagreement.or(Some(i));
            }
        }
        Self {
            agreed,
            draws: draws.len(),
            worst,
            first_disagreement,
        }
    }

    /// At least [`MIN_AGREEMENT`] agree, within [`LOGPROB_TOL`].
    pub fn passed(&self) -> bool {
        self.agreed as f64 >= MIN_AGREEMENT * self.draws as f64 && self.worst <= LOGPROB_TOL
    }
}

/// Draws `draws` from `logits` ((rows, vocab); on a GPU f32 or bf16 as they are, another
/// dtype cast to f32). On a GPU by the kernel `kernel` names; on the CPU by its reference,
/// [`crate::gumbel::draw`], so that the CPU tests run every other step of this path.
pub fn sample(logits: &Tensor, draws: &[DeviceDraw], kernel: SampleKernel) -> Result<Vec<Drawn>> {
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
    on_gpu(logits, draws, kernel)
}

/// [`sample`] by the kernel.
#[cfg(feature = "cuda")]
fn on_gpu(logits: &Tensor, draws: &[DeviceDraw], kernel: SampleKernel) -> Result<Vec<Drawn>> {
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

/// The kernel's per-draw inputs, a buffer each: host vectors, or their copies on the device
/// (`U` holds u32s, `F` f32s).
#[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
pub(crate) struct DrawInputs<U = Vec<u32>, F = Vec<f32>> {
    rows: U,
    /// Two words a draw, low first.
    keys: U,
    /// (position, sample index) a draw.
    counters: U,
    inv_temps: F,
    top_ks: U,
    top_ps: F,
    min_ps: F,
    n_tops: U,
}

#[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
impl DrawInputs {
    pub(crate) fn of(draws: &[DeviceDraw]) -> Self {
        Self {
            rows: draws.iter().map(|d| d.row).collect(),
            keys: draws.iter().flat_map(|d| d.key.key_words()).collect(),
            counters: draws
                .iter()
                .flat_map(|d| [d.key.position, d.key.sample_index])
                .collect(),
            inv_temps: draws.iter().map(|d| d.params.inv_temperature).collect(),
            top_ks: draws.iter().map(|d| d.params.top_k).collect(),
            top_ps: draws.iter().map(|d| d.params.top_p).collect(),
            min_ps: draws.iter().map(|d| d.params.min_p).collect(),
            n_tops: draws.iter().map(|d| d.params.top_logprobs).collect(),
        }
    }
}

/// The kernel's outputs: a token and two logprobs a draw, and `MAX_TOP_LOGPROBS` top ids and
/// logprobs a draw (on the host, empty when no draw asked for them).
#[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
pub(crate) struct DrawOutputs<U = Vec<u32>, F = Vec<f32>> {
    pub(crate) tokens: U,
    pub(crate) logprobs: F,
    pub(crate) model_logprobs: F,
    pub(crate) top: (U, F),
}

/// Pushes `gumbel_sample`'s arguments in the order of its signature in kernels/sample.cu:
/// logits, vocab, the inputs, `lazy_noise`, then the outputs ([`crate::kernel_args`]), and
/// for `gumbel_sample_split` (kernels/sample_split.cu) its scratch, the parts' words and the
/// draws' counts.
#[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
pub(crate) fn push_args<'s, A, L, U, F, OU, OF>(
    list: &mut A,
    logits: L,
    (vocab, lazy_noise): (&'s u32, &'s u32),
    inputs: &'s DrawInputs<U, F>,
    outputs: &'s mut DrawOutputs<OU, OF>,
    scratch: Option<&'s mut (OU, OU)>,
) where
    A: ArgList<L> + ArgList<&'s u32> + ArgList<&'s U> + ArgList<&'s F>,
    A: ArgList<&'s mut OU> + ArgList<&'s mut OF>,
{
    let i = inputs;
    ArgList::push(list, logits);
    ArgList::push(list, vocab);
    ArgList::push(list, &i.rows);
    ArgList::push(list, &i.keys);
    ArgList::push(list, &i.counters);
    ArgList::push(list, &i.inv_temps);
    ArgList::push(list, &i.top_ks);
    ArgList::push(list, &i.top_ps);
    ArgList::push(list, &i.min_ps);
    ArgList::push(list, &i.n_tops);
    ArgList::push(list, lazy_noise);
    let DrawOutputs {
        tokens,
        logprobs,
        model_logprobs,
        top: (top_ids, top_logprobs),
    } = outputs;
    ArgList::push(list, tokens);
    ArgList::push(list, logprobs);
    ArgList::push(list, model_logprobs);
    ArgList::push(list, top_ids);
    ArgList::push(list, top_logprobs);
    if let Some((partials, arrived)) = scratch {
        ArgList::push(list, partials);
        ArgList::push(list, arrived);
    }
}

#[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
impl DrawOutputs {
    /// The draws, `n_tops[i]` top logprobs for draw `i`.
    pub(crate) fn drawn(&self, n_tops: &[u32]) -> Vec<Drawn> {
        let (ids, lps) = &self.top;
        (0..self.tokens.len())
            .map(|i| Drawn {
                token: self.tokens[i],
                logprob: self.logprobs[i],
                model_logprob: self.model_logprobs[i],
                top_logprobs: (0..n_tops[i] as usize)
                    .map(|j| (ids[i * MAX_TOP_LOGPROBS + j], lps[i * MAX_TOP_LOGPROBS + j]))
                    .collect(),
            })
            .collect()
    }
}

/// Threads per block: the kernel's `THREADS`.
const THREADS: u32 = 256;

/// Words a split draw's part leaves for the merge: the kernel's `PART_WORDS`.
#[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
const PART_WORDS: usize = 6;

/// kernels/sample.cu and sample_split.cu as the GPU loads them.
#[cfg(feature = "cuda")]
static MODULE: crate::nvrtc::Module =
    crate::nvrtc::Module::new("dppo_sample", "kernels/sample.cu", SOURCE);

/// Without CUDA the only device is the CPU, which [`sample`] serves itself.
#[cfg(not(feature = "cuda"))]
fn on_gpu(logits: &Tensor, _draws: &[DeviceDraw], _kernel: SampleKernel) -> Result<Vec<Drawn>> {
    candle_core::bail!(
        "device sampling: no kernel for {:?} in this build",
        logits.device()
    )
}

#[cfg(all(test, target_os = "linux"))]
mod emulated;

#[cfg(test)]
mod tests {
    use super::*;

    /// `engine.lazy_noise` and `engine.split_draws` reach the worker with device sampling,
    /// and host sampling draws without the kernel.
    #[test]
    fn the_engine_draws_with_the_kernel_its_config_names() {
        let cfg = |sampling, lazy_noise, split_draws| crate::EngineConfig {
            sampling,
            lazy_noise,
            split_draws,
            ..Default::default()
        };
        let cpu = Device::Cpu;
        let device = SamplingPlace::Device;
        let kernel = |noise, split| Some(SampleKernel { noise, split });
        let lazy = cfg(device, true, false).device_sampling(&cpu);
        assert_eq!(lazy, kernel(Noise::Lazy, false));
        let exact = cfg(device, false, false).device_sampling(&cpu);
        assert_eq!(exact, kernel(Noise::Every, false));
        let split = cfg(device, true, true).device_sampling(&cpu);
        assert_eq!(split, kernel(Noise::Lazy, true));
        assert_eq!(
            cfg(SamplingPlace::Host, true, true).device_sampling(&cpu),
            None
        );
        assert_eq!(
            cfg(SamplingPlace::Auto, true, true).device_sampling(&cpu),
            None
        );
    }

    /// A split fills about four waves of the GPU's resident blocks, never below one part a
    /// draw, and never below eight rounds of the block's threads a part.
    #[test]
    fn a_draws_parts_fill_the_gpu_without_starving_a_block() {
        // An H200's 132 multiprocessors at 5 blocks each; Qwen's vocabulary: 18 parts at most.
        let resident = 132 * 5;
        assert_eq!(parts(256, 151_936, resident), 11);
        assert_eq!(parts(1_024, 151_936, resident), 3);
        assert_eq!(parts(4_096, 151_936, resident), 1);
        assert_eq!(parts(1, 151_936, resident), 18);
        assert_eq!(parts(0, 151_936, resident), 18);
        // A vocabulary shorter than a part's eight rounds is one part.
        assert_eq!(parts(1, 8 * 1024 - 1, resident), 1);
        assert_eq!(parts(1, 8 * 1024, resident), 1);
        assert_eq!(parts(1, 16 * 1024, resident), 2);
        for draws in [1, 7, 100, 256, 1000, 5000] {
            let p = parts(draws, 49_152, resident) as usize;
            let rounds = 49_152usize.div_ceil(4) / p / THREADS as usize;
            assert!(rounds >= 8 && p >= 1, "{draws} draws: {p} parts");
            assert!(
                draws * p >= (4 * resident).min(draws * 6),
                "{draws} draws: {p} parts"
            );
        }
    }

    #[test]
    fn a_nan_or_another_token_never_agrees() {
        let rows = vec![(0..64)
            .map(|i| (i * 37 % 64) as f32 / 9.0)
            .collect::<Vec<f32>>()];
        let draws = checked_draws(1);
        let want: Vec<Drawn> = draws
            .iter()
            .map(|d| gumbel::draw(&rows[0], &d.params, &d.key))
            .collect();
        let same = Agreement::of(&rows, &draws, &want);
        assert!(same.passed() && same.worst == 0.0, "{same:?}");
        assert_eq!(same.first_disagreement, None);

        let mut got = want.clone();
        got[3].logprob = f32::NAN;
        let nan = Agreement::of(&rows, &draws, &got);
        assert!(!nan.passed() && nan.worst == f32::INFINITY, "{nan:?}");

        let mut got = want.clone();
        got[1].token = (got[1].token + 1) % 64;
        got[5].token = (got[5].token + 1) % 64;
        let other = Agreement::of(&rows, &draws, &got);
        assert_eq!(
            (other.agreed, other.first_disagreement),
            (draws.len() - 2, Some(1))
        );
    }
}
