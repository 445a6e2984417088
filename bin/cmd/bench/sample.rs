//! `dppo bench sample`: device sampling alone, as the engine calls it each iteration (the
//! draws' inputs up, one kernel launch, the tokens back), on synthetic logits of several
//! spreads, with every score's exact Gumbel noise, with lazy noise, and with lazy noise and
//! each draw split over several blocks (docs/gpu.md). The targets' random-weight models give
//! close logits, a trained model spread ones, and lazy noise saves the most on the first.

use std::time::Instant;

use candle_core::{DType, Tensor};
use dppo_engine::device_sample::{self, DeviceDraw, Noise, SampleKernel};
use dppo_engine::gumbel::{DrawKey, DrawParams};
use dppo_model::DeviceSpec;
use serde_json::json;

/// The kernels timed, each against the first's tokens: every score's exact noise, lazy noise
/// (the default), and lazy noise with each draw's row split over several blocks
/// (`engine.split_draws`).
const KERNELS: [SampleKernel; 3] = [
    SampleKernel {
        noise: Noise::Every,
        split: false,
    },
    SampleKernel {
        noise: Noise::Lazy,
        split: false,
    },
    SampleKernel {
        noise: Noise::Lazy,
        split: true,
    },
];

/// Arguments of `dppo bench sample`.
#[derive(Debug, clap::Args)]
pub struct SampleArgs {
    /// The GPU: cuda or cuda:N (a build with `--features cuda`); cpu times the kernel's host
    /// reference instead, which says nothing of the kernel's speed.
    #[arg(long, default_value = "cuda")]
    device: DeviceSpec,
    /// Logits rows, one draw each (a decode batch).
    #[arg(long, default_value_t = 1024)]
    rows: usize,
    /// Logits a row (Qwen's vocabulary by default).
    #[arg(long, default_value_t = 151_936)]
    vocab: usize,
    /// The logits' standard deviations, comma-separated: close logits (an untrained
    /// model's) to spread ones (a trained model's).
    #[arg(long, default_value = "0.3,3,12", value_delimiter = ',')]
    std: Vec<f64>,
    /// Every draw's top-p (1: off). Truncated draws find their threshold by a search over
    /// the scores' order, 6 thresholds a pass over the row (up to 12 passes).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Every draw's top-k (0: off).
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// Timed calls of each setting (after three untimed ones).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Runs the benchmark and prints its report: a row for each spread and kernel.
pub(super) fn run(args: SampleArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.rows > 0 && args.vocab > 0 && args.iters > 0,
        "--rows, --vocab and --iters must be at least 1"
    );
    anyhow::ensure!(
        args.top_p > 0.0 && args.top_p <= 1.0,
        "--top-p must be in (0, 1], got {}",
        args.top_p
    );
    anyhow::ensure!(
        args.std.iter().all(|s| s.is_finite() && *s > 0.0),
        "--std: every standard deviation must be positive, got {:?}",
        args.std
    );
    let device = args.device.open()?;
    // The model's logits dtype on a GPU; the host reference reads f32.
    let dtype = if device.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    };
    // The targets' draws by default: temperature 1, nothing truncated, no top logprobs.
    let draws: Vec<DeviceDraw> = (0..args.rows as u32)
        .map(|row| DeviceDraw {
            row,
            key: DrawKey {
                key: 0x5eed_0000 + u64::from(row),
                position: 100,
                sample_index: 0,
            },
            params: DrawParams {
                inv_temperature: 1.0,
                top_k: args.top_k,
                top_p: args.top_p,
                min_p: 0.0,
                top_logprobs: 0,
            },
        })
        .collect();
    let bytes = (args.rows * args.vocab * dtype.size_in_bytes()) as f64;
    let mut results = Vec::new();
    for &std in &args.std {
        let logits =
            Tensor::randn(0f32, std as f32, (args.rows, args.vocab), &device)?.to_dtype(dtype)?;
        let mut exact_tokens = None;
        for kernel in KERNELS {
            for _ in 0..3 {
                device_sample::sample(&logits, &draws, kernel)?;
            }
            // Each call waits for its tokens, so the clock reads whole calls.
            let started = Instant::now();
            let mut drawn = Vec::new();
            for _ in 0..args.iters {
                drawn = device_sample::sample(&logits, &draws, kernel)?;
            }
            let us = started.elapsed().as_secs_f64() * 1e6 / args.iters as f64;
            let tokens: Vec<u32> = drawn.iter().map(|d| d.token).collect();
            let same = exact_tokens.get_or_insert_with(|| tokens.clone()) == &tokens;
            results.push(json!({
                "std": std,
                "noise": if kernel.noise == Noise::Lazy { "lazy" } else { "exact" },
                "split": kernel.split,
                "us_per_call": us,
                "logits_gb_per_s": bytes / us / 1e3,
                "same_tokens": same,
            }));
        }
    }
    let report = json!({
        "device": args.device.to_string(),
        "on_device": device.is_cuda(),
        "rows": args.rows,
        "vocab": args.vocab,
        "dtype": format!("{dtype:?}").to_lowercase(),
        "iters": args.iters,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "results": results,
    });
    if args.json {
        println!("{report}");
    } else {
        print_table(&args, dtype, &results);
    }
    // Every kernel must draw the exact noise's tokens: a difference is a failure, not a number.
    let differ: Vec<f64> = results
        .iter()
        .filter(|r| r["same_tokens"] != true)
        .filter_map(|r| r["std"].as_f64())
        .collect();
    anyhow::ensure!(
        differ.is_empty(),
        "lazy noise or split draws drew other tokens than the exact noise at std {differ:?}"
    );
    Ok(())
}

/// The report as a table, a row for each spread and kernel.
fn print_table(args: &SampleArgs, dtype: DType, results: &[serde_json::Value]) {
    println!(
        "{} draws of {} logits ({dtype:?}) a call, top-p {}, top-k {}, on {}",
        args.rows, args.vocab, args.top_p, args.top_k, args.device
    );
    for r in results {
        println!(
            "std {:>5}  {:<5} noise{:<7} {:>9.1} us a call  {:>7.0} GB/s of logits  same tokens: {}",
            r["std"].as_f64().unwrap_or(f64::NAN),
            r["noise"].as_str().unwrap_or(""),
            if r["split"] == true { ", split" } else { "" },
            r["us_per_call"].as_f64().unwrap_or(f64::NAN),
            r["logits_gb_per_s"].as_f64().unwrap_or(f64::NAN),
            r["same_tokens"]
        );
    }
}
