//! `dppo config`: the configuration a run would use, as TOML with every key's doc, allowed
//! values and verl/TRL name (the built-in default without arguments).

use std::path::PathBuf;

use dppo_trainer::config::annotated;
use dppo_trainer::config::RunConfig;

/// The configuration flags of `dppo run` and `dppo config`.
#[derive(Debug, clap::Args)]
pub struct ConfigArgs {
    /// A TOML config; the built-in default (configs/default.toml) when absent.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Override a config key, e.g. `--set dppo.r_o=0.5` (repeatable).
    #[arg(long = "set")]
    pub sets: Vec<String>,
}

impl ConfigArgs {
    /// The config file with the overrides, or the built-in default with them.
    pub fn load(&self) -> anyhow::Result<RunConfig> {
        Ok(RunConfig::load(self.config.as_deref(), &self.sets)?)
    }
}

/// Arguments of `dppo config`.
#[derive(Debug, clap::Args)]
pub struct Args {
    #[command(flatten)]
    given: ConfigArgs,
    /// Print the reference page `docs/configuration.md` (the default, annotated) instead.
    #[arg(long, conflicts_with_all = ["config", "sets"])]
    markdown: bool,
}

/// Prints the annotated configuration; invalid configs fail as `dppo run` fails on them.
pub fn run(args: Args) -> anyhow::Result<()> {
    if args.markdown {
        print!("{}", annotated::reference_markdown());
        return Ok(());
    }
    let cfg = args.given.load()?;
    if let Some(note) = cfg.bias_note() {
        println!("# Note: {note}.\n");
    }
    print!("{}", annotated::annotated_toml(&cfg).trim_start());
    Ok(())
}
