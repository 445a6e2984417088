//! dppo-trainer: the DPPO algorithm. Rollout batches, group advantages, unbiased two-level
//! pruning (and the CPPO / GRESO baselines), dense prompt packing, the clipped loss, and the
//! learner that turns packed buffers into one optimizer step.

pub mod advantages;
pub mod checkpoint;
pub mod config;
pub mod correction;
pub mod data;
pub mod dist;
pub mod doctor;
pub mod eval;
pub mod group;
pub mod learner;
pub mod loss;
pub mod memory_budget;
pub mod mismatch;
pub mod optim;
pub mod pack;
pub mod prune;
pub mod report;
pub mod reward;
pub mod run;
pub mod step;
pub mod train_batch;

pub use advantages::{compute_advantages, ScaleRewards};
pub use group::{Group, Sample};
pub use prune::{Algorithm, Kept, LevelConfig};

/// Errors of the trainer; each says what to change.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error(transparent)]
    Pack(#[from] pack::TooLong),
    #[error(transparent)]
    Model(#[from] dppo_model::ModelError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    #[error("learner thread: {0}")]
    Thread(String),
    #[error(transparent)]
    Engine(#[from] dppo_engine::EngineError),
    /// A configuration value that cannot run (checked when the run starts).
    #[error("invalid config: {0}")]
    Config(String),
    /// A file that cannot be read or written.
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    /// Trainer state that cannot be encoded (a bug: every state type serialises).
    #[error("encoding {what}: {reason}")]
    State { what: &'static str, reason: String },
    /// Another data-parallel rank sent what this one cannot use.
    #[error(
        "rank {rank}: {reason}; every rank must run the same dppo build with the same \
         configuration, data and checkpoint"
    )]
    Rank { rank: usize, reason: String },
    #[error(transparent)]
    RewardBackend(#[from] reward::RewardFailure),
    #[error("invalid config: {0}")]
    RewardSetup(#[from] reward::SetupError),
    #[error(transparent)]
    Device(#[from] dppo_model::DeviceError),
    #[error("GPU memory budget: {0}")]
    MemoryBudget(#[from] memory_budget::BudgetError),
    #[error("rollout came from policy version {got}, the step expected {expected}")]
    Version { expected: u64, got: u64 },
    #[error(
        "{in_a_row} optimizer steps in a row (up to RL step {step}) had a NaN or infinite \
         loss or gradient norm and were skipped; the weights and optimizer are those of the \
         last finite step. Lower actor.lr or warmup.lr, check the data and rewards, or raise \
         train.max_nonfinite_steps"
    )]
    NonFinite { in_a_row: u64, step: u64 },
    #[error("checkpoint {dir}: {reason}")]
    Checkpoint { dir: String, reason: String },
    #[error(transparent)]
    Dist(#[from] dist::DistError),
    #[error(transparent)]
    Data(#[from] data::DataError),
    #[error(transparent)]
    RunConfig(#[from] config::ConfigError),
    #[error(transparent)]
    Metrics(#[from] report::metrics_log::MetricsError),
    #[error("loading model {what}")]
    LoadModel {
        what: String,
        #[source]
        error: Box<dppo_model::ModelError>,
    },
    /// A run from the beginning in a directory that holds an earlier run (`held`: what of
    /// it is there), which it would overwrite.
    #[error(
        "{dir} holds an earlier run ({held}), which a new run would overwrite: pass another \
         --out, continue it with --resume latest (or resume = \"auto\"), or delete it"
    )]
    RunDirTaken { dir: String, held: String },
    #[error("{action} {path}")]
    RunDir {
        action: &'static str,
        path: String,
        #[source]
        error: std::io::Error,
    },
    #[error(
        "rank {rank} runs another configuration than rank 0: {differs}; start every rank \
         with the same arguments"
    )]
    RanksDisagree { rank: usize, differs: String },
    #[error("checkpointing step {step}")]
    Checkpointing {
        step: u64,
        #[source]
        error: Box<TrainError>,
    },
    #[error("stopping: the last good state is checkpointed in {dir}")]
    Stopped {
        dir: String,
        #[source]
        error: Box<TrainError>,
    },
    #[error(
        "the replicas diverged by step {step}: their weights' checksums differ ({checksums}); \
         every rank must hold the same weights after each step"
    )]
    Diverged { step: u64, checksums: String },
}

impl TrainError {
    /// Whether a collective failed (a rank that exited or stopped answering), here or in
    /// the error this one wraps, rather than this rank itself.
    pub fn is_collective_failure(&self) -> bool {
        match self {
            Self::Dist(_) => true,
            Self::Checkpointing { error, .. } | Self::Stopped { error, .. } => {
                error.is_collective_failure()
            }
            _ => false,
        }
    }
}
