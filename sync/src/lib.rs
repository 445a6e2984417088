//! dppo-sync: versioned policy weights. The learner publishes version `v + 1` after each
//! optimizer step; the engine acquires the newest version between two of its iterations.
//!
//! Same device and dtype: zero-copy (the published tensors are detached views of the
//! learner's storage, so the caller must not step the optimizer while an engine iteration
//! reads them: the step loop fences at step boundaries). Otherwise each tensor is cast into
//! persistent buffers, in place: two sets allocated once and used in turn (the engine may
//! still read the previous version while the next one is written, one step off-policy), so
//! no step allocates and buffer addresses stay fixed.

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
    /// When publishing casts: the buffers the next version is written into (the latest
    /// version's are the other set); allocated at the first cast publication.
    spare: Mutex<Option<Weights>>,
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
            spare: Mutex::new(None),
        })
    }

    /// Publishes `weights` as the next version and returns that version.
    pub fn publish(&self, weights: &Weights) -> Result<u64, SyncError> {
        let mut latest = self.latest.lock();
        let version = latest.version + 1;
        self.replace(&mut latest, weights, version)?;
        Ok(version)
    }

    /// Sets the newest version to `weights` as `version` (resuming from a checkpoint).
    pub fn restore(&self, weights: &Weights, version: u64) -> Result<(), SyncError> {
        self.replace(&mut self.latest.lock(), weights, version)
    }

    /// Makes `weights` the latest version: zero-copy when they are on the store's device
    /// and in its dtype, else cast into the spare buffers, which then become the latest.
    fn replace(
        &self,
        latest: &mut Published,
        weights: &Weights,
        version: u64,
    ) -> Result<(), SyncError> {
        let err = self.error();
        let weights = if is_in(weights, &self.device, self.dtype) {
            weights.clone()
        } else {
            let mut spare = self.spare.lock();
            let buffers = match spare.take() {
                Some(buffers) => {
                    write_into(&buffers, weights, &self.device).map_err(err)?;
                    buffers
                }
                None => transfer(weights, &self.device, self.dtype)?,
            };
            *spare = Some(std::mem::replace(&mut latest.weights, buffers.clone()));
            buffers
        };
        *latest = Published { version, weights };
        Ok(())
    }

    fn error(&self) -> impl Fn(dppo_model::ModelError) -> SyncError + '_ {
        move |source| SyncError::Transfer {
            device: self.device.location(),
            dtype: self.dtype,
            source: Box::new(source),
        }
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
    if is_in(weights, device, dtype) {
        return Ok(weights.clone());
    }
    let moved = weights
        .to_device(device)
        .and_then(|w| w.to_dtype(dtype))
        .map_err(err)?;
    Ok(moved)
}

/// Whether every tensor of `weights` is on `device` in `dtype`.
fn is_in(weights: &Weights, device: &Device, dtype: DType) -> bool {
    weights
        .tensors()
        .values()
        .all(|t| t.device().same_device(device) && t.dtype() == dtype)
}

/// Writes `weights`, moved to `device` and cast, into `buffers` in place (same names and
/// shapes: the buffers were made from an earlier version of the same model).
fn write_into(buffers: &Weights, weights: &Weights, device: &Device) -> dppo_model::Result<()> {
    for (name, dst) in buffers.tensors() {
        let src = weights
            .tensors()
            .get(name)
            .ok_or_else(|| dppo_model::ModelError::Weights {
                origin: "published".into(),
                reason: format!("published weights lack {name}"),
            })?;
        dst.slice_set(&src.to_device(device)?.to_dtype(dst.dtype())?, 0, 0)?;
    }
    Ok(())
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

    #[test]
    fn cast_publications_write_in_place_into_two_buffers_used_in_turn() {
        let tiny = load_preset("tiny", &Device::Cpu).unwrap();
        let (vars, trainable) = tiny.weights.to_vars().unwrap();
        let store = PolicyStore::new(&trainable, Device::Cpu, DType::F64).unwrap();
        let name = "model.norm.weight";
        let var: &Var = &vars[name];
        let mut ids = Vec::new();
        for version in 1..=4 {
            var.set(&(var.as_tensor() * 2.0).unwrap()).unwrap();
            assert_eq!(store.publish(&trainable).unwrap(), version);
            let t = store.latest().weights.tensors()[name].clone();
            let want = var.as_tensor().to_dtype(DType::F64).unwrap();
            assert_eq!(t.to_vec1::<f64>().unwrap(), want.to_vec1::<f64>().unwrap());
            ids.push(t.id());
        }
        // Version 1 allocates the second set; from then on the two sets alternate.
        assert_eq!((ids[1], ids[2]), (ids[3], ids[0]));
        assert_ne!(ids[0], ids[1]);
    }
}
