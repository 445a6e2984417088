//! `dppo memory`: how a run's model and configuration would divide a GPU's memory (weights,
//! learner state, activations, KV cache), or why they do not fit. Needs no GPU.

use std::path::{Path, PathBuf};

use anyhow::Context;
use candle_core::Device;
use dppo_engine::EngineConfig;
use dppo_model::ModelConfig;
use dppo_trainer::config::{DtypeChoice, RunConfig};
use dppo_trainer::memory_budget::{
    budget, format_size, parse_size, BudgetInputs, LearnerInputs, ModelShape, Precision,
};

/// Arguments of `dppo memory` (alias `dppo plan`).
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The model (default: the config's `model`); an HF directory and a `random:` shape are
    /// read without their weights.
    #[arg(long)]
    model: Option<String>,
    /// Hub revision when --model is a Hugging Face id; default main.
    #[arg(long)]
    revision: Option<String>,
    /// The GPU's memory: 80GiB, 24GB, 1e9 (bytes).
    #[arg(long, value_parser = parse_size)]
    gpu_memory: u64,
    /// Memory free on the GPU before the run starts (default: all of it).
    #[arg(long, value_parser = parse_size)]
    free_memory: Option<u64>,
    /// A TOML config; the built-in default (configs/default.toml) when absent.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override a config key, e.g. `--set pack.tokens=4096` (repeatable).
    #[arg(long = "set")]
    sets: Vec<String>,
    /// Budget an engine alone, as `dppo serve` runs it (no learner; utilization 0.9 unless
    /// --gpu-memory-utilization says otherwise).
    #[arg(long)]
    serve: bool,
    /// Overrides engine.gpu_memory_utilization.
    #[arg(long)]
    gpu_memory_utilization: Option<f64>,
    /// The engine's weights and KV cache dtype: f32, bf16 or f16 (default: the config's
    /// `engine.dtype`, `auto` being bf16 on a GPU).
    #[arg(long)]
    engine_dtype: Option<Precision>,
    /// The learner's forward/backward dtype: f32 or bf16 (default: the config's
    /// `train.compute_dtype`); master weights and AdamW stay f32.
    #[arg(long)]
    compute_dtype: Option<Precision>,
    /// Prompt tokens per sequence (default: pack.tokens - rollout.max_response_len, the
    /// longest prompt the configuration admits).
    #[arg(long)]
    prompt_len: Option<u64>,
}

/// Prints the budget, or fails saying what does not fit.
pub fn run(args: Args) -> anyhow::Result<()> {
    let cfg = RunConfig::load(args.config.as_deref(), &args.sets)?;
    let engine_dtype = args.engine_dtype.unwrap_or(on_gpu(cfg.engine.dtype));
    let compute_dtype = args
        .compute_dtype
        .unwrap_or(on_gpu(cfg.train.compute_dtype));
    anyhow::ensure!(
        compute_dtype != Precision::F16,
        "--compute-dtype: f32 or bf16 (the learner does not compute in f16)"
    );
    let model = args.model.as_deref().unwrap_or(&cfg.model);
    let model_cfg = model_config(model, args.revision.as_deref())?;
    let response = cfg.rollout.max_response_len as u64;
    let pack_tokens = cfg.pack.tokens as u64;
    let prompt_len = args
        .prompt_len
        .unwrap_or(pack_tokens.saturating_sub(response));
    let engine = EngineConfig::default();
    let utilization = args.gpu_memory_utilization.unwrap_or(if args.serve {
        0.9
    } else {
        cfg.engine.gpu_memory_utilization
    });
    let input = BudgetInputs {
        model: ModelShape::from(&model_cfg),
        engine_dtype,
        learner: (!args.serve).then_some(LearnerInputs {
            compute_dtype,
            pack_tokens,
        }),
        total_memory: args.gpu_memory,
        free_memory: args.free_memory.unwrap_or(args.gpu_memory),
        gpu_memory_utilization: utilization,
        block_size: engine.block_size as u64,
        max_batched_tokens: engine.max_batched_tokens as u64,
        seq_len: prompt_len + response,
    };
    let learner = match &input.learner {
        Some(l) => format!(
            "learner in {} on packed buffers of {} tokens",
            l.compute_dtype, l.pack_tokens
        ),
        None => "no learner (serving)".into(),
    };
    println!(
        "{model}: {} parameters on a {} GPU ({} free); engine in {}, {learner}; \
         gpu_memory_utilization {utilization}",
        model_cfg.num_parameters(),
        format_size(input.total_memory),
        format_size(input.free_memory),
        input.engine_dtype,
    );
    print!("{}", budget(&input)?);
    Ok(())
}

/// The precision a configured dtype has on a GPU (`auto`: bf16).
fn on_gpu(choice: DtypeChoice) -> Precision {
    match choice {
        DtypeChoice::Auto | DtypeChoice::Bf16 => Precision::Bf16,
        DtypeChoice::F32 => Precision::F32,
        DtypeChoice::F16 => Precision::F16,
    }
}

/// The model's config: read from `config.json` alone for an HF directory or a `random:`
/// shape (no weights loaded), otherwise from the loaded model.
fn model_config(model: &str, revision: Option<&str>) -> anyhow::Result<ModelConfig> {
    if let Some(spec) = model.strip_prefix(dppo_model::shapes::PREFIX) {
        return Ok(spec.parse::<dppo_model::RandomSpec>()?.shape.config()?);
    }
    let json = Path::new(model).join("config.json");
    if json.is_file() {
        let text = std::fs::read_to_string(&json)
            .with_context(|| format!("reading {}", json.display()))?;
        return Ok(ModelConfig::from_hf_json(
            &text,
            &json.display().to_string(),
        )?);
    }
    Ok(super::load_policy(model, revision, &Device::Cpu)?.config)
}
