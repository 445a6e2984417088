//! `dppo serve`: the OpenAI-compatible API over a model, until Ctrl-C.

use std::io::Write;
use std::sync::Arc;

use dppo_engine::{Engine, EngineConfig};
use dppo_model::Policy;
use dppo_server::{ApiKey, ServerConfig, ServerHandle};

use super::load_args::LoadArgs;

/// Arguments of `dppo serve`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// `builtin:tiny`, `random:SHAPE[@seed=N]`, an HF directory, a checkpoint directory, a
    /// `.gguf` file, or a Hugging Face id (`Org/Name`) in the local hub cache.
    #[arg(long)]
    model: String,
    #[command(flatten)]
    load: LoadArgs,
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, default_value = "127.0.0.1:8000")]
    addr: String,
    #[command(flatten)]
    serve: ServeArgs,
}

/// Server options shared by `dppo serve` and `dppo run --serve`.
#[derive(Debug, Clone, clap::Args)]
pub struct ServeArgs {
    /// Model id clients name in requests (default: the --model argument).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Requests accepted at once (queued or generating); more get 429.
    #[arg(long, default_value_t = 256)]
    max_pending: usize,
    /// Require `Authorization: Bearer KEY` on every route but /health (default: the
    /// DPPO_API_KEY environment variable; no key when neither is set).
    #[arg(long)]
    api_key: Option<ApiKey>,
}

/// Serves until Ctrl-C.
pub fn run(args: Args) -> anyhow::Result<()> {
    let (device, policy) = args.load.load(&args.model)?;
    let engine = Arc::new(Engine::new(&policy, EngineConfig::default(), device)?);
    let handle = start(engine, &policy, &args.model, &args.addr, &args.serve)?;
    handle.wait()?;
    println!("server stopped");
    Ok(())
}

/// Starts the server over `engine` and prints where it listens.
pub fn start(
    engine: Arc<Engine>,
    policy: &Policy,
    model: &str,
    addr: &str,
    args: &ServeArgs,
) -> anyhow::Result<ServerHandle> {
    let cfg = ServerConfig {
        addr: addr.to_string(),
        model_name: args
            .served_model_name
            .clone()
            .unwrap_or_else(|| model.to_string()),
        max_pending: args.max_pending,
        handle_ctrl_c: true,
        api_key: args.api_key.clone().or_else(|| {
            std::env::var("DPPO_API_KEY")
                .ok()
                .filter(|k| !k.is_empty())
                .map(ApiKey::new)
        }),
    };
    let handle = dppo_server::spawn(
        engine,
        policy.tokenizer.clone(),
        policy.eos_token_ids().to_vec(),
        cfg,
    )?;
    println!("listening on http://{}", handle.addr());
    std::io::stdout().flush()?;
    Ok(handle)
}
