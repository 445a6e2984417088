//! Where an engine's iterations spend their time and what they move between host and
//! device, counted by the worker and the runner and read through `EngineStats::cost`.

use std::time::Instant;

/// An engine's iterations broken down, summed: the shape of a step on a device. On a GPU
/// the forward pass is queued asynchronously, so `forward_ns` is the host's cost of queueing
/// it (launches, uploads) and the wait for the device falls in `fetch_ns` (host sampling) or
/// `sample_ns` (device sampling); with `EngineConfig::time_device` it is in `forward_ns`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IterationCost {
    /// Scheduling: the plan, preemptions, block tables.
    pub schedule_ns: u64,
    /// Building the inputs and queueing the forward pass and the logits.
    pub forward_ns: u64,
    /// Waiting for the device and copying the sampled rows' logits to the host (host
    /// sampling).
    pub fetch_ns: u64,
    /// Sampling: on the host, or on the device with the wait for it and the draws' copy.
    pub sample_ns: u64,
    /// Appending the sampled tokens to their sequences (forks, finishes). Stop strings and
    /// streaming come after the iteration is counted, so that a caller holding its last
    /// token sees the iteration in the stats, and are not in any field.
    pub emit_ns: u64,
    /// Bytes the engine uploads (ids, positions, attention indices and masks).
    pub h2d_bytes: u64,
    /// Bytes the engine downloads (the logits rows).
    pub d2h_bytes: u64,
    /// With `EngineConfig::time_device`: the attention's time, the device synchronised
    /// before and after each layer's call (a part of `forward_ns`); else 0.
    pub attention_ns: u64,
    /// The part of `attention_ns` after each call returned: the wait for the kernels it
    /// issued last (on a GPU about their device time, plus a synchronisation's latency).
    pub attention_wait_ns: u64,
    /// The host's time in the attention backend's calls (a part of `forward_ns`): on a GPU
    /// the cost of queueing the attention's ops, and with `time_device` the part of
    /// `attention_ns` before the wait.
    pub attention_host_ns: u64,
    /// The host's time in the layer kernels' calls (`engine.layer_kernels`; a part of
    /// `forward_ns`). What `forward_ns` holds besides the two is the model's own ops: the
    /// embedding, the rotary tables, the projections and the lm-head.
    pub layer_host_ns: u64,
    /// Tensor ops or kernels the attention backend issues, counted where it issues them
    /// (the model's matmuls and norms, the same on every backend, are not counted).
    pub attention_ops: u64,
    /// Launches of the layer kernels (`engine.layer_kernels`), which take the place of the
    /// model's norms, residual adds and gated products.
    pub layer_ops: u64,
    /// Times the host waits for the device (copies to the host).
    pub syncs: u64,
    /// Decode steps padded to a bucket for a captured graph (`engine.cuda_graphs`).
    pub padded_steps: u64,
    /// Of those, the steps replayed from a graph captured before (the rest were run and
    /// captured); their launches are counted as the capture issued them.
    pub graph_replays: u64,
    /// Sequences scheduled (a forking group's prefill row counts once).
    pub seqs: u64,
    /// Key/value positions the attention reads: each scheduled sequence's whole context, a
    /// block shared by several (a group's prompt) once. With the weights, the bytes a
    /// decode step must at least move.
    pub kv_tokens: u64,
}

impl IterationCost {
    /// What was added since `earlier` (a snapshot of the same engine's counters).
    pub fn since(&self, earlier: &Self) -> Self {
        Self {
            schedule_ns: self.schedule_ns - earlier.schedule_ns,
            forward_ns: self.forward_ns - earlier.forward_ns,
            fetch_ns: self.fetch_ns - earlier.fetch_ns,
            sample_ns: self.sample_ns - earlier.sample_ns,
            emit_ns: self.emit_ns - earlier.emit_ns,
            attention_ns: self.attention_ns - earlier.attention_ns,
            attention_wait_ns: self.attention_wait_ns - earlier.attention_wait_ns,
            attention_host_ns: self.attention_host_ns - earlier.attention_host_ns,
            layer_host_ns: self.layer_host_ns - earlier.layer_host_ns,
            h2d_bytes: self.h2d_bytes - earlier.h2d_bytes,
            d2h_bytes: self.d2h_bytes - earlier.d2h_bytes,
            attention_ops: self.attention_ops - earlier.attention_ops,
            layer_ops: self.layer_ops - earlier.layer_ops,
            syncs: self.syncs - earlier.syncs,
            padded_steps: self.padded_steps - earlier.padded_steps,
            graph_replays: self.graph_replays - earlier.graph_replays,
            seqs: self.seqs - earlier.seqs,
            kv_tokens: self.kv_tokens - earlier.kv_tokens,
        }
    }

    /// Adds `other` (one iteration) to the sums.
    pub(crate) fn add(&mut self, other: &Self) {
        self.schedule_ns += other.schedule_ns;
        self.forward_ns += other.forward_ns;
        self.fetch_ns += other.fetch_ns;
        self.sample_ns += other.sample_ns;
        self.emit_ns += other.emit_ns;
        self.attention_ns += other.attention_ns;
        self.attention_wait_ns += other.attention_wait_ns;
        self.attention_host_ns += other.attention_host_ns;
        self.layer_host_ns += other.layer_host_ns;
        self.h2d_bytes += other.h2d_bytes;
        self.d2h_bytes += other.d2h_bytes;
        self.attention_ops += other.attention_ops;
        self.layer_ops += other.layer_ops;
        self.syncs += other.syncs;
        self.padded_steps += other.padded_steps;
        self.graph_replays += other.graph_replays;
        self.seqs += other.seqs;
        self.kv_tokens += other.kv_tokens;
    }
}

/// Nanoseconds since `start`.
pub(crate) fn nanos(start: Instant) -> u64 {
    start.elapsed().as_nanos() as u64
}
