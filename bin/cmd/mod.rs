//! One module per subcommand: each loads what it needs and calls the library crates.

pub mod bench;
pub mod bench_serve;
pub mod compare;
pub mod config;
pub mod convert;
pub mod eval;
pub mod generate;
pub mod memory;
pub mod ranks;
pub mod run;
pub mod score;
pub mod serve;

use anyhow::Context;
use candle_core::Device;
use dppo_model::Policy;

/// Loads a command's model (at hub `--revision` when it is a Hugging Face id), naming both
/// in the error.
pub fn load_policy(model: &str, revision: Option<&str>, device: &Device) -> anyhow::Result<Policy> {
    Policy::load_revision(model, revision, device).with_context(|| match revision {
        Some(r) => format!("loading model {model} at revision {r}"),
        None => format!("loading model {model}"),
    })
}
