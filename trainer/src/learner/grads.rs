//! Gradients by parameter name: accumulated over buffers, taken from the training layers'
//! store, all-reduced between ranks in buckets.

use std::collections::BTreeMap;

use candle_core::{Tensor, Var};
use dppo_model::train_layer::LayerGrads;

use crate::dist::Collective;
use crate::TrainError;

/// All-reduces one bucket of gradients (flattened into one tensor) and puts each back into
/// `grads` in its own shape and storage.
pub(super) fn reduce_bucket(
    coll: &dyn Collective,
    bucket: Vec<(String, Tensor)>,
    grads: &mut BTreeMap<String, Tensor>,
) -> Result<(), TrainError> {
    let flat: Vec<Tensor> = bucket
        .iter()
        .map(|(_, g)| g.flatten_all())
        .collect::<candle_core::Result<_>>()?;
    let summed = coll.all_reduce_sum_tensor(&Tensor::cat(&flat, 0)?)?;
    let mut offset = 0;
    for (name, g) in bucket {
        let n = g.elem_count();
        let reduced = summed.narrow(0, offset, n)?.reshape(g.shape())?.copy()?;
        grads.insert(name, reduced);
        offset += n;
    }
    Ok(())
}

/// Adds the gradients in `store` of every var to `grads`.
pub(super) fn accumulate(
    grads: &mut BTreeMap<String, Tensor>,
    vars: &BTreeMap<String, Var>,
    store: &candle_core::backprop::GradStore,
) -> Result<(), TrainError> {
    for (name, var) in vars {
        if let Some(g) = store.get(var) {
            add_grad(grads, name, g.clone())?;
        }
    }
    Ok(())
}

/// Moves the gradients the training layers summed in `layer_grads` into `grads`. Every
/// one must belong to a var: one that does not would be a gradient silently lost.
pub(super) fn take_layer_grads(
    grads: &mut BTreeMap<String, Tensor>,
    vars: &BTreeMap<String, Var>,
    layer_grads: &LayerGrads,
) -> Result<(), TrainError> {
    for (name, var) in vars {
        if let Some(g) = layer_grads.take(var.as_tensor())? {
            add_grad(grads, name, g)?;
        }
    }
    match layer_grads.len() {
        0 => Ok(()),
        n => Err(candle_core::Error::Msg(format!(
            "the training layers computed {n} gradients of tensors that are not parameters"
        ))
        .into()),
    }
}

/// `grads[name] += g` (or `= g` where there is none yet).
fn add_grad(grads: &mut BTreeMap<String, Tensor>, name: &str, g: Tensor) -> Result<(), TrainError> {
    let sum = match grads.remove(name) {
        Some(acc) => (acc + g)?,
        None => g,
    };
    grads.insert(name.to_string(), sum);
    Ok(())
}
