//! `dppo compare`: several run directories side by side. The time-to-accuracy table (RL
//! seconds per step, RL time until each run reaches the first run's final held-out accuracy,
//! final accuracies, completions trained) and one SVG overlaying their held-out accuracy and
//! reward against RL time and step.
//!
//! "Final accuracy" is read two ways: the last evaluation (`summary.json`'s `eval_after`) and
//! the mean of the last [`WINDOW`] periodic evaluations. The policy moves by a few points
//! from one evaluation to the next, so the second is the steadier target; time to it is RL
//! time until the trailing mean of [`WINDOW`] evaluations first reaches it.

use std::fmt::Write;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::report::metrics_log::METRICS_JSONL;
use crate::report::plot::{Figure, Panel, Series, PALETTE};

/// Evaluations averaged for the steadier "final accuracy".
pub const WINDOW: usize = 10;

/// The file `dppo run` writes its algorithm and final accuracies to.
const SUMMARY_JSON: &str = "summary.json";

/// A run directory that cannot be compared, naming the file and what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    /// A file of the run is missing or unreadable (the I/O error is part of the message,
    /// not a separate source, so that error chains print it once).
    #[error("{path}: {error} (is {dir} a `dppo run` output directory?)")]
    Read {
        path: PathBuf,
        dir: PathBuf,
        error: std::io::Error,
    },
    /// A file of the run does not hold what `dppo run` writes.
    #[error("{path}: {reason}")]
    Parse { path: PathBuf, reason: String },
}

/// What the comparison reads of one metrics line.
#[derive(Debug, Clone, PartialEq)]
pub struct StepLine {
    /// RL step number.
    pub step: u64,
    /// RL seconds the step took (`timing_s/step`).
    pub seconds: f64,
    /// Mean reward of the step's rollouts (`reward/mean`).
    pub reward: Option<f64>,
    /// Fraction of completions trained on (`prune/completions_kept`).
    pub completions_kept: f64,
    /// Held-out accuracy when the step was followed by an evaluation (`eval/acc`).
    pub eval_acc: Option<f64>,
}

/// One run directory, parsed.
#[derive(Debug, Clone, PartialEq)]
pub struct Run {
    /// The directory's name, which names the run in the table and legend.
    pub name: String,
    /// The algorithm from `summary.json`.
    pub algorithm: String,
    /// Held-out accuracy before RL.
    pub eval_before: f64,
    /// Held-out accuracy after the last step.
    pub eval_after: f64,
    /// Every line of `metrics.jsonl`, in order.
    pub steps: Vec<StepLine>,
}

/// One evaluation after a step: RL seconds elapsed up to it, its step and the accuracy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalPoint {
    /// RL seconds from the first step through this one.
    pub seconds: f64,
    /// The step the evaluation followed.
    pub step: u64,
    /// Held-out accuracy.
    pub acc: f64,
}

impl Run {
    /// Reads `dir/metrics.jsonl` and `dir/summary.json`.
    pub fn load(dir: &Path) -> Result<Run, CompareError> {
        let read = |file: &str| {
            let path = dir.join(file);
            std::fs::read_to_string(&path).map_err(|error| CompareError::Read {
                path,
                dir: dir.to_path_buf(),
                error,
            })
        };
        Run::parse(dir, &read(METRICS_JSONL)?, &read(SUMMARY_JSON)?)
    }

    /// The run of directory `dir` from the texts of its metrics and summary files.
    pub fn parse(dir: &Path, metrics: &str, summary: &str) -> Result<Run, CompareError> {
        let error = |file: &str, reason: String| CompareError::Parse {
            path: dir.join(file),
            reason,
        };
        let steps = metrics
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                step_line(l).map_err(|e| error(METRICS_JSONL, format!("line {}: {e}", i + 1)))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if steps.is_empty() {
            return Err(error(METRICS_JSONL, "no RL step".into()));
        }
        let summary: Value =
            serde_json::from_str(summary).map_err(|e| error(SUMMARY_JSON, e.to_string()))?;
        let number = |key: &str| {
            summary[key]
                .as_f64()
                .ok_or_else(|| error(SUMMARY_JSON, format!("no number {key}")))
        };
        Ok(Run {
            name: run_name(dir),
            algorithm: summary["algorithm"]
                .as_str()
                .ok_or_else(|| error(SUMMARY_JSON, "no string algorithm".into()))?
                .to_string(),
            eval_before: number("eval_before")?,
            eval_after: number("eval_after")?,
            steps,
        })
    }

    /// RL seconds elapsed at the end of each step.
    pub fn elapsed(&self) -> Vec<f64> {
        let mut elapsed = 0.0;
        self.steps
            .iter()
            .map(|s| {
                elapsed += s.seconds;
                elapsed
            })
            .collect()
    }

    /// Every evaluation after a step, in order: the periodic ones, then the final one
    /// (`eval_after`) where the last step had none (a run shorter than `eval.every`, or
    /// with `eval.every = 0`).
    pub fn evals(&self) -> Vec<EvalPoint> {
        let elapsed = self.elapsed();
        let mut points: Vec<EvalPoint> = self
            .steps
            .iter()
            .zip(elapsed.iter().copied())
            .filter_map(|(s, seconds)| {
                Some(EvalPoint {
                    seconds,
                    step: s.step,
                    acc: s.eval_acc?,
                })
            })
            .collect();
        if let (Some(last), Some(&seconds)) = (self.steps.last(), elapsed.last()) {
            if last.eval_acc.is_none() {
                points.push(EvalPoint {
                    seconds,
                    step: last.step,
                    acc: self.eval_after,
                });
            }
        }
        points
    }

    /// Mean RL seconds per step.
    pub fn seconds_per_step(&self) -> f64 {
        mean(self.steps.iter().map(|s| s.seconds))
    }

    /// Mean fraction of completions trained on per step.
    pub fn completions_trained(&self) -> f64 {
        mean(self.steps.iter().map(|s| s.completions_kept))
    }
}

/// The last component of `dir` (of its absolute path for `.` and `..`), as `runs/a` is `a`.
fn run_name(dir: &Path) -> String {
    let named = |p: &Path| Some(p.file_name()?.to_string_lossy().into_owned());
    named(dir)
        .or_else(|| named(&dir.canonicalize().ok()?))
        .unwrap_or_else(|| dir.display().to_string())
}

fn step_line(line: &str) -> Result<StepLine, String> {
    let v: Value = serde_json::from_str(line).map_err(|e| e.to_string())?;
    let number = |key: &str| v.get(key).and_then(Value::as_f64);
    let need = |key: &str| number(key).ok_or_else(|| format!("no number {key}"));
    Ok(StepLine {
        step: v["step"].as_u64().ok_or("no step number")?,
        seconds: need("timing_s/step")?,
        reward: number("reward/mean"),
        completions_kept: need("prune/completions_kept")?,
        eval_acc: number("eval/acc"),
    })
}

fn mean(values: impl ExactSizeIterator<Item = f64>) -> f64 {
    let n = values.len();
    values.sum::<f64>() / n as f64
}

/// The first (seconds, step) at which the mean of the last `window` evaluations reaches
/// `target` (up to 1e-12, so that a run reaches its own value); `None` when it never does.
/// A window of 0 counts as 1, and one longer than the run's evaluations as all of them (as
/// [`tail_mean`] takes them).
pub fn time_to(points: &[EvalPoint], target: f64, window: usize) -> Option<(f64, u64)> {
    let window = window.min(points.len()).max(1);
    points.windows(window).find_map(|w| {
        let mean = w.iter().map(|p| p.acc).sum::<f64>() / window as f64;
        let last = w[window - 1];
        (mean >= target - 1e-12).then_some((last.seconds, last.step))
    })
}

/// Mean accuracy of the last `window` evaluations (all of them when there are fewer; NaN
/// when there are none).
pub fn tail_mean(points: &[EvalPoint], window: usize) -> f64 {
    mean(
        points[points.len().saturating_sub(window)..]
            .iter()
            .map(|p| p.acc),
    )
}

/// The markdown comparison of `runs`, the first being the baseline whose targets the others
/// race to: a line naming the targets, then one table row per run.
pub fn table(runs: &[Run]) -> String {
    let Some(base) = runs.first() else {
        return String::new();
    };
    let base_points = base.evals();
    let target = base.eval_after;
    let smooth_target = tail_mean(&base_points, WINDOW);
    let base_time = time_to(&base_points, target, 1).map(|(t, _)| t);
    let base_smooth = time_to(&base_points, smooth_target, WINDOW).map(|(t, _)| t);
    let base_per_step = base.seconds_per_step();
    let mut out = format!(
        "Targets: {}'s last evaluation, {:.1}%, and the mean of its last {WINDOW} \
         evaluations, {:.1}%.\n\n",
        base.name,
        100.0 * target,
        100.0 * smooth_target
    );
    out.push_str(
        "| run | algorithm | RL s/step | speed-up per step | time to last-eval target (step) \
         | speed-up | time to mean target (step) | speed-up | held-out before -> last ",
    );
    let _ = writeln!(out, "| mean of last {WINDOW} | completions trained |");
    out.push_str("|---|---|---|---|---|---|---|---|---|---|---|\n");
    for run in runs {
        let points = run.evals();
        let per_step = run.seconds_per_step();
        let _ = writeln!(
            out,
            "| {} | {} | {per_step:.3} | {:.2}x | {} | {} | {:.1}% -> {:.1}% | {:.1}% | {:.1}% |",
            run.name,
            run.algorithm,
            base_per_step / per_step,
            reach(time_to(&points, target, 1), base_time),
            reach(time_to(&points, smooth_target, WINDOW), base_smooth),
            100.0 * run.eval_before,
            100.0 * run.eval_after,
            100.0 * tail_mean(&points, WINDOW),
            100.0 * run.completions_trained()
        );
    }
    out
}

/// The "time (step) | speed-up" cells of reaching a target, the speed-up against the
/// baseline's time (`-` when the baseline has none).
fn reach(hit: Option<(f64, u64)>, base: Option<f64>) -> String {
    let Some((t, step)) = hit else {
        return "not reached | -".into();
    };
    let speed = match base {
        Some(b) if b != 0.0 => format!("{:.2}x", b / t),
        _ => "-".into(),
    };
    format!("{t:.1} s (step {step}) | {speed}")
}

/// The points of one run in one panel.
type Points<'a> = &'a dyn Fn(&Run) -> Vec<(f64, f64)>;

/// Points drawn per run for reward, which is noisy step to step: the overlay shows means of
/// blocks of steps so that several runs stay readable.
const REWARD_POINTS: usize = 100;

/// The SVG overlaying the runs' held-out accuracy and reward (means of blocks of steps)
/// against RL time and step, one colour per run, the legend naming the runs.
pub fn svg(runs: &[Run]) -> String {
    let longest = runs.iter().map(|r| r.steps.len()).max().unwrap_or(0);
    let block = longest.div_ceil(REWARD_POINTS).max(1);
    let reward_title = match block {
        1 => "mean reward".to_string(),
        _ => format!("mean reward (means of {block} steps)"),
    };
    let colour = |i: usize| PALETTE[i % PALETTE.len()];
    let panel = |title: &str, y_title: &str, x_title: &str, points: Points| Panel {
        title: title.into(),
        x_title: x_title.into(),
        y_title: y_title.into(),
        series: runs
            .iter()
            .enumerate()
            .map(|(i, run)| Series {
                name: run.name.clone(),
                colour: colour(i),
                points: points(run),
            })
            .collect(),
        legend: false,
    };
    let acc_time = |r: &Run| r.evals().iter().map(|p| (p.seconds, p.acc)).collect();
    let acc_step = |r: &Run| r.evals().iter().map(|p| (p.step as f64, p.acc)).collect();
    let reward = |r: &Run, x: &dyn Fn(usize) -> f64| {
        let points: Vec<_> = (r.steps.iter().enumerate())
            .filter_map(|(i, s)| Some((x(i), s.reward?)))
            .collect();
        block_means(&points, block)
    };
    let reward_time = |r: &Run| {
        let elapsed = r.elapsed();
        reward(r, &|i| elapsed[i])
    };
    let reward_step = |r: &Run| reward(r, &|i| r.steps[i].step as f64);
    Figure {
        panels: vec![
            panel("held-out accuracy", "accuracy", "RL seconds", &acc_time),
            panel("held-out accuracy", "accuracy", "step", &acc_step),
            panel(&reward_title, "mean reward", "RL seconds", &reward_time),
            panel(&reward_title, "mean reward", "step", &reward_step),
        ],
        columns: 2,
        legend: runs
            .iter()
            .enumerate()
            .map(|(i, r)| (r.name.clone(), colour(i)))
            .collect(),
    }
    .to_svg()
}

/// The mean point of each block of `block` consecutive points (the last block may be
/// shorter).
fn block_means(points: &[(f64, f64)], block: usize) -> Vec<(f64, f64)> {
    let mean_point = |c: &[(f64, f64)]| {
        let n = c.len() as f64;
        let (x, y) = c.iter().fold((0.0, 0.0), |(x, y), p| (x + p.0, y + p.1));
        (x / n, y / n)
    };
    points.chunks(block).map(mean_point).collect()
}

#[cfg(test)]
mod tests;
