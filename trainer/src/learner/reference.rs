//! The frozen policy the KL term measures against.

use candle_core::DType;
use dppo_model::{CausalLm, ModelConfig, Weights};

use super::KEPT_F32;
use crate::TrainError;

/// A frozen policy for the KL term: its own copy of the weights and the model over them.
pub struct Reference {
    pub weights: Weights,
    pub model: CausalLm,
}

impl Reference {
    /// A frozen copy of `weights` (kept as given: checkpoints save it), its model reading
    /// a cast to `compute_dtype` as the learner's does (the same tensors kept f32), so that
    /// the KL term is 0 where the weights are equal.
    pub(super) fn new(
        config: &ModelConfig,
        weights: &Weights,
        compute_dtype: DType,
    ) -> Result<Self, TrainError> {
        let weights = weights.deep_copy()?;
        let model = CausalLm::new(config, &weights.to_dtype_except(compute_dtype, &KEPT_F32)?)?;
        Ok(Self { weights, model })
    }
}
