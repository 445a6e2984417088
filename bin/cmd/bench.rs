//! `dppo bench rollout`: a fixed rollout workload (P prompts x G samples x T new tokens,
//! temperature 1) through the paged engine and through the naive baseline in the same
//! process, plus this machine's measured f32 matmul rate as the compute limit. Every clock
//! read is preceded by a device synchronisation ([`timed`]), so GPU timings are of the work.

use anyhow::Context;
use candle_core::{Device, Tensor};
use dppo_engine::naive::generate_naive;
use dppo_engine::{
    Engine, EngineConfig, GenerateRequest, IterationCost, SamplingParams, SamplingPlace,
};
use dppo_model::device::timed;
use dppo_model::{ChatMessage, DeviceSpec, ModelConfig, Policy};
use dppo_trainer::config::DtypeChoice;
use serde_json::json;

/// Benchmarks.
#[derive(Debug, clap::Subcommand)]
pub enum Bench {
    /// Rollout throughput: paged engine vs. the naive baseline.
    Rollout(RolloutArgs),
    /// Learner throughput: one packed forward/backward + AdamW step on a synthetic batch.
    Train(TrainArgs),
    /// Load and soak test of `dppo serve`: concurrent clients, errors, latency, leaks.
    Serve(super::bench_serve::Args),
}

/// Arguments of `dppo bench train`.
#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    /// Any model spec: `builtin:tiny`, `random:SHAPE[@seed=N]` (a random-weight model of a
    /// real shape), an HF directory, a `.gguf` file...
    #[arg(long, default_value = "builtin:tiny")]
    model: String,
    /// Where the learner runs: cpu, cuda or cuda:N (cuda needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: DeviceSpec,
    /// Sequences in the batch.
    #[arg(long, default_value_t = 32)]
    seqs: usize,
    /// Prompt tokens per sequence.
    #[arg(long, default_value_t = 64)]
    prompt_len: usize,
    /// Completion tokens per sequence.
    #[arg(long, default_value_t = 64)]
    completion_len: usize,
    /// Tokens per packed buffer.
    #[arg(long, default_value_t = 1024)]
    pack_tokens: usize,
    /// Optimizer steps to time (after one warm-up step).
    #[arg(long, default_value_t = 2)]
    steps: usize,
    /// Dtype of the forward and backward passes: f32 or bf16 (default: f32 on the CPU, bf16
    /// on a GPU, as `train.compute_dtype = "auto"`).
    #[arg(long, value_parser = parse_compute_dtype)]
    compute_dtype: Option<DtypeChoice>,
    #[arg(long)]
    json: bool,
}

/// Arguments of `dppo bench rollout`.
#[derive(Debug, clap::Args)]
pub struct RolloutArgs {
    /// Any model spec: `builtin:tiny`, `random:SHAPE[@seed=N]` (a random-weight model of a
    /// real shape), an HF directory, a `.gguf` file...
    #[arg(long, default_value = "builtin:tiny")]
    model: String,
    /// Where the engine runs: cpu, cuda or cuda:N (cuda needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: DeviceSpec,
    /// Prompts (P).
    #[arg(long, default_value_t = 16)]
    prompts: usize,
    /// Samples per prompt (G).
    #[arg(long, default_value_t = 8)]
    samples: usize,
    /// New tokens per sample (T); EOS is ignored so every sample has exactly T.
    #[arg(long, default_value_t = 128)]
    new_tokens: usize,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// Where tokens are drawn: host, or device (one GPU kernel for every row; on the CPU
    /// its host reference), as `engine.sampling`.
    #[arg(long, default_value = "host", value_parser = parse_sampling)]
    sampling: SamplingPlace,
    /// candle-nn's fused kernels in the engine, as `engine.fused_kernels`.
    #[arg(long)]
    fused_kernels: bool,
    /// Untimed runs of the whole workload first, as a training run's later steps find the
    /// engine: KV pages and buffers already faulted in, caches warm.
    #[arg(long, default_value_t = 1)]
    warmup_runs: usize,
    /// Skip the naive baseline.
    #[arg(long)]
    skip_naive: bool,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
}

/// Runs a benchmark.
pub fn run(bench: Bench) -> anyhow::Result<()> {
    match bench {
        Bench::Rollout(args) => rollout(args),
        Bench::Train(args) => train(args),
        Bench::Serve(args) => super::bench_serve::run(args),
    }
}

/// Fixed prompts: chat-formatted arithmetic word problems of varied length.
fn prompts(policy: &Policy, num: usize) -> anyhow::Result<Vec<Vec<u32>>> {
    (0..num)
        .map(|i| {
            let (a, b) = (17 + 13 * i, 5 + 7 * i);
            let question = format!(
                "Tom has {a} apples and buys {b} more.{} How many apples does he have now? Think step by step.",
                " He counts them twice.".repeat(i % 4)
            );
            let text = match policy.tokenizer.chat_template() {
                Some(_) => policy
                    .tokenizer
                    .apply_chat_template(&[ChatMessage::new("user", question)], true)?,
                None => question,
            };
            Ok(policy.tokenizer.encode(&text, false)?)
        })
        .collect()
}

fn rollout(args: RolloutArgs) -> anyhow::Result<()> {
    let device = args.device.open()?;
    let policy = Policy::load(&args.model, &device)
        .with_context(|| format!("loading --model {}", args.model))?;
    let reqs: Vec<GenerateRequest> = prompts(&policy, args.prompts)?
        .into_iter()
        .enumerate()
        .map(|(i, ids)| GenerateRequest {
            sampling: SamplingParams {
                temperature: 1.0,
                seed: Some(i as u64),
                ..SamplingParams::default()
            },
            ignore_eos: true,
            ..GenerateRequest::new(ids, args.samples, args.new_tokens)
        })
        .collect();
    let num_tokens = args.prompts * args.samples * args.new_tokens;
    let cfg = EngineConfig {
        block_size: args.block_size,
        sampling: args.sampling,
        fused_kernels: args.fused_kernels,
        max_num_seqs: (args.prompts * args.samples).max(1),
        ..EngineConfig::default()
    };
    let engine = Engine::new(&policy, cfg, device.clone())?;
    for _ in 0..args.warmup_runs {
        engine.generate(reqs.clone())?;
    }
    let before = engine.stats();
    let ((), ours) = timed(&device, || engine.generate(reqs.clone()).map(drop))?;
    let ours_s = ours.as_secs_f64();
    let stats = engine.stats();
    let iterations = stats.num_iterations - before.num_iterations;
    let cost = stats.cost.since(&before.cost);
    // In the engine's dtype (bf16 on a GPU).
    let peak_kv_mib = (stats.peak_blocks_used * stats.block_bytes) as f64 / (1 << 20) as f64;
    let naive_s = if args.skip_naive {
        None
    } else {
        let model = policy.model()?;
        let (_, naive) = timed(&device, || {
            generate_naive(&model, &reqs, policy.eos_token_ids(), &device)
        })?;
        Some(naive.as_secs_f64())
    };
    let flops_per_s = matmul_rate(&policy.config, &device)?;
    let limit_tokens_per_s = flops_per_s / (2.0 * policy.config.num_parameters() as f64);
    let tokens_per_s = num_tokens as f64 / ours_s;
    let report = json!({
        "model": args.model,
        "cpu_kernel": dppo_model::cpu_kernel()?.name(),
        "prompts": args.prompts,
        "samples": args.samples,
        "new_tokens": args.new_tokens,
        "warmup_runs": args.warmup_runs,
        "tokens_per_s": tokens_per_s,
        "requests_per_s": (args.prompts * args.samples) as f64 / ours_s,
        "peak_kv_mib": peak_kv_mib,
        "preemptions": stats.num_preemptions,
        "naive_tokens_per_s": naive_s.map(|s| num_tokens as f64 / s),
        "speedup_vs_naive": naive_s.map(|s| s / ours_s),
        "matmul_gflops": flops_per_s / 1e9,
        "compute_limit_tokens_per_s": limit_tokens_per_s,
        "fraction_of_compute_limit": tokens_per_s / limit_tokens_per_s,
        "sampling": args.sampling,
        "fused_kernels": args.fused_kernels,
        "iteration": iteration_cost(iterations, &cost),
    });
    if args.json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

fn parse_sampling(s: &str) -> Result<SamplingPlace, String> {
    match s {
        "host" => Ok(SamplingPlace::Host),
        "device" => Ok(SamplingPlace::Device),
        _ => Err(format!("{s:?}: expected host or device")),
    }
}

/// The timed run's mean iteration, broken down (milliseconds; KiB moved by the engine).
fn iteration_cost(iterations: usize, cost: &IterationCost) -> serde_json::Value {
    let per = |x: u64| x as f64 / iterations.max(1) as f64;
    json!({
        "count": iterations,
        "schedule_ms": per(cost.schedule_ns) * 1e-6,
        "forward_ms": per(cost.forward_ns) * 1e-6,
        "fetch_ms": per(cost.fetch_ns) * 1e-6,
        "sample_ms": per(cost.sample_ns) * 1e-6,
        "emit_ms": per(cost.emit_ns) * 1e-6,
        "h2d_kib": per(cost.h2d_bytes) / 1024.0,
        "d2h_kib": per(cost.d2h_bytes) / 1024.0,
    })
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

fn train(args: TrainArgs) -> anyhow::Result<()> {
    use dppo_trainer::learner::{Learner, LearnerConfig};
    use dppo_trainer::loss::{Normalisers, TrainSeq};
    use dppo_trainer::train_batch::TrainBatch;

    let device = args.device.open()?;
    let policy = Policy::load(&args.model, &device)
        .with_context(|| format!("loading --model {}", args.model))?;
    let vocab = policy.config.vocab_size as u32;
    let seqs: Vec<TrainSeq> = (0..args.seqs)
        .map(|i| TrainSeq {
            tokens: (0..args.prompt_len + args.completion_len)
                .map(|t| ((i * 31 + t * 7) as u32) % vocab)
                .collect(),
            num_prompt_tokens: args.prompt_len,
            advantage: if i % 2 == 0 { 1.0 } else { -1.0 },
            weight: 1.0,
            rollout_logprobs: vec![-3.0; args.completion_len],
        })
        .collect();
    let batch = TrainBatch {
        seqs,
        norm: Normalisers {
            num_seqs: args.seqs as f64,
            num_tokens: (args.seqs * args.completion_len) as f64,
            max_len: args.completion_len as f64,
        },
    };
    let compute_dtype = args.compute_dtype.unwrap_or_default().resolve(&device);
    let cfg = LearnerConfig {
        compute_dtype,
        ..LearnerConfig::token_mean(1e-6, 1.0, args.pack_tokens, 64)
    };
    let mut learner = Learner::new(&policy.config, &policy.weights, cfg)?;
    // The learner trains its own copy: the loaded weights are not part of what is measured.
    let config = policy.config.clone();
    drop(policy);
    learner.step(&batch)?; // warm-up
    let (density, took) = timed(&device, || {
        let mut density = 0.0;
        for _ in 0..args.steps {
            density = learner.step(&batch)?.pack_density;
        }
        Ok::<_, anyhow::Error>(density)
    })?;
    let seconds = took.as_secs_f64() / args.steps as f64;
    let tokens = args.seqs * (args.prompt_len + args.completion_len);
    let tokens_per_s = tokens as f64 / seconds;
    let flops_per_s = matmul_rate(&config, &device)?;
    // Forward + backward: about 6 FLOPs per parameter per token.
    let limit = flops_per_s / (6.0 * config.num_parameters() as f64);
    let report = json!({
        "model": args.model,
        "cpu_kernel": dppo_model::cpu_kernel()?.name(),
        "compute_dtype": compute_dtype.as_str(),
        "train_tokens_per_s": tokens_per_s,
        "step_s": seconds,
        "pack_density": density,
        "matmul_gflops": flops_per_s / 1e9,
        "compute_limit_tokens_per_s": limit,
        "fraction_of_compute_limit": tokens_per_s / limit,
    });
    if args.json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

/// `--compute-dtype`: the two dtypes the learner computes in.
fn parse_compute_dtype(text: &str) -> Result<DtypeChoice, String> {
    match text {
        "f32" => Ok(DtypeChoice::F32),
        "bf16" => Ok(DtypeChoice::Bf16),
        other => Err(format!("{other:?}: expected f32 or bf16")),
    }
}
