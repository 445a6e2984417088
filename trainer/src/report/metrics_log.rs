//! Where a run's per-step metrics go: `metrics.jsonl` always (the plot, `dppo compare` and
//! resumed runs read it), and TensorBoard event files under `tensorboard/` when the config's
//! `logger` lists `tensorboard` (verl's `trainer.logger` vocabulary).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::report::tensorboard::EventWriter;

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
#[error("writing metrics to {}: {source}", path.display())]
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
    /// Opens the sinks of `loggers` in the run directory `out`: `metrics.jsonl` from
    /// scratch, or, for a run resumed at step `resumed_at`, cut back to the lines of steps up
    /// to it (a run killed after its last checkpoint wrote later ones, and writes them again)
    /// and appended to; a new TensorBoard event file either way.
    pub fn open(
        out: &Path,
        loggers: &[Logger],
        resumed_at: Option<u64>,
    ) -> Result<Self, MetricsError> {
        let jsonl_path = out.join(METRICS_JSONL);
        let named = |path: &Path| {
            let path = path.to_path_buf();
            move |source| MetricsError { path, source }
        };
        if let Some(step) = resumed_at {
            keep_lines_until(&jsonl_path, step).map_err(named(&jsonl_path))?;
        }
        let jsonl = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .append(resumed_at.is_some())
            .truncate(resumed_at.is_none())
            .open(&jsonl_path)
            .map_err(named(&jsonl_path))?;
        let tensorboard = if loggers.contains(&Logger::Tensorboard) {
            let dir = out.join("tensorboard");
            Some(EventWriter::create(&dir).map_err(named(&dir))?)
        } else {
            None
        };
        Ok(Self {
            jsonl_path,
            jsonl,
            tensorboard,
        })
    }

    /// Writes one step's metrics to every sink and flushes them. A line goes to
    /// `metrics.jsonl` whole or not at all: a failed write (disk full, file too large) is
    /// cut back off. TensorBoard gets every numeric metric as a scalar tagged with its name,
    /// at the line's `step`.
    pub fn write(&mut self, line: &Map<String, Value>) -> Result<(), MetricsError> {
        let mut text = serde_json::to_string(line).expect("a JSON map always serialises");
        text.push('\n');
        let len = self.jsonl.metadata().map(|m| m.len());
        let written = self
            .jsonl
            .write_all(text.as_bytes())
            .and_then(|()| self.jsonl.flush());
        if let Err(source) = written {
            if let Ok(len) = len {
                // Best effort: the error below is what the caller must see.
                let _ = self.jsonl.set_len(len);
            }
            return Err(MetricsError {
                path: self.jsonl_path.clone(),
                source,
            });
        }
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

/// Drops the lines of steps after `step` from `path`, and a torn last line (atomically);
/// a missing file is left missing.
fn keep_lines_until(path: &Path, step: u64) -> std::io::Result<()> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    let kept: String = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<Value>(l)
                .is_ok_and(|v| v["step"].as_u64().is_some_and(|s| s <= step))
        })
        .flat_map(|l| [l, "\n"])
        .collect();
    if kept.len() != text.len() {
        dppo_model::weights::write_atomic(path, kept.as_bytes())
            .map_err(|e| std::io::Error::other(e.to_string()))?;
    }
    Ok(())
}
