//! Where a command's model is loaded from and runs: its hub revision and the device
//! (`dppo generate`, `dppo eval`, `dppo serve`).

use candle_core::Device;
use dppo_model::{DeviceSpec, Policy};

/// The hub revision and the device of `--model`.
#[derive(Debug, clap::Args)]
pub struct LoadArgs {
    /// Hub revision (branch, tag or commit) when --model is a Hugging Face id; default main.
    #[arg(long)]
    revision: Option<String>,
    /// Where the engine runs: cpu, cuda or cuda:N (cuda needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: DeviceSpec,
}

impl LoadArgs {
    /// Opens the device and loads `model` onto it.
    pub fn load(&self, model: &str) -> anyhow::Result<(Device, Policy)> {
        let device = self.device.open()?;
        let policy = super::load_policy(model, self.revision.as_deref(), &device)?;
        Ok((device, policy))
    }
}
