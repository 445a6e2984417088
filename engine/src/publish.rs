//! Versioned weights for the engine: each publication becomes the next policy version, in
//! the engine's device and dtype. The one counter of policy versions lives here.
//!
//! Same device and dtype: zero-copy (the engine reads the publisher's tensors, so the
//! publisher must not write them while an iteration reads them: the step loop publishes a
//! copy when it trains while the engine generates). Otherwise each tensor is cast into
//! persistent buffers, in place: two sets allocated once and used in turn, so no step
//! allocates and buffer addresses stay fixed; with `fuse` those buffers hold each layer's
//! q/k/v and gate/up concatenated (`Weights::fuse_projections`), written part by part
//! through views. On a GPU the copies and casts run on a
//! stream of their own, so they queue no work on the engine's stream (see
//! `dppo_model::streams` and docs/design.md, "Streams").

use candle_core::{DType, Device};
use dppo_model::streams::{copy_into, own_stream, wait_for};
use dppo_model::Weights;
use parking_lot::Mutex;

use crate::EngineError;

/// Held while a thread other than the engine's worker queues work on the engine's stream (a
/// publication: its buffers, the new model's rotary tables), and while the worker captures
/// a decode step (`engine.cuda_graphs`): a capture takes in whatever any thread queues on its
/// stream meanwhile.
pub(crate) static QUEUEING: Mutex<()> = Mutex::new(());

/// The newest published weights and the buffers the next cast publication is written into.
pub(crate) struct Publication {
    device: Device,
    /// Where casts run: a stream of its own on the engine's GPU (the CPU on the CPU).
    staging: Device,
    dtype: DType,
    latest: Mutex<Latest>,
}

struct Latest {
    version: u64,
    weights: Weights,
    /// When publishing casts: the other set of buffers (those of the version before
    /// `version`); allocated at the first cast publication.
    spare: Option<Weights>,
}

impl Publication {
    /// Version 0: `initial` on `device` in `dtype`, its projections fused when `fuse` and
    /// the engine keeps buffers of its own; returns the weights the engine starts with.
    pub fn new(
        initial: &Weights,
        device: Device,
        dtype: DType,
        fuse: bool,
    ) -> Result<(Self, Weights), EngineError> {
        let weights = transfer(initial, &device, dtype, fuse)?;
        let publication = Self {
            staging: own_stream(&device)?,
            device,
            dtype,
            latest: Mutex::new(Latest {
                version: 0,
                weights: weights.clone(),
                spare: None,
            }),
        };
        Ok((publication, weights))
    }

    /// The newest published version.
    pub fn version(&self) -> u64 {
        self.latest.lock().version
    }

    /// The engine's copy of the newest published version.
    pub fn weights(&self) -> Weights {
        self.latest.lock().weights.clone()
    }

    /// Makes `weights` version `version` (the next one when `None`) and returns it with the
    /// engine's copy. `applied` is the version the engine generates with: while it is behind
    /// the newest, the spare buffers may still be read by the engine, so a cast publication
    /// then writes into new buffers instead.
    pub fn publish(
        &self,
        weights: &Weights,
        version: Option<u64>,
        applied: u64,
    ) -> Result<(u64, Weights), EngineError> {
        let mut latest = self.latest.lock();
        let version = version.unwrap_or(latest.version + 1);
        let copy = if is_in(weights, &self.device, self.dtype) {
            weights.clone()
        } else {
            let reusable = latest.spare.take().filter(|_| applied == latest.version);
            let buffers = match reusable {
                Some(buffers) => buffers,
                None => latest.weights.zeros_like()?,
            };
            write_into(&buffers, weights, &self.staging)?;
            latest.spare = Some(std::mem::replace(&mut latest.weights, buffers.clone()));
            buffers
        };
        latest.version = version;
        latest.weights = copy.clone();
        Ok((version, copy))
    }
}

/// `weights` on `device` in `dtype`: the same tensors (zero-copy) when they already are,
/// a per-tensor copy or cast otherwise (its projections fused with `fuse`).
fn transfer(
    weights: &Weights,
    device: &Device,
    dtype: DType,
    fuse: bool,
) -> Result<Weights, EngineError> {
    if is_in(weights, device, dtype) {
        return Ok(weights.clone());
    }
    let copy = weights.to_device(device)?.to_dtype(dtype)?;
    Ok(if fuse { copy.fuse_projections()? } else { copy })
}

/// Whether every tensor of `weights` is on `device` in `dtype`.
fn is_in(weights: &Weights, device: &Device, dtype: DType) -> bool {
    weights
        .tensors()
        .values()
        .all(|t| t.device().same_device(device) && t.dtype() == dtype)
}

/// Writes `weights`, moved to `staging` and cast there, into `buffers` in place (same
/// names and shapes: the buffers were made from an earlier version of the same model).
/// Then the publisher's stream waits for the staging stream, so that its next write of
/// `weights` (the optimizer's, in place) cannot overtake the copies read here.
fn write_into(buffers: &Weights, weights: &Weights, staging: &Device) -> Result<(), EngineError> {
    let mut source = None;
    for (name, dst) in buffers.tensors() {
        let src = weights.tensors().get(name).ok_or_else(|| {
            EngineError::Model(dppo_model::ModelError::Weights {
                origin: "published".into(),
                reason: format!("published weights lack {name}"),
            })
        })?;
        copy_into(dst, &src.to_device(staging)?.to_dtype(dst.dtype())?)?;
        source = Some(src.device().clone());
    }
    if let Some(source) = source {
        wait_for(&source, staging)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Var;
    use dppo_model::presets::load_preset;

    #[test]
    fn versions_advance_from_zero_and_a_restore_sets_them() {
        let tiny = load_preset("tiny", &Device::Cpu).unwrap();
        let (publication, _) =
            Publication::new(&tiny.weights, Device::Cpu, DType::F32, false).unwrap();
        assert_eq!(publication.version(), 0);
        assert_eq!(publication.publish(&tiny.weights, None, 0).unwrap().0, 1);
        assert_eq!(publication.publish(&tiny.weights, None, 1).unwrap().0, 2);
        assert_eq!(publication.publish(&tiny.weights, Some(7), 2).unwrap().0, 7);
        assert_eq!(publication.version(), 7);
    }

    #[test]
    fn same_device_and_dtype_is_zero_copy_and_a_cast_is_a_copy() {
        let tiny = load_preset("tiny", &Device::Cpu).unwrap();
        let (vars, trainable) = tiny.weights.to_vars().unwrap();
        let (_, view) = Publication::new(&trainable, Device::Cpu, DType::F32, false).unwrap();
        let (_, cast) = Publication::new(&trainable, Device::Cpu, DType::F64, false).unwrap();
        // An optimizer update in place is visible through the zero-copy view only.
        let name = "model.norm.weight";
        let var: &Var = &vars[name];
        var.set(&(var.as_tensor() * 3.0).unwrap()).unwrap();
        let view = view.tensors()[name].to_vec1::<f32>().unwrap();
        let cast = cast.tensors()[name].to_vec1::<f64>().unwrap();
        assert!(view.iter().all(|&x| x == 3.0));
        assert!(cast.iter().all(|&x| x == 1.0));
    }

    #[test]
    fn cast_publications_write_in_place_into_two_buffers_used_in_turn() {
        let tiny = load_preset("tiny", &Device::Cpu).unwrap();
        let (vars, trainable) = tiny.weights.to_vars().unwrap();
        let (publication, first) =
            Publication::new(&trainable, Device::Cpu, DType::F64, false).unwrap();
        let name = "model.norm.weight";
        let var: &Var = &vars[name];
        let mut ids = vec![first.tensors()[name].id()];
        for version in 1..=4 {
            var.set(&(var.as_tensor() * 2.0).unwrap()).unwrap();
            let (got, copy) = publication.publish(&trainable, None, version - 1).unwrap();
            assert_eq!(got, version);
            let t = copy.tensors()[name].clone();
            let want = var.as_tensor().to_dtype(DType::F64).unwrap();
            assert_eq!(t.to_vec1::<f64>().unwrap(), want.to_vec1::<f64>().unwrap());
            ids.push(t.id());
        }
        // Version 1 allocates the second set; from then on the two sets alternate.
        assert_ne!(ids[0], ids[1]);
        assert_eq!([ids[2], ids[3], ids[4]], [ids[0], ids[1], ids[0]]);
    }

    #[test]
    fn buffers_the_engine_may_still_read_are_never_written() {
        let tiny = load_preset("tiny", &Device::Cpu).unwrap();
        let (_, trainable) = tiny.weights.to_vars().unwrap();
        let (publication, first) =
            Publication::new(&trainable, Device::Cpu, DType::F64, false).unwrap();
        let name = "model.norm.weight";
        let (_, v1) = publication.publish(&trainable, None, 0).unwrap();
        // The engine still generates with version 0 (its swap to 1 is held): version 2
        // must not overwrite version 0's buffers.
        let (_, v2) = publication.publish(&trainable, None, 0).unwrap();
        let ids = [&first, &v1, &v2].map(|w| w.tensors()[name].id());
        assert!(ids[2] != ids[0] && ids[2] != ids[1], "{ids:?}");
    }
}
