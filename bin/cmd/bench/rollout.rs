//! `dppo bench rollout`: a fixed rollout workload (P prompts x G samples x T new tokens,
//! temperature 1) through the paged engine and through the naive baseline in the same
//! process, plus this machine's measured f32 matmul rate as the compute limit. Every clock
//! read is preceded by a device synchronisation ([`timed`]), so GPU timings are of the work.

use std::time::{Duration, Instant};

use anyhow::Context;
use candle_core::{DType, Device};
use dppo_engine::cuda_attn::Heads;
use dppo_engine::naive::generate_naive;
use dppo_engine::{
    AttentionKernel, AttentionMode, Engine, EngineConfig, EngineStats, FusedKernels,
    GenerateRequest, IterationCost, SamplingParams, SamplingPlace,
};
use dppo_model::device::timed;
use dppo_model::{ChatMessage, DeviceSpec, ModelConfig, Policy};
use serde_json::json;

use super::bandwidth::memory_bandwidth;
use super::matmul_rate;

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
    /// KV cache capacity in token slots (default: the engine's, 2 GiB of KV). A pool that
    /// holds the whole workload runs it without preemption, as a static cache holds its batch.
    #[arg(long)]
    kv_cache_tokens: Option<usize>,
    /// Where tokens are drawn, as `engine.sampling`: auto (the device kernel on a GPU),
    /// host, or device (one GPU kernel for every row; on the CPU its host reference).
    #[arg(long, default_value = "auto", value_parser = parse_sampling)]
    sampling: SamplingPlace,
    /// candle-nn's fused kernels in the engine, as `engine.fused_kernels`: auto (on a GPU),
    /// true or false; the flag alone means true.
    #[arg(long, default_value = "auto", num_args = 0..=1, default_missing_value = "true",
          value_parser = parse_fused)]
    fused_kernels: FusedKernels,
    /// The q/k/v projection's bias and rotation by one kernel, as `engine.rope_kernel`: true
    /// (the default; the paged CUDA kernels' path only) or false; the flag alone means true.
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    rope_kernel: bool,
    /// With the rope kernel, k and v written into their KV slots by it, as
    /// `engine.rope_writes_kv`: false (the default: passed on an H200, slower in its one timed row) or true; the
    /// flag alone means true.
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    rope_writes_kv: bool,
    /// With the rope kernel, models with q/k norms (Qwen3) take it too, as
    /// `engine.rope_qk_norm`: true (the default) or false; the flag alone means true.
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    rope_qk_norm: bool,
    /// With sampling on a GPU, each score's exact Gumbel noise only where it could win, as
    /// `engine.lazy_noise` (the same draws): true (the default) or false, every score's exact
    /// noise; the flag alone means true. Host sampling ignores it.
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    lazy_noise: bool,
    /// With sampling on a GPU, each untruncated draw's row split over several blocks, as
    /// `engine.split_draws` (the same draws): false (the default, until a GPU has checked it)
    /// or true; the flag alone means true. Host sampling ignores it.
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    split_draws: bool,
    /// The residual add with its RMSNorm and the gated MLP's product by kernels of dppo's
    /// own, as `engine.layer_kernels`: true (the default; the paged CUDA kernels' path only)
    /// or false; the flag alone means true.
    #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    layer_kernels: bool,
    /// Decode steps padded to a bucket and replayed from captured CUDA graphs, as
    /// `engine.cuda_graphs`: false (the default, until a GPU has checked it) or true; the
    /// flag alone means true. The paged CUDA kernels' path only; not with `--time-device`,
    /// whose synchronisations a graph cannot hold.
    #[arg(long, default_value_t = false, num_args = 0..=1, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    cuda_graphs: bool,
    /// An experiment with the paged CUDA kernels (ignored elsewhere): the attention kernel's
    /// variant. `s<K>_v<V>` keeps K 16-byte K loads and V loads of V in flight a thread,
    /// `_split` splits the value pass over key groups, `mma` runs scores and values on tensor
    /// cores (bf16 and f16), and `mma_staged` does so on operands staged through shared
    /// memory; docs/gpu.md has each. Without it, the engine's default: `mma_staged` where it
    /// serves the model (bf16 or f16, head_dim 64 or 128, sm_80 on), `s1_v8` elsewhere.
    #[arg(long)]
    attention_kernel: Option<AttentionKernel>,
    /// The attention backend, as `engine.attention`: auto, cpu, generic or cuda.
    #[arg(long, default_value = "auto", value_parser = parse_attention)]
    attention: AttentionMode,
    /// Synchronise the device around each layer's attention and after the forward pass, as
    /// `EngineConfig::time_device`: the JSON then splits the step (the attention, and within
    /// it the wait for its kernels; the rest of the forward pass; sampling) and gives the
    /// kernels' approximate KV read rate. The synchronisations slow the step, so its
    /// tokens/s is not the plain run's.
    #[arg(long)]
    time_device: bool,
    /// An experiment on a GPU (ignored on the CPU): turn cudarc's per-allocation event
    /// tracking off once the engine is built, so that the decode step shows what the events
    /// cost the host. Safe only because nothing but the engine's one stream uses the GPU
    /// during the timed runs; `dppo run` co-locates a learner and cannot do this.
    #[arg(long)]
    no_event_tracking: bool,
    /// Stop the timed run after this many seconds and report the tokens generated by then
    /// (the rest is cancelled): a full-size workload on a slow path, inside a time box.
    #[arg(long)]
    time_limit: Option<f64>,
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

/// Runs the rollout benchmark and prints its report.
pub(super) fn run(args: RolloutArgs) -> anyhow::Result<()> {
    let device = args.device.open()?;
    let policy = Policy::load(&args.model, &device)
        .with_context(|| format!("loading --model {}", args.model))?;
    let prompt_ids = prompts(&policy, args.prompts)?;
    let prompt_tokens_mean =
        prompt_ids.iter().map(Vec::len).sum::<usize>() as f64 / prompt_ids.len().max(1) as f64;
    let reqs: Vec<GenerateRequest> = prompt_ids
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
        kv_cache_tokens: args.kv_cache_tokens,
        sampling: args.sampling,
        lazy_noise: args.lazy_noise,
        split_draws: args.split_draws,
        fused_kernels: args.fused_kernels,
        rope_kernel: args.rope_kernel,
        rope_writes_kv: args.rope_writes_kv,
        rope_qk_norm: args.rope_qk_norm,
        layer_kernels: args.layer_kernels,
        attention_kernel: args.attention_kernel,
        cuda_graphs: args.cuda_graphs,
        attention: args.attention,
        time_device: args.time_device,
        max_num_seqs: (args.prompts * args.samples).max(1),
        ..EngineConfig::default()
    };
    let engine = Engine::new(&policy, cfg, device.clone())?;
    let untracked = match args.no_event_tracking {
        true => Untracked::begin(&device)?,
        false => None,
    };
    for _ in 0..args.warmup_runs {
        engine.generate(reqs.clone())?;
    }
    let before = engine.stats();
    let (num_tokens, ours) = match args.time_limit {
        None => timed(&device, || {
            engine.generate(reqs.clone()).map(|_| num_tokens)
        })?,
        Some(limit) => time_boxed(&engine, &reqs, num_tokens, Duration::from_secs_f64(limit))?,
    };
    drop(untracked);
    let ours_s = ours.as_secs_f64();
    let stats = engine.stats();
    let iterations = stats.num_iterations - before.num_iterations;
    let cost = stats.cost.since(&before.cost);
    let decode_steps = stats.num_decode_iterations - before.num_decode_iterations;
    let decode_cost = stats.decode_cost.since(&before.decode_cost);
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
    let dtype = cfg
        .dtype
        .unwrap_or_else(|| dppo_engine::engine::default_dtype(&device));
    let attention_resolved = args
        .attention
        .resolve(&device, dtype, &Heads::of(&policy.config))?;
    let floor = match decode_steps {
        0 => None,
        steps => Some(memory_floor(
            &policy.config,
            dtype,
            &stats,
            steps,
            &decode_cost,
            (memory_bandwidth(&device)?, device.is_cuda()),
        )),
    };
    let limit_tokens_per_s = flops_per_s / (2.0 * policy.config.num_parameters() as f64);
    let tokens_per_s = num_tokens as f64 / ours_s;
    let report = json!({
        "model": args.model,
        "cpu_kernel": dppo_model::cpu_kernel()?.name(),
        "prompts": args.prompts,
        "samples": args.samples,
        "new_tokens": args.new_tokens,
        "prompt_tokens_mean": prompt_tokens_mean,
        "temperature": 1.0,
        "top_p": 1.0,
        "warmup_runs": args.warmup_runs,
        "tokens_per_s": tokens_per_s,
        "requests_per_s": (args.prompts * args.samples) as f64 / ours_s,
        "peak_kv_mib": peak_kv_mib,
        "kv_cache_tokens": args.kv_cache_tokens,
        // The timed run's, not the warm-up's.
        "preemptions": stats.num_preemptions - before.num_preemptions,
        "naive_tokens_per_s": naive_s.map(|s| num_tokens as f64 / s),
        "speedup_vs_naive": naive_s.map(|s| s / ours_s),
        "matmul_gflops": flops_per_s / 1e9,
        "compute_limit_tokens_per_s": limit_tokens_per_s,
        "fraction_of_compute_limit": tokens_per_s / limit_tokens_per_s,
        "sampling": args.sampling,
        "time_limit_s": args.time_limit,
        "generated_tokens": num_tokens,
        "complete": num_tokens == args.prompts * args.samples * args.new_tokens,
        "fused_kernels": args.fused_kernels.on(&device),
        "rope_kernel": args.rope_kernel,
        "rope_writes_kv": args.rope_writes_kv,
        "rope_qk_norm": args.rope_qk_norm,
        "lazy_noise": args.lazy_noise && args.sampling.on_device(&device),
        "split_draws": args.split_draws && args.sampling.on_device(&device),
        "layer_kernels": args.layer_kernels,
        "cuda_graphs": args.cuda_graphs,
        // The variant the kernels ran, else the one asked for (the kernels did not run).
        "attention_kernel": stats.attention_kernel.or(args.attention_kernel).map(|k| k.to_string()),
        "attention": args.attention,
        "attention_resolved": attention_resolved,
        "sampling_on_device": args.sampling.on_device(&device),
        "time_device": args.time_device,
        "event_tracking": !(args.no_event_tracking && device.is_cuda()),
        "iteration": iteration_cost(iterations, &cost),
        "decode_step": iteration_cost(decode_steps, &decode_cost),
        "memory_floor": floor,
    });
    if args.json {
        println!("{report}");
    } else {
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

/// Runs `reqs` until they finish or `limit` passes; returns the tokens generated and the
/// time taken. The engine counts tokens before it streams them, so its counter is what the
/// device has produced; what is left is cancelled by dropping the handles.
fn time_boxed(
    engine: &Engine,
    reqs: &[GenerateRequest],
    total: usize,
    limit: Duration,
) -> anyhow::Result<(usize, Duration)> {
    let before = engine.stats().num_generated_tokens;
    let start = Instant::now();
    let handles = engine.submit_all(reqs.to_vec())?;
    let generated = loop {
        let generated = engine.stats().num_generated_tokens - before;
        if generated >= total || start.elapsed() >= limit {
            break generated;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    let took = start.elapsed();
    drop(handles);
    Ok((generated, took))
}

fn parse_attention(s: &str) -> Result<AttentionMode, String> {
    serde_json::from_value(serde_json::Value::String(s.into()))
        .map_err(|_| format!("{s:?}: expected auto, cpu, generic or cuda"))
}

fn parse_sampling(s: &str) -> Result<SamplingPlace, String> {
    serde_json::from_value(serde_json::Value::String(s.into()))
        .map_err(|_| format!("{s:?}: expected auto, host or device"))
}

fn parse_fused(s: &str) -> Result<FusedKernels, String> {
    let value = match s {
        "true" => serde_json::Value::Bool(true),
        "false" => serde_json::Value::Bool(false),
        _ => serde_json::Value::String(s.into()),
    };
    serde_json::from_value(value).map_err(|_| format!("{s:?}: expected auto, true or false"))
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
        "attention_ms": per(cost.attention_ns) * 1e-6,
        "attention_wait_ms": per(cost.attention_wait_ns) * 1e-6,
        "attention_host_ms": per(cost.attention_host_ns) * 1e-6,
        "layer_host_ms": per(cost.layer_host_ns) * 1e-6,
        "h2d_kib": per(cost.h2d_bytes) / 1024.0,
        "d2h_kib": per(cost.d2h_bytes) / 1024.0,
        "attention_ops": per(cost.attention_ops),
        "layer_ops": per(cost.layer_ops),
        "syncs": per(cost.syncs),
        "padded_steps": per(cost.padded_steps),
        "graph_replays": per(cost.graph_replays),
        "seqs": per(cost.seqs),
        "kv_tokens": per(cost.kv_tokens),
    })
}

/// The mean decode step (scheduling to appending its tokens; streaming them is not counted)
/// against its memory floor: the weights it reads (all but an untied embedding table, of
/// which it gathers a few rows) and the KV its sequences attend, each read once at the
/// measured `bandwidth` (bytes/s), in the engine's `dtype`; `on_gpu` where the attention's
/// wait is the device's (`--time-device`).
fn memory_floor(
    config: &ModelConfig,
    dtype: DType,
    stats: &EngineStats,
    steps: usize,
    cost: &IterationCost,
    (bandwidth, on_gpu): (f64, bool),
) -> serde_json::Value {
    const MIB: f64 = (1 << 20) as f64;
    let steps = steps as f64;
    let table = match config.tie_word_embeddings {
        true => 0,
        false => config.vocab_size * config.hidden_size,
    };
    let weight_bytes = ((config.num_parameters() - table) * dtype.size_in_bytes()) as f64;
    let kv_token_bytes = (stats.block_bytes / stats.block_size) as f64;
    let kv_bytes = cost.kv_tokens as f64 / steps * kv_token_bytes;
    let floor_s = (weight_bytes + kv_bytes) / bandwidth;
    let host_ns =
        cost.schedule_ns + cost.forward_ns + cost.fetch_ns + cost.sample_ns + cost.emit_ns;
    let step_s = host_ns as f64 * 1e-9 / steps;
    // With `--time-device`: the KV attended over the wait for the attention's kernels after
    // the host issued them, about the kernels' read rate (the wait holds a synchronisation's
    // latency too, so the rate is if anything low).
    // On the CPU the attention computes inside the call and the wait is nothing: no rate.
    let wait_s = cost.attention_wait_ns as f64 * 1e-9 / steps;
    let kv_read = (on_gpu && wait_s > 0.0).then(|| kv_bytes / wait_s / 1e9);
    json!({
        "bandwidth_gb_per_s": bandwidth / 1e9,
        "batch": cost.seqs as f64 / steps,
        "weight_mib": weight_bytes / MIB,
        "kv_mib": kv_bytes / MIB,
        "floor_ms": floor_s * 1e3,
        "step_ms": step_s * 1e3,
        "times_floor": step_s / floor_s,
        "attention_kv_gb_per_s": kv_read,
    })
}

/// cudarc's event tracking off on a GPU's context while it lives (`--no-event-tracking`),
/// every stream of the context synchronised before and after; nothing on the CPU.
struct Untracked {
    #[cfg(feature = "cuda")]
    stream: std::sync::Arc<candle_core::cuda::cudarc::driver::CudaStream>,
}

impl Untracked {
    fn begin(device: &Device) -> anyhow::Result<Option<Self>> {
        #[cfg(feature = "cuda")]
        if let Device::Cuda(cuda) = device {
            let stream = cuda.cuda_stream();
            // The engine's weights are copied in on a publication stream.
            stream.context().synchronize()?;
            // Safety: the engine's stream is the only one in use until `drop` synchronises
            // the context and turns the tracking back on.
            unsafe { stream.context().disable_event_tracking() };
            return Ok(Some(Self { stream }));
        }
        let _ = device;
        Ok(None)
    }
}

impl Drop for Untracked {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        {
            let context = self.stream.context();
            if let Err(e) = context.synchronize() {
                tracing::error!("synchronising after the untracked runs: {e}");
            }
            // Safety: slices allocated meanwhile stay untracked and are used only by the
            // engine's stream, in order (a time-boxed run's cancelled iterations may still
            // be finishing there).
            unsafe { context.enable_event_tracking() };
        }
    }
}
