//! Where a run starts: which checkpoint it continues from and with which configuration,
//! the policy it loads, and the checks and collective its ranks need before training.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::Device;
use dppo_model::{DeviceSpec, Policy};

use crate::checkpoint;
use crate::config::{ResumeMode, RunConfig};
use crate::dist::Collective;
use crate::report::metrics_log::METRICS_JSONL;
use crate::TrainError;

/// The directory of a run's checkpoints, under the run directory.
pub const CHECKPOINTS: &str = "checkpoints";

/// Which checkpoint a run continues from (`dppo run --resume`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// None asked for: the config's `resume` decides (`auto`: the newest complete
    /// checkpoint in the run directory, when there is one).
    ByConfig,
    /// The newest complete checkpoint in the run directory, or the beginning when there is
    /// none (so that the same command starts and resumes a run).
    Latest,
    /// This checkpoint, verified against its manifest first.
    From(PathBuf),
}

/// Where a run starts: its configuration and the checkpoint it continues from.
#[derive(Debug, Clone)]
pub struct Start {
    /// The configuration: a resumed checkpoint's own, with the overrides.
    pub cfg: RunConfig,
    /// The checkpoint to continue from; `None`: from the beginning.
    pub checkpoint: Option<PathBuf>,
    /// A checkpoint was asked for, whether or not one was found.
    asked: bool,
}

impl Start {
    /// A run of `cfg` from the beginning.
    pub fn fresh(cfg: RunConfig) -> Self {
        Self {
            cfg,
            checkpoint: None,
            asked: false,
        }
    }

    /// Logs where the run in `out` starts (rank 0 only).
    pub(super) fn log(&self, out: &Path) {
        if let Some(note) = self.cfg.bias_note() {
            tracing::warn!("{note}");
        }
        match &self.checkpoint {
            Some(ckpt) => tracing::info!("resuming from {}", ckpt.display()),
            None if self.asked => tracing::info!(
                "no checkpoint in {}: starting from the beginning",
                out.join(CHECKPOINTS).display()
            ),
            None => {}
        }
    }
}

impl Resume {
    /// The start of a run in the run directory `out`: a resumed checkpoint's `config.toml`
    /// with `sets`, else the config file `config` (the built-in default when `None`) with
    /// them.
    pub fn resolve(
        self,
        out: &Path,
        config: Option<&Path>,
        sets: &[String],
    ) -> Result<Start, TrainError> {
        let checkpoints = out.join(CHECKPOINTS);
        let from_checkpoint = |ckpt: PathBuf| -> Result<Start, TrainError> {
            Ok(Start {
                cfg: RunConfig::from_file(&ckpt.join(checkpoint::CONFIG), sets)?,
                checkpoint: Some(ckpt),
                asked: true,
            })
        };
        match self {
            Resume::Latest => match checkpoint::latest(&checkpoints) {
                Some(ckpt) => from_checkpoint(ckpt),
                None => Ok(Start {
                    asked: true,
                    ..Start::fresh(RunConfig::load(config, sets)?)
                }),
            },
            Resume::From(ckpt) => {
                checkpoint::verify(&ckpt)?;
                from_checkpoint(ckpt)
            }
            Resume::ByConfig => {
                let cfg = RunConfig::load(config, sets)?;
                let checkpoint = match cfg.resume {
                    ResumeMode::Auto => checkpoint::latest(&checkpoints),
                    ResumeMode::Disable => {
                        refuse_to_overwrite(out)?;
                        None
                    }
                };
                Ok(Start {
                    cfg,
                    checkpoint,
                    asked: false,
                })
            }
        }
    }
}

/// A run started from the beginning in `out` would overwrite an earlier run's metrics and
/// checkpoints there: refused, naming the ways on, unless a resume was asked for.
fn refuse_to_overwrite(out: &Path) -> Result<(), TrainError> {
    let held: Vec<&str> = [METRICS_JSONL, CHECKPOINTS]
        .into_iter()
        .filter(|name| out.join(name).exists())
        .collect();
    if held.is_empty() {
        return Ok(());
    }
    Err(TrainError::RunDirTaken {
        dir: out.display().to_string(),
        held: held.join(", "),
    })
}

/// Loads a model (at hub `revision` when it is a Hugging Face id), naming both in the
/// error.
pub fn load_policy(
    model: &str,
    revision: Option<&str>,
    device: &Device,
) -> Result<Policy, TrainError> {
    Policy::load_revision(model, revision, device).map_err(|error| TrainError::LoadModel {
        what: match revision {
            Some(r) => format!("{model} at revision {r}"),
            None => model.to_string(),
        },
        error: Box::new(error),
    })
}

/// Fails unless every rank runs the same configuration (its device aside) from the same
/// checkpoint: ranks started by hand or by an external launcher with different arguments.
pub(super) fn agree(
    collective: &dyn Collective,
    cfg: &RunConfig,
    resume: Option<&Path>,
) -> Result<(), TrainError> {
    let mut shared = cfg.clone();
    shared.device = DeviceSpec::Cpu;
    let mine = format!(
        "{}\n# resume: {}",
        shared.to_toml(),
        resume.map_or("none".into(), |p| p.display().to_string())
    );
    let all = collective.all_gather_bytes(mine.as_bytes())?;
    for (rank, theirs) in all.iter().enumerate().skip(1) {
        if *theirs != all[0] {
            let theirs = String::from_utf8_lossy(theirs);
            let first = String::from_utf8_lossy(&all[0]);
            let differs = first
                .lines()
                .zip(theirs.lines())
                .find(|(a, b)| a != b)
                .map_or("(one is longer)".to_string(), |(a, b)| {
                    format!("rank 0 has `{a}`, rank {rank} `{b}`")
                });
            return Err(TrainError::RanksDisagree { rank, differs });
        }
    }
    Ok(())
}

/// The collective the ranks' tensors travel by: NCCL between GPUs in a build with the
/// `nccl` feature, else `host` (through host memory).
pub(super) fn device_collective(
    host: Arc<dyn Collective>,
    device: &Device,
) -> Result<Arc<dyn Collective>, TrainError> {
    if host.world_size() == 1 || !device.is_cuda() {
        return Ok(host);
    }
    #[cfg(feature = "nccl")]
    {
        let nccl = crate::dist::NcclCollective::new(host, device)?;
        Ok(Arc::new(nccl))
    }
    #[cfg(not(feature = "nccl"))]
    {
        tracing::warn!(
            "GPU ranks without the `nccl` feature: gradients are all-reduced through host \
             memory over TCP (build with --features nccl)"
        );
        Ok(host)
    }
}
