//! dppo-trainer: the DPPO algorithm. Rollout batches, group advantages, unbiased two-level
//! pruning (and the CPPO / GRESO baselines), dense prompt packing, the clipped loss, and the
//! learner that turns packed buffers into one optimizer step.

pub mod advantages;
pub mod loss;
pub mod optim;
pub mod pack;
pub mod prune;
pub mod rollout;

pub use advantages::{compute_advantages, ScaleRewards};
pub use prune::{Algorithm, Kept, LevelConfig};
pub use rollout::{Group, Sample};
