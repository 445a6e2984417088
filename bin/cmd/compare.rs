//! `dppo compare`: the time-to-accuracy table of run directories (markdown on stdout) and an
//! SVG overlaying their held-out accuracy and reward.

use std::path::PathBuf;

use anyhow::Context;
use dppo_model::weights::write_atomic;
use dppo_trainer::report::compare::{self, Run};

/// Arguments of `dppo compare`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Run directories (`dppo run --out`). The first is the baseline: the targets are its
    /// last held-out evaluation and the mean of its last 10.
    #[arg(required = true)]
    runs: Vec<PathBuf>,
    /// Where to write the SVG of held-out accuracy and reward against RL time and step.
    #[arg(long, default_value = "compare.svg")]
    svg: PathBuf,
}

/// Prints the table and writes the SVG.
pub fn run(args: Args) -> anyhow::Result<()> {
    let runs = args
        .runs
        .iter()
        .map(|dir| Run::load(dir))
        .collect::<Result<Vec<_>, _>>()?;
    print!("{}", compare::table(&runs));
    write_atomic(&args.svg, compare::svg(&runs).as_bytes())
        .with_context(|| format!("writing {}", args.svg.display()))?;
    tracing::info!(svg = %args.svg.display(), "wrote the comparison plot");
    Ok(())
}
