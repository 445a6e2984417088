//! `dppo doctor`: checks this build on this machine and prints one verdict line.

use dppo_model::DeviceSpec;
use dppo_trainer::doctor::{self, Options};

/// Arguments of `dppo doctor`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// The device checked against the CPU: cpu, cuda or cuda:N (default: cuda in a CUDA
    /// build, cpu otherwise).
    #[arg(long)]
    device: Option<DeviceSpec>,
    /// A larger random model (4 layers, hidden 256), 16 greedy prompts of 32 tokens and a
    /// rollout of 32 prompts x 8 samples x 64 tokens, instead of the tiny model, 4 prompts
    /// of 16 tokens and 8 x 4 x 32.
    #[arg(long)]
    full: bool,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
}

/// Runs the checks, prints the report, and fails naming the first failed check.
pub fn run(args: Args) -> anyhow::Result<()> {
    let default = if cfg!(feature = "cuda") {
        DeviceSpec::Cuda(0)
    } else {
        DeviceSpec::Cpu
    };
    let report = doctor::run(&Options {
        device: args.device.unwrap_or(default),
        full: args.full,
        version: env!("CARGO_PKG_VERSION").to_string(),
        commit: option_env!("DPPO_GIT_COMMIT").map(str::to_string),
    });
    if args.json {
        println!("{}", report.to_json());
    } else {
        println!("{report}");
    }
    anyhow::ensure!(report.passed(), "{}", report.verdict());
    Ok(())
}
