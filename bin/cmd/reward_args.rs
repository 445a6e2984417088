//! The reward flags `dppo eval` and `dppo score` share: the verifier's extraction mode, and
//! a run config's `[reward]` to score as training would.

use std::path::PathBuf;

use dppo_rewards::{ExtractMode, RewardSpec};
use dppo_trainer::config::RunConfig;
use dppo_trainer::reward::Scorer;

/// `--extract`, `--config` and `--set`.
#[derive(Debug, clap::Args)]
pub struct RewardArgs {
    /// How final answers are extracted: boxed, strict, flexible or answer (default: the
    /// config's `reward.extract`, else answer for built-in tasks and strict for files).
    #[arg(long)]
    extract: Option<ExtractMode>,
    /// Score with this run config's `[reward]` (a server, a process, named rewards and
    /// their weights, or the verifier's settings), as training would, without the overlong
    /// penalty.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Override a key of that config (or of the built-in default), e.g.
    /// `--set 'reward.command=["python3", "my_reward.py"]'` (repeatable).
    #[arg(long = "set")]
    sets: Vec<String>,
}

impl RewardArgs {
    /// The config (the built-in default without `--config`), the verifier's settings with
    /// the extraction mode (`--extract`, else the config's, else `default_mode`), and the
    /// scorer they make.
    pub fn scorer(
        &self,
        default_mode: ExtractMode,
    ) -> anyhow::Result<(RunConfig, RewardSpec, Scorer)> {
        let cfg = RunConfig::load(self.config.as_deref(), &self.sets)?;
        let mut spec = dppo_trainer::reward::spec(&cfg);
        spec.mode = self
            .extract
            .or(cfg.reward.verifier.extract)
            .unwrap_or(default_mode);
        let scorer = Scorer::new(&cfg.reward, spec).map_err(anyhow::Error::msg)?;
        Ok((cfg, spec, scorer))
    }
}
