//! Where a run's per-step metrics go: `metrics.jsonl` always (the plot, `dppo compare` and
//! resumed runs read it), and TensorBoard event files under `tensorboard/` when the config's
//! `logger` lists `tensorboard` (verl's `trainer.logger` vocabulary).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::tensorboard::EventWriter;

/// A metrics sink named in `logger`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Logger {
    /// One JSON object per step in `metrics.jsonl`.
    Jsonl,
    /// Scalars in `tensorboard/events.out.tfevents.*`.
    Tensorboard,
}

/// A metrics file that cannot be opened or written, naming it.
#[derive(Debug, thiserror::Error)]
#[error("metrics {path}: {source}")]
pub struct MetricsError {
    path: PathBuf,
    source: std::io::Error,
}

/// The open sinks of a run.
pub struct MetricsLog {
    jsonl_path: PathBuf,
    jsonl: File,
    tensorboard: Option<EventWriter>,
}

/// The name of the per-step metrics file in a run directory.
pub const METRICS_JSONL: &str = "metrics.jsonl";

impl MetricsLog {
    /// Opens the sinks of `loggers` in the run directory `out`: `metrics.jsonl` truncated,
    /// or appended to when `resume`; a new TensorBoard event file either way.
    pub fn open(out: &Path, loggers: &[Logger], resume: bool) -> Result<Self, MetricsError> {
        let jsonl_path = out.join(METRICS_JSONL);
        let jsonl = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(resume)
            .truncate(!resume)
            .open(&jsonl_path)
            .map_err(|source| MetricsError {
                path: jsonl_path.clone(),
                source,
            })?;
        let tensorboard = if loggers.contains(&Logger::Tensorboard) {
            let dir = out.join("tensorboard");
            Some(EventWriter::create(&dir).map_err(|source| MetricsError { path: dir, source })?)
        } else {
            None
        };
        Ok(Self {
            jsonl_path,
            jsonl,
            tensorboard,
        })
    }

    /// Writes one step's metrics to every sink and flushes them; TensorBoard gets every
    /// numeric metric as a scalar tagged with its name, at the line's `step`.
    pub fn write(&mut self, line: &Map<String, Value>) -> Result<(), MetricsError> {
        let text = format!("{}\n", Value::Object(line.clone()));
        self.jsonl
            .write_all(text.as_bytes())
            .and_then(|()| self.jsonl.flush())
            .map_err(|source| MetricsError {
                path: self.jsonl_path.clone(),
                source,
            })?;
        if let Some(tb) = &mut self.tensorboard {
            let step = line.get("step").and_then(Value::as_u64).unwrap_or(0);
            let scalars = line
                .iter()
                .filter(|(k, _)| k.as_str() != "step")
                .filter_map(|(k, v)| Some((k.as_str(), v.as_f64()?)));
            tb.scalars(step, scalars).map_err(|source| MetricsError {
                path: tb.path().to_path_buf(),
                source,
            })?;
        }
        Ok(())
    }
}
