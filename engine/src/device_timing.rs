//! The attention's share of a forward pass on a device, for benchmarks
//! (`EngineConfig::time_device`): the device is synchronised before and after each layer's
//! attention call, so the host clock between the two reads the attention's whole time, the
//! host issuing its ops included; the part after the call returned, the wait, is the device
//! finishing the kernels the call issued last. The synchronisations stall the queue, so the
//! step measured this way is slower than a plain one.

use std::time::Instant;

use candle_core::{Device, Result, Tensor};
use dppo_model::{AttentionBackend, CausalLm, LayerKernels, RopeAt};

use crate::cost::{nanos, IterationCost};

/// `inner` with each attention call's time added to `ns`, and the wait after it to `wait_ns`.
struct Timed<'a, B> {
    inner: &'a mut B,
    device: &'a Device,
    ns: u64,
    wait_ns: u64,
}

impl<B: AttentionBackend> Timed<'_, B> {
    /// `call` on the inner backend, timed.
    fn time<T>(&mut self, call: impl FnOnce(&mut B) -> Result<T>) -> Result<T> {
        self.device.synchronize()?;
        let start = Instant::now();
        let out = call(self.inner)?;
        let issued = Instant::now();
        self.device.synchronize()?;
        self.ns += nanos(start);
        self.wait_ns += nanos(issued);
        Ok(out)
    }
}

impl<B: AttentionBackend> AttentionBackend for Timed<'_, B> {
    fn attend(&mut self, layer_idx: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        self.time(|b| b.attend(layer_idx, q, k, v))
    }

    fn takes_projection(&self) -> bool {
        self.inner.takes_projection()
    }

    fn attend_projected(
        &mut self,
        layer_idx: usize,
        qkv: &Tensor,
        bias: Option<&Tensor>,
        rope: &RopeAt,
    ) -> Result<Tensor> {
        self.time(|b| b.attend_projected(layer_idx, qkv, bias, rope))
    }

    fn packed_seqlens(&self) -> Option<&[usize]> {
        self.inner.packed_seqlens()
    }

    fn layer_kernels(&self) -> Option<&dyn LayerKernels> {
        self.inner.layer_kernels()
    }
}

/// `model`'s forward pass through `backend`; with `time` its attention's time is added to
/// `cost.attention_ns`, the wait for the device within it to `cost.attention_wait_ns`.
pub(crate) fn forward<B: AttentionBackend>(
    model: &CausalLm,
    (input_ids, positions): (&Tensor, &Tensor),
    backend: &mut B,
    time: bool,
    cost: &mut IterationCost,
) -> Result<Tensor> {
    if !time {
        return model.forward(input_ids, positions, backend);
    }
    let mut timed = Timed {
        inner: backend,
        device: model.device(),
        ns: 0,
        wait_ns: 0,
    };
    let hidden = model.forward(input_ids, positions, &mut timed);
    cost.attention_ns += timed.ns;
    cost.attention_wait_ns += timed.wait_ns;
    hidden
}
