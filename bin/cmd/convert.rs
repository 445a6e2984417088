//! `dppo convert`: any model we can load -> an HF directory transformers and vLLM load.

use std::path::PathBuf;

use anyhow::Context;
use candle_core::Device;
use dppo_model::Policy;

/// Arguments of `dppo convert`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// `builtin:tiny`, an HF directory, or a `.gguf` file (dequantised to f32).
    #[arg(long)]
    model: String,
    /// Output directory; replaced atomically if it exists.
    #[arg(long)]
    out: PathBuf,
}

/// Loads `--model` and saves it under `--out`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let policy = Policy::load(&args.model, &Device::Cpu)
        .with_context(|| format!("loading --model {}", args.model))?;
    policy
        .save_hf(&args.out)
        .with_context(|| format!("saving to {}", args.out.display()))?;
    tracing::info!(
        model = args.model,
        out = %args.out.display(),
        params = policy.config.num_parameters(),
        "saved HF directory"
    );
    Ok(())
}
