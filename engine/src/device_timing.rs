//! Where a forward pass's time goes, for benchmarks. Every pass counts the host's time in the
//! attention backend's calls and in its layer kernels' calls: on a GPU, where the host only
//! queues work, that splits the time to queue a step between the attention's launches, the
//! layer kernels' and the model's own ops (its projections above all), the rest. With
//! `EngineConfig::time_device` the device is also synchronised before and after each layer's
//! attention call, so the host clock between the two reads the attention's whole time; the
//! part after the call returned, the wait, is the device finishing the kernels the call
//! issued last. The synchronisations stall the queue, so the step measured this way is slower
//! than a plain one.

use std::cell::Cell;
use std::time::Instant;

use candle_core::{Device, Result, Tensor};
use dppo_model::{AttentionBackend, CausalLm, LayerKernels, Projection, RopeAt};

use crate::cost::{nanos, IterationCost};

/// `inner` with each attention call's host time added to `host_ns` and each layer kernel
/// call's to `layer_ns`; where `sync` holds the device, each attention call's whole time to
/// `ns` and the wait after it to `wait_ns`.
struct Timed<'a, B> {
    inner: &'a mut B,
    sync: Option<&'a Device>,
    ns: u64,
    wait_ns: u64,
    host_ns: u64,
    layer_ns: Cell<u64>,
}

impl<B: AttentionBackend> Timed<'_, B> {
    /// `call` on the inner backend, timed.
    fn time<T>(&mut self, call: impl FnOnce(&mut B) -> Result<T>) -> Result<T> {
        if let Some(device) = self.sync {
            device.synchronize()?;
        }
        let start = Instant::now();
        let out = call(self.inner)?;
        let issued = Instant::now();
        self.host_ns += nanos(start);
        if let Some(device) = self.sync {
            device.synchronize()?;
            self.ns += nanos(start);
            self.wait_ns += nanos(issued);
        }
        Ok(out)
    }

    /// `call` on the inner backend's layer kernels, its host time counted.
    fn time_kernels<T>(&self, call: impl FnOnce(&dyn LayerKernels) -> Result<T>) -> Result<T> {
        let Some(kernels) = self.inner.layer_kernels() else {
            candle_core::bail!("layer kernels called on a backend without them");
        };
        let start = Instant::now();
        let out = call(kernels);
        self.layer_ns.set(self.layer_ns.get() + nanos(start));
        out
    }
}

impl<B: AttentionBackend> AttentionBackend for Timed<'_, B> {
    fn attend(&mut self, layer_idx: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        self.time(|b| b.attend(layer_idx, q, k, v))
    }

    fn takes_projection(&self, qk_norms: bool) -> bool {
        self.inner.takes_projection(qk_norms)
    }

    fn attend_projected(
        &mut self,
        layer_idx: usize,
        projection: Projection<'_>,
        rope: &RopeAt,
    ) -> Result<Tensor> {
        self.time(|b| b.attend_projected(layer_idx, projection, rope))
    }

    fn packed_seqlens(&self) -> Option<&[usize]> {
        self.inner.packed_seqlens()
    }

    fn layer_kernels(&self) -> Option<&dyn LayerKernels> {
        self.inner
            .layer_kernels()
            .map(|_| self as &dyn LayerKernels)
    }
}

impl<B: AttentionBackend> LayerKernels for Timed<'_, B> {
    fn add_rms_norm(
        &self,
        x: &Tensor,
        residual: Option<&Tensor>,
        weight: &Tensor,
        eps: f64,
    ) -> Result<(Tensor, Tensor)> {
        self.time_kernels(|k| k.add_rms_norm(x, residual, weight, eps))
    }

    fn silu_mul_halves(&self, gate_up: &Tensor) -> Result<Tensor> {
        self.time_kernels(|k| k.silu_mul_halves(gate_up))
    }
}

/// `model`'s forward pass through `backend`, the host's time in its attention and layer
/// kernel calls added to `cost.attention_host_ns` and `cost.layer_host_ns`; with `time`
/// also each attention call's whole time to `cost.attention_ns`, the wait for the device
/// within it to `cost.attention_wait_ns`.
pub(crate) fn forward<B: AttentionBackend>(
    model: &CausalLm,
    (input_ids, positions): (&Tensor, &Tensor),
    backend: &mut B,
    time: bool,
    cost: &mut IterationCost,
) -> Result<Tensor> {
    let mut timed = Timed {
        inner: backend,
        sync: time.then(|| model.device()),
        ns: 0,
        wait_ns: 0,
        host_ns: 0,
        layer_ns: Cell::new(0),
    };
    let hidden = model.forward(input_ids, positions, &mut timed);
    cost.attention_ns += timed.ns;
    cost.attention_wait_ns += timed.wait_ns;
    cost.attention_host_ns += timed.host_ns;
    cost.layer_host_ns += timed.layer_ns.get();
    hidden
}
