//! Whole runs in process (`dppo_trainer::run`): the files of a run directory, where a run
//! starts and resumes, interruptions and the non-finite stop.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use dppo_trainer::dist::Single;
use dppo_trainer::run::{NoHooks, Resume, Run, RunHooks, RunSummary};
use dppo_trainer::TrainError;
use serde_json::{Map, Value};

/// Small, fast run settings.
const SMALL: [&str; 6] = [
    "warmup.steps=2",
    "data.num_train=64",
    "data.num_eval=8",
    "rollout.prompts_per_step=4",
    "checkpoint.every=2",
    "checkpoint.keep=5",
];

/// Runs the built-in tiny model in the run directory `out` from `resume` with the
/// overrides `sets` (over the built-in default, or a resumed checkpoint's config).
pub(crate) fn run_with(
    out: &Path,
    resume: Resume,
    sets: &[&str],
    hooks: &mut dyn RunHooks,
) -> Result<RunSummary, TrainError> {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let start = resume.resolve(out, None, &sets)?;
    let mut run = Run::new(start, out, None, Arc::new(Single))?;
    run.run_to_end(hooks)
}

/// [`run_with`] from the beginning with [`SMALL`] and `extra`, which must succeed.
pub(crate) fn small_run(out: &Path, extra: &[&str]) -> RunSummary {
    let sets = [&SMALL[..], extra].concat();
    run_with(out, Resume::ByConfig, &sets, &mut NoHooks).unwrap()
}

/// The error and its sources, as the binary prints them.
fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(e) = source {
        text.push_str(&format!(": {e}"));
        source = e.source();
    }
    text
}

fn metrics(out: &Path) -> Vec<Value> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn run_writes_metrics_summary_and_config() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let sets = [
        "warmup.steps=3",
        "steps=3",
        "data.num_train=64",
        "data.num_eval=8",
        "rollout.prompts_per_step=4",
        "eval.every=2",
        "logger=[\"jsonl\", \"tensorboard\"]",
    ];
    let returned = run_with(&out, Resume::ByConfig, &sets, &mut NoHooks).unwrap();
    let lines = metrics(&out);
    assert_eq!(lines.len(), 3);
    for (i, line) in lines.iter().enumerate() {
        assert_eq!(line["step"], i + 1);
        for key in [
            "reward/mean",
            "prune/prompts_kept",
            "prune/completions_kept",
            "pack/density",
            "timing_s/gen",
            "timing_s/train",
            "timing_s/step",
            "actor/lr",
            "perf/gen_tokens_per_s",
            "rollout/all_equal",
        ] {
            assert!(line[key].is_number(), "{key} missing in {line}");
        }
        // One publication per warm-up step and per RL step, in order.
        assert_eq!(line["policy_version"], 3 + i + 1);
        // The built-in task's answers are read in its `Answer: N` format only.
        let rules: Vec<&String> = line
            .as_object()
            .unwrap()
            .keys()
            .filter_map(|k| k.strip_prefix("reward/extracted_by/").map(|_| k))
            .collect();
        assert!(!rules.is_empty(), "{line}");
        let mut counted = 0;
        for key in rules {
            assert!(
                key.ends_with("/answer_line") || key.ends_with("/none"),
                "{key}"
            );
            counted += line[key].as_u64().unwrap();
        }
        assert!(
            counted > 0 && counted % 8 == 0,
            "every sample of n = 8 counted: {line}"
        );
    }
    assert!(lines[1]["eval/acc"].is_number());
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    for key in ["eval_before", "eval_after"] {
        let acc = summary[key].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&acc));
    }
    assert_eq!(summary["algorithm"], "dppo");
    assert_eq!(
        summary,
        returned.to_json(),
        "summary.json is the summary returned"
    );
    assert_eq!((returned.steps, returned.policy_version), (3, 6));
    let svg = std::fs::read_to_string(out.join("metrics.svg")).unwrap();
    assert!(svg.contains("<polyline"));
    let config = std::fs::read_to_string(out.join("config.toml")).unwrap();
    assert!(config.contains("prompts_per_step = 4"));
    assert_tensorboard_matches_jsonl(&out, &lines);
}

/// TensorBoard's own reader finds every numeric metric of `metrics.jsonl` at its step.
fn assert_tensorboard_matches_jsonl(run: &Path, lines: &[Value]) {
    let out = Command::new("python3")
        .arg(crate::util::repo_root().join("tests/tensorboard_reader.py"))
        .arg(run.join("tensorboard"))
        .output()
        .expect("python3 must be installed (with tensorboard: scripts/test installs it)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "tensorboard reader: {stderr}");
    let scalars: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut compared = 0;
    for line in lines {
        let step = line["step"].to_string();
        for (tag, value) in line.as_object().unwrap() {
            let Some(want) = value.as_f64().filter(|_| tag != "step") else {
                continue;
            };
            let got = scalars[tag][&step]
                .as_f64()
                .unwrap_or_else(|| panic!("{tag} at step {step} missing from TensorBoard"));
            // TensorBoard stores f32; compare in f32 (JSON parsing may move an f64 by an ulp).
            assert_eq!(got as f32, want as f32, "{tag} at step {step}");
            compared += 1;
        }
    }
    assert!(compared > 30, "only {compared} scalars compared");
}

/// A run resumed from its step-2 checkpoint with more `steps` continues at step 3 and
/// appends to `metrics.jsonl`. (That it ends with the uninterrupted run's bits is
/// asserted by the CLI tests, one run per process.)
#[test]
fn a_resumed_run_continues_from_its_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    small_run(&out, &["steps=2"]);
    let ckpt = out.join("checkpoints/step-000002");
    let mut hooks = StopAfter {
        after: u64::MAX,
        ..StopAfter::default()
    };
    let summary = run_with(&out, Resume::From(ckpt), &["steps=4"], &mut hooks).unwrap();
    assert_eq!(
        hooks.warmup_steps, 0,
        "a resumed run does not warm up again"
    );
    assert_eq!(hooks.steps, [3, 4]);
    assert_eq!((summary.steps, summary.policy_version), (4, 6));
    let steps: Vec<Value> = metrics(&out).iter().map(|l| l["step"].clone()).collect();
    assert_eq!(
        steps,
        [1, 2, 3, 4],
        "the resumed run appends to metrics.jsonl"
    );
    let config = std::fs::read_to_string(out.join("config.toml")).unwrap();
    assert!(config.contains("steps = 4"), "{config}");
}

/// Where a run starts: `latest` without a checkpoint starts from the beginning, with one
/// continues from the newest; `resume = "auto"` does the same; a named checkpoint must be
/// complete.
#[test]
fn resume_choices_find_the_newest_checkpoint_or_start_afresh() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let sets: Vec<String> = SMALL.iter().map(|s| s.to_string()).collect();
    let fresh = Resume::Latest.resolve(&out, None, &sets).unwrap();
    assert_eq!(fresh.checkpoint, None);
    assert_eq!(fresh.cfg.data.num_eval, 8);
    small_run(&out, &["steps=4"]);
    let newest = out.join("checkpoints/step-000004");
    let latest = Resume::Latest.resolve(&out, None, &[]).unwrap();
    assert_eq!(latest.checkpoint.as_ref(), Some(&newest));
    assert_eq!(latest.cfg.steps, 4, "the checkpoint's own config");
    let auto = ["resume=auto".to_string()];
    let auto = Resume::ByConfig.resolve(&out, None, &auto).unwrap();
    assert_eq!(auto.checkpoint.as_ref(), Some(&newest));
    // Starting afresh over the finished run would overwrite it.
    let err = Resume::ByConfig.resolve(&out, None, &[]).unwrap_err();
    assert!(
        chain(&err).contains("holds an earlier run (metrics.jsonl, checkpoints)"),
        "{}",
        chain(&err)
    );
    let elsewhere = Resume::ByConfig.resolve(&dir.path().join("new"), None, &[]);
    assert_eq!(elsewhere.unwrap().checkpoint, None);
    let missing = out.join("checkpoints/step-000003");
    std::fs::create_dir_all(&missing).unwrap();
    let err = Resume::From(missing).resolve(&out, None, &[]).unwrap_err();
    assert!(chain(&err).contains("manifest.json"), "{}", chain(&err));
    let absent = out.join("checkpoints/step-000099");
    let err = Resume::From(absent).resolve(&out, None, &[]).unwrap_err();
    assert!(
        chain(&err).contains("no such checkpoint directory"),
        "{}",
        chain(&err)
    );
    // A finished run resumed from its last checkpoint trains no more.
    let again = run_with(&out, Resume::Latest, &[], &mut NoHooks).unwrap();
    assert_eq!(again.steps, 4);
    assert_eq!(metrics(&out).len(), 4);
}

/// Stops the run once `after` RL steps are done, counting what it was told.
#[derive(Default)]
struct StopAfter {
    after: u64,
    warmup_steps: u64,
    steps: Vec<u64>,
    interrupted_at: Option<u64>,
}

impl RunHooks for StopAfter {
    fn interrupted(&self) -> bool {
        self.steps.len() as u64 >= self.after
    }

    fn on_warmup_step(&mut self, nll: f64) {
        assert!(nll.is_finite());
        self.warmup_steps += 1;
    }

    fn on_step(&mut self, step: u64, line: &Map<String, Value>) {
        assert_eq!(line["step"], step);
        self.steps.push(step);
    }

    fn on_interrupted(&mut self, step: u64) {
        self.interrupted_at = Some(step);
    }
}

/// An interruption (Ctrl-C of a serving run) ends the RL loop after the current step,
/// with a checkpoint of that step, a metrics line per finished step and a summary.
#[test]
fn an_interrupted_run_stops_after_the_current_step_with_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let mut hooks = StopAfter {
        after: 3,
        ..StopAfter::default()
    };
    let sets = [&SMALL[..], &["steps=100000"]].concat();
    let summary = run_with(&out, Resume::ByConfig, &sets, &mut hooks).unwrap();
    assert_eq!(hooks.warmup_steps, 2);
    assert_eq!(hooks.steps, [1, 2, 3]);
    assert_eq!(hooks.interrupted_at, Some(3));
    assert_eq!(summary.steps, 3);
    dppo_trainer::checkpoint::verify(&out.join("checkpoints/step-000003")).unwrap();
    assert_eq!(metrics(&out).len(), 3, "one metrics line per finished step");
    let written: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(written["steps"], 3);
}

/// A model whose forward pass overflows makes every warm-up step non-finite: after three in
/// a row (`train.max_nonfinite_steps`) the run stops with a clear error and a checkpoint of
/// the untouched weights.
#[test]
fn non_finite_steps_stop_the_run_with_a_checkpoint_of_the_last_good_state() {
    use candle_core::Tensor;
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    let tiny = dppo_model::Policy::load("builtin:tiny", &candle_core::Device::Cpu).unwrap();
    let mut tensors = tiny.weights.tensors().clone();
    let norm = &tensors["model.norm.weight"];
    let inf = Tensor::full(f32::INFINITY, norm.shape(), norm.device()).unwrap();
    tensors.insert("model.norm.weight".into(), inf);
    let weights = dppo_model::Weights::from_tensors(&tiny.config, tensors, "inf").unwrap();
    let policy = dppo_model::Policy::new(tiny.config.clone(), weights, tiny.tokenizer).unwrap();
    policy.save_hf(&model).unwrap();
    let out = dir.path().join("run");
    let model_key = format!("model={}", model.display());
    let sets = [&SMALL[..], &[&model_key, "warmup.steps=10"]].concat();
    let err = run_with(&out, Resume::ByConfig, &sets, &mut NoHooks).unwrap_err();
    let text = chain(&err);
    assert!(
        text.contains("3 optimizer steps in a row")
            && text.contains("the last good state is checkpointed in"),
        "{text}"
    );
    let ckpt = out.join("checkpoints/step-000000");
    dppo_trainer::checkpoint::verify(&ckpt).unwrap();
    let saved = std::fs::read(ckpt.join("model/model.safetensors")).unwrap();
    assert!(saved == std::fs::read(model.join("model.safetensors")).unwrap());
}
