//! `dppo bench train`: the learner's throughput, one packed forward/backward and AdamW step
//! on a synthetic batch, against this machine's measured matmul rate.

use anyhow::Context;
use dppo_model::device::timed;
use dppo_model::{DeviceSpec, Policy};
use dppo_trainer::config::DtypeChoice;
use serde_json::json;

use super::matmul_rate;

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

/// Runs the learner benchmark and prints its report.
pub(super) fn run(args: TrainArgs) -> anyhow::Result<()> {
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
    // The FLOPs the step needs: the lm-head only at completion positions.
    let needed = config.train_flops(tokens, args.seqs * args.completion_len);
    let limit = flops_per_s * tokens as f64 / needed;
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
