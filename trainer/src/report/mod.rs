//! Reporting: what a run shows of itself. Per-step metrics to `metrics.jsonl` and TensorBoard
//! event files, the SVG charts of a run's metrics, and `dppo compare`'s time-to-accuracy
//! table and overlay of several runs.

pub mod compare;
pub mod metrics_log;
pub mod plot;
pub mod tensorboard;
