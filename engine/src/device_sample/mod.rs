//! Sampling on the GPU (`engine.sampling = "device"`, or `auto` on a GPU): the iteration's
//! logits stay on the device (read as the model computed them, f32 or bf16) and one kernel launch (kernels/sample.cu, compiled once per
//! process by NVRTC) draws every sample by the Gumbel-max trick, top-k and top-p applied as
//! a threshold and top logprobs found on the device; 12 bytes per draw come back (plus 160
//! per draw when some draw asks for top logprobs) instead of a vocabulary-sized row.
//! [`crate::gumbel`] is the kernel's reference.

use candle_core::{Device, Result, Tensor};
use serde::{Deserialize, Serialize};

use crate::diff::abs_diff;
use crate::gumbel::{self, DrawKey, DrawParams, Drawn};

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

/// Threads per block: the kernel's `THREADS`.
const THREADS: u32 = 256;

/// Words a split draw's part leaves for the merge: the kernel's `PART_WORDS`.
#[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
const PART_WORDS: usize = 6;

#[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
mod args;
mod gpu;

#[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
pub(crate) use args::{push_args, DrawInputs, DrawOutputs};
use gpu::on_gpu;

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
