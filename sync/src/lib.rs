//! dppo-sync: versioned policy weights. The learner publishes version `v + 1` after each
//! optimizer step; the engine acquires the newest version between two of its iterations.
//!
//! Same device and dtype: zero-copy (the published tensors are detached views of the
//! learner's storage, so the caller must not step the optimizer while an engine iteration
//! reads them: the step loop fences at step boundaries). Otherwise each tensor is copied and
//! cast once at publication.

use candle_core::{DType, Device, DeviceLocation};
use dppo_model::Weights;
use parking_lot::Mutex;

/// Errors of the store.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    #[error("cannot move weights to {device:?} as {dtype:?}: {source}")]
    Transfer {
        /// Where the weights were going (the location, not the device handle: a CUDA
        /// handle is large).
        device: DeviceLocation,
        dtype: DType,
        /// Boxed: the model's error is large in a CUDA build.
        source: Box<dppo_model::ModelError>,
    },
}

/// A version of the policy.
#[derive(Debug, Clone)]
pub struct Published {
    pub version: u64,
    pub weights: Weights,
}

/// The newest published weights, as the engine wants them (its device and dtype).
pub struct PolicyStore {
    device: Device,
    dtype: DType,
    latest: Mutex<Published>,
}

impl PolicyStore {
    /// A store whose consumers run on `device` in `dtype`, starting at version 0.
    pub fn new(initial: &Weights, device: Device, dtype: DType) -> Result<Self, SyncError> {
        let weights = transfer(initial, &device, dtype)?;
        Ok(Self {
            device,
            dtype,
            latest: Mutex::new(Published {
                version: 0,
                weights,
            }),
        })
    }

    /// Publishes `weights` as the next version and returns that version.
    pub fn publish(&self, weights: &Weights) -> Result<u64, SyncError> {
        let weights = transfer(weights, &self.device, self.dtype)?;
        let mut latest = self.latest.lock();
        latest.version += 1;
        latest.weights = weights;
        Ok(latest.version)
    }

    /// Sets the newest version to `weights` as `version` (resuming from a checkpoint).
    pub fn restore(&self, weights: &Weights, version: u64) -> Result<(), SyncError> {
        let weights = transfer(weights, &self.device, self.dtype)?;
        *self.latest.lock() = Published { version, weights };
        Ok(())
    }

    /// The newest version.
    pub fn latest(&self) -> Published {
        self.latest.lock().clone()
    }

    /// The newest version if it is newer than `have`.
    pub fn newer_than(&self, have: u64) -> Option<Published> {
        let latest = self.latest.lock();
        (latest.version > have).then(|| latest.clone())
    }
}

/// `weights` on `device` in `dtype`: the same tensors (zero-copy) when they already are,
/// a per-tensor copy or cast otherwise.
pub fn transfer(weights: &Weights, device: &Device, dtype: DType) -> Result<Weights, SyncError> {
    let err = |source| SyncError::Transfer {
        device: device.location(),
        dtype,
        source: Box::new(source),
    };
    let same = weights
        .tensors()
        .values()
        .all(|t| t.device().same_device(device) && t.dtype() == dtype);
    if same {
        return Ok(weights.clone());
    }
    let moved = weights
        .to_device(device)
        .and_then(|w| w.to_dtype(dtype))
        .map_err(err)?;
    Ok(moved)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;
    use dppo_model::presets::load_preset;

    #[test]
    fn versions_advance_and_readers_see_only_newer_ones() {
        let tiny = load_preset("tiny", &Device::Cpu).unwrap();
        let store = PolicyStore::new(&tiny.weights, Device::Cpu, DType::F32).unwrap();
        assert_eq!(store.latest().version, 0);
        assert!(store.newer_than(0).is_none());
        assert_eq!(store.publish(&tiny.weights).unwrap(), 1);
        assert_eq!(store.publish(&tiny.weights).unwrap(), 2);
        assert_eq!(store.newer_than(0).unwrap().version, 2);
        assert!(store.newer_than(2).is_none());
    }

    #[test]
    fn same_device_and_dtype_is_zero_copy_and_a_cast_is_a_copy() {
        let tiny = load_preset("tiny", &Device::Cpu).unwrap();
        let (vars, trainable) = tiny.weights.to_vars().unwrap();
        let store = PolicyStore::new(&trainable, Device::Cpu, DType::F32).unwrap();
        let f64_store = PolicyStore::new(&trainable, Device::Cpu, DType::F64).unwrap();
        // An optimizer update in place is visible through the zero-copy view only.
        let name = "model.norm.weight";
        let var: &Var = &vars[name];
        var.set(&(var.as_tensor() * 3.0).unwrap()).unwrap();
        let view = store.latest().weights.tensors()[name]
            .to_vec1::<f32>()
            .unwrap();
        let cast = f64_store.latest().weights.tensors()[name]
            .to_vec1::<f64>()
            .unwrap();
        assert!(view.iter().all(|&x| x == 3.0));
        assert!(cast.iter().all(|&x| x == 1.0));
    }
}
