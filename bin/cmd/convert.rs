//! `dppo convert`: any model we can load -> an HF directory transformers and vLLM load.

use std::path::PathBuf;

use anyhow::Context;
use candle_core::Device;

/// Arguments of `dppo convert`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// `builtin:tiny`, an HF directory, a `.gguf` file (dequantised to f32), or a Hugging
    /// Face id (`Org/Name`) in the local hub cache.
    #[arg(long)]
    model: String,
    /// Hub revision (branch, tag or commit) when --model is a Hugging Face id; default main.
    #[arg(long)]
    revision: Option<String>,
    /// Output directory; replaced atomically if it exists.
    #[arg(long)]
    out: PathBuf,
}

/// Loads `--model` and saves it under `--out`.
pub fn run(args: Args) -> anyhow::Result<()> {
    let policy = super::load_policy(&args.model, args.revision.as_deref(), &Device::Cpu)?;
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
