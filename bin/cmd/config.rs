//! `dppo config`: the configuration a run would use, as TOML with every key's doc, allowed
//! values and verl/TRL name (the built-in default without arguments).

use std::path::PathBuf;

use dppo_trainer::config::RunConfig;
use dppo_trainer::config_keys;

/// Arguments of `dppo config`.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// A TOML config; the built-in default (configs/default.toml) when absent.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override a config key, e.g. `--set dppo.r_o=0.5` (repeatable).
    #[arg(long = "set")]
    sets: Vec<String>,
    /// Print the reference page `docs/configuration.md` (the default, annotated) instead.
    #[arg(long, conflicts_with_all = ["config", "sets"])]
    markdown: bool,
}

/// Prints the annotated configuration; invalid configs fail as `dppo run` fails on them.
pub fn run(args: Args) -> anyhow::Result<()> {
    if args.markdown {
        print!("{}", config_keys::reference_markdown());
        return Ok(());
    }
    let cfg = match &args.config {
        Some(path) => super::run::read_config(path, &args.sets)?,
        None => RunConfig::default_with(&args.sets)?,
    };
    print!("{}", config_keys::annotated_toml(&cfg).trim_start());
    Ok(())
}
