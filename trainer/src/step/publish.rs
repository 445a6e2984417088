//! Weights from the learner to the engine: each optimizer step is published as the next
//! policy version, and the engine swaps it in between two iterations, never while a rollout
//! of the previous version is in flight.

use crate::TrainError;

use super::Trainer;

impl Trainer {
    /// Publishes the learner's weights as the next policy version; the engine swaps them in
    /// before its next iteration, or, while a rollout waits for its step, before the next
    /// submission. Zero-copy on CPU f32 when the loop is synchronous (the optimizer never
    /// writes while the engine reads); one step off-policy the engine generates while the
    /// optimizer writes, so it gets a copy.
    pub(super) fn publish(&mut self) -> Result<(), TrainError> {
        let weights = self.learner.weights()?;
        let weights = if self.cfg.rollout.one_step_off_policy {
            weights.deep_copy()?
        } else {
            weights
        };
        self.policy_version = self.store.publish(&weights)?;
        if self.pending.is_none() {
            self.sync_engine()?;
        }
        Ok(())
    }

    /// Hands the newest published policy to the engine if it is behind (no rollout may be
    /// in flight: the engine swaps between iterations, and a rollout must be one version).
    pub(super) fn sync_engine(&mut self) -> Result<(), TrainError> {
        if self.engine_version < self.policy_version {
            let published = self.store.latest();
            self.engine
                .swap_weights(&published.weights, published.version)?;
            self.engine_version = published.version;
        }
        Ok(())
    }

    /// After a restore: the learner's weights become policy `version` in the store and the
    /// engine, so that the next rollout is checked against the right version.
    pub(crate) fn resume_version(&mut self, version: u64) -> Result<(), TrainError> {
        let weights = self.learner.weights()?;
        self.store.restore(&weights, version)?;
        self.policy_version = version;
        self.engine.swap_weights(&weights, version)?;
        self.engine_version = version;
        Ok(())
    }
}
