//! `dppo bench`: rollout and learner throughput on this machine, and the load test of
//! `dppo serve`; the compute limit both throughputs are read against.

use candle_core::{Device, Tensor};
use dppo_model::device::timed;
use dppo_model::ModelConfig;

mod attention;
mod bandwidth;
mod rollout;
mod sample;
mod train;

pub use attention::AttentionArgs;
pub use rollout::RolloutArgs;
pub use sample::SampleArgs;
pub use train::TrainArgs;

/// Benchmarks.
#[derive(Debug, clap::Subcommand)]
pub enum Bench {
    /// Rollout throughput: paged engine vs. the naive baseline.
    Rollout(RolloutArgs),
    /// Learner throughput: one packed forward/backward + AdamW step on a synthetic batch.
    Train(TrainArgs),
    /// The paged attention kernels alone on a GPU: each variant's time a call on a decode
    /// batch of a model shape's heads.
    Attention(AttentionArgs),
    /// Device sampling alone on a GPU: a call's time on synthetic logits, with the exact
    /// Gumbel noise and with lazy noise.
    Sample(SampleArgs),
    /// Load and soak test of `dppo serve`: concurrent clients, errors, latency, leaks.
    Serve(super::bench_serve::Args),
}

/// Runs a benchmark.
pub fn run(bench: Bench) -> anyhow::Result<()> {
    match bench {
        Bench::Rollout(args) => rollout::run(args),
        Bench::Train(args) => train::run(args),
        Bench::Attention(args) => attention::run(args),
        Bench::Sample(args) => sample::run(args),
        Bench::Serve(args) => super::bench_serve::run(args),
    }
}

/// Measured f32 matmul FLOP/s (best of five) at the shape of a decode batch through the
/// model's MLP.
fn matmul_rate(config: &ModelConfig, device: &Device) -> anyhow::Result<f64> {
    let (m, k, n) = (128, config.hidden_size, config.intermediate_size);
    let a = Tensor::randn(0f32, 1.0, (m, k), device)?;
    let b = Tensor::randn(0f32, 1.0, (n, k), device)?;
    timed(device, || a.matmul(&b.t()?))?; // warm-up
    let reps = (4e9 / (2.0 * (m * k * n) as f64)).clamp(3.0, 1000.0) as usize;
    // Best of five trials: the limit is what the machine can do, not an unlucky moment.
    let mut best = 0f64;
    for _ in 0..5 {
        let ((), took) = timed(device, || {
            for _ in 0..reps {
                a.matmul(&b.t()?)?;
            }
            Ok::<_, candle_core::Error>(())
        })?;
        best = best.max(2.0 * (m * k * n * reps) as f64 / took.as_secs_f64());
    }
    Ok(best)
}
