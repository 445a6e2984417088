//! `dppo bench train`: the learner's throughput, one packed forward/backward and AdamW step
//! on a synthetic batch, against this machine's measured matmul rate.

use anyhow::Context;
use dppo_model::device::timed;
use dppo_model::packed::parts;
use dppo_model::{DeviceSpec, Grouping, Policy};
use dppo_trainer::config::DtypeChoice;
use dppo_trainer::train_batch::TrainBatch;
use serde_json::json;

use super::matmul_rate;

/// Sequences per first-fit-decreasing window of the packer.
const PACK_WINDOW: usize = 64;

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
    /// Completion tokens per sequence (the longest, with `--completion-spread`).
    #[arg(long, default_value_t = 64)]
    completion_len: usize,
    /// Completion lengths spread evenly down to (1 - SPREAD) x `--completion-len`, as an RL
    /// batch's are (0: all equal, what the PyTorch comparison runs).
    #[arg(long, default_value_t = 0.0, value_parser = parse_spread)]
    completion_spread: f64,
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

/// Runs the learner benchmark and prints its report.
pub(super) fn run(args: TrainArgs) -> anyhow::Result<()> {
    use dppo_trainer::learner::{Learner, LearnerConfig};
    use dppo_trainer::loss::{Normalisers, TrainSeq};

    let device = args.device.open()?;
    let policy = Policy::load(&args.model, &device)
        .with_context(|| format!("loading --model {}", args.model))?;
    let vocab = policy.config.vocab_size as u32;
    let completion_lens = completion_lens(&args);
    let seqs: Vec<TrainSeq> = completion_lens
        .iter()
        .enumerate()
        .map(|(i, &completion)| TrainSeq {
            tokens: (0..args.prompt_len + completion)
                .map(|t| ((i * 31 + t * 7) as u32) % vocab)
                .collect(),
            num_prompt_tokens: args.prompt_len,
            advantage: if i % 2 == 0 { 1.0 } else { -1.0 },
            weight: 1.0,
            rollout_logprobs: vec![-3.0; completion],
        })
        .collect();
    let completion_tokens: usize = completion_lens.iter().sum();
    let batch = TrainBatch {
        seqs,
        norm: Normalisers {
            num_seqs: args.seqs as f64,
            num_tokens: completion_tokens as f64,
            max_len: args.completion_len as f64,
        },
    };
    let compute_dtype = args.compute_dtype.unwrap_or_default().resolve(&device);
    let cfg = LearnerConfig {
        compute_dtype,
        ..LearnerConfig::token_mean(1e-6, 1.0, args.pack_tokens, PACK_WINDOW)
    };
    let mut learner = Learner::new(&policy.config, &policy.weights, cfg)?;
    // The learner trains its own copy: the loaded weights are not part of what is measured.
    let config = policy.config.clone();
    drop(policy);
    let warm_up = learner.step(&batch)?;
    let (density, took) = timed(&device, || {
        let mut density = 0.0;
        for _ in 0..args.steps {
            density = learner.step(&batch)?.pack_density;
        }
        Ok::<_, anyhow::Error>(density)
    })?;
    let seconds = took.as_secs_f64() / args.steps as f64;
    let tokens = args.seqs * args.prompt_len + completion_tokens;
    let tokens_per_s = tokens as f64 / seconds;
    let flops_per_s = matmul_rate(&config, &device)?;
    // The FLOPs the step needs: the lm-head only at completion positions.
    let needed = config.train_flops(tokens, completion_tokens);
    let limit = flops_per_s * tokens as f64 / needed;
    let report = json!({
        "model": args.model,
        "cpu_kernel": dppo_model::cpu_kernel()?.name(),
        "compute_dtype": compute_dtype.as_str(),
        "train_tokens_per_s": tokens_per_s,
        "step_s": seconds,
        "pack_density": density,
        "completion_spread": args.completion_spread,
        "buffers": warm_up.num_buffers,
        // What a buffer costs a GPU in ops: the autograd graph's tensors, and the attention
        // calls a layer makes (the grouping on a GPU, and one call per run of equal lengths).
        "graph_nodes_per_buffer": warm_up.graph_nodes as f64 / warm_up.num_buffers as f64,
        "attention_calls_per_buffer": {
            "segments": attention_calls(&batch, args.pack_tokens, Grouping::Segments)?,
            "runs": attention_calls(&batch, args.pack_tokens, Grouping::Runs)?,
        },
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

/// Each sequence's completion length: `--completion-len` less an even share of the spread.
fn completion_lens(args: &TrainArgs) -> Vec<usize> {
    let longest = args.completion_len as f64;
    (0..args.seqs)
        .map(|i| {
            let share = i as f64 / args.seqs as f64;
            ((longest * (1.0 - args.completion_spread * share)).round() as usize).max(1)
        })
        .collect()
}

/// The attention calls a layer makes per packed buffer of `batch`, grouped by `grouping`.
fn attention_calls(
    batch: &TrainBatch,
    pack_tokens: usize,
    grouping: Grouping,
) -> anyhow::Result<f64> {
    let lengths: Vec<usize> = batch.seqs.iter().map(|s| s.tokens.len()).collect();
    let buffers = dppo_trainer::pack::pack(&lengths, pack_tokens, PACK_WINDOW)?;
    let calls: usize = buffers
        .iter()
        .map(|b| parts(&b.iter().map(|&i| lengths[i]).collect::<Vec<_>>(), grouping).len())
        .sum();
    Ok(calls as f64 / buffers.len() as f64)
}

/// `--completion-spread`: a fraction in [0, 1).
fn parse_spread(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(f) if (0.0..1.0).contains(&f) => Ok(f),
        _ => Err(format!("{text:?}: expected a fraction in [0, 1)")),
    }
}

/// `--compute-dtype`: the two dtypes the learner computes in.
fn parse_compute_dtype(text: &str) -> Result<DtypeChoice, String> {
    match text {
        "f32" => Ok(DtypeChoice::F32),
        "bf16" => Ok(DtypeChoice::Bf16),
        other => Err(format!("{other:?}: expected f32 or bf16")),
    }
}
