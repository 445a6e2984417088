//! The frozen policy the KL term measures against.

use candle_core::DType;
use dppo_model::{CausalLm, ModelConfig, Weights};

use crate::TrainError;

/// A frozen policy for the KL term: its own copy of the weights and the model over them.
pub struct Reference {
    pub weights: Weights,
    pub model: CausalLm,
}

impl Reference {
    /// A frozen copy of `weights` (kept as given: checkpoints save it), its model reading
    /// a cast to `compute_dtype`.
    pub(super) fn new(
        config: &ModelConfig,
        weights: &Weights,
        compute_dtype: DType,
    ) -> Result<Self, TrainError> {
        let weights = weights.deep_copy()?;
        let model = CausalLm::new(config, &weights.to_dtype(compute_dtype)?)?;
        Ok(Self { weights, model })
    }
}
