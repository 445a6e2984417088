//! `dppo generate`: complete one prompt `n` times with the paged engine.

use dppo_engine::{Engine, EngineConfig, GenerateRequest, SamplingParams};
use dppo_model::ChatMessage;
use serde_json::json;

use super::load_args::LoadArgs;

/// Arguments of `dppo generate`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// `builtin:tiny`, `random:SHAPE[@seed=N]` (a random-weight model of a real shape:
    /// smollm2-135m, qwen2.5-0.5b, qwen2.5-1.5b, qwen3-1.7b), an HF directory, a `.gguf`
    /// file, or a Hugging Face id (`Org/Name`) in the local hub cache.
    #[arg(long, default_value = "builtin:tiny")]
    model: String,
    #[command(flatten)]
    load: LoadArgs,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Samples of the prompt (they share its KV blocks).
    #[arg(long, default_value_t = 1)]
    n: usize,
    #[arg(long, default_value_t = 64)]
    max_tokens: usize,
    /// 0 samples greedily.
    #[arg(long, default_value_t = 1.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// 0 disables top-k.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long)]
    seed: Option<u64>,
    /// Stop strings (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Print one JSON object per sample.
    #[arg(long)]
    json: bool,
}

/// Generates and prints the samples.
pub fn run(args: Args) -> anyhow::Result<()> {
    let (device, policy) = args.load.load(&args.model)?;
    let text = if args.chat {
        policy
            .tokenizer
            .apply_chat_template(&[ChatMessage::new("user", &args.prompt)], true)?
    } else {
        args.prompt.clone()
    };
    let prompt_ids = policy.tokenizer.encode(&text, !args.chat)?;
    let engine = Engine::new(&policy, EngineConfig::default(), device)?;
    let request = GenerateRequest {
        sampling: SamplingParams {
            temperature: args.temperature,
            top_k: args.top_k,
            top_p: args.top_p,
            seed: args.seed,
            ..SamplingParams::default()
        },
        stop: args.stop.clone(),
        ..GenerateRequest::new(prompt_ids, args.n, args.max_tokens)
    };
    let completions = engine.submit(request)?.wait();
    for c in completions {
        let mut text = policy.tokenizer.decode(&c.token_ids, true)?;
        if let Some(at) = dppo_engine::request::find_stop(&text, &args.stop) {
            text.truncate(at);
        }
        if args.json {
            let line = json!({
                "sample_index": c.sample_index,
                "token_ids": c.token_ids,
                "text": text,
                "logprobs": c.logprobs,
                "finish_reason": c.finish_reason,
                "policy_version": c.policy_version,
            });
            println!("{line}");
        } else {
            println!(
                "--- sample {} ({:?}) ---\n{text}",
                c.sample_index, c.finish_reason
            );
        }
    }
    Ok(())
}
