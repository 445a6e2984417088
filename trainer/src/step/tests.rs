//! The step loop's own tests: warm-up, variance study, one step off-policy, evaluation
//! between steps, non-finite steps.

use super::*;
use crate::checkpoint;
use crate::data::builtin_task;
use crate::group::{Group, Sample};
use crate::prune::{AlgorithmState, GresoState, PromptHistory};

#[test]
fn warm_up_steps_publish_and_leave_the_rl_position() {
    let overrides = [
        "warmup.examples=8".to_string(),
        "warmup.batch_size=4".into(),
    ];
    let cfg = RunConfig::default_with(&overrides).unwrap();
    let policy = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
    let (train, eval) = builtin_task("arithmetic", 64, 4, 0).unwrap();
    let mut trainer = Trainer::new(cfg, &policy, &Device::Cpu, train, eval).unwrap();
    for _ in 0..3 {
        trainer.warmup_step().unwrap();
    }
    assert_eq!(
        trainer.prompts.state().drawn,
        0,
        "RL starts at the first training problem"
    );
    assert_eq!(trainer.policy_version(), 3);
}

#[test]
fn pruning_variance_is_zero_unpruned_and_grows_with_the_rate() {
    let cfg = RunConfig::default_with(&[]).unwrap();
    let policy = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
    let (train, eval) = builtin_task("arithmetic", 64, 4, 0).unwrap();
    let trainer = Trainer::new(cfg, &policy, &Device::Cpu, train, eval).unwrap();
    // Four groups of 8 distinct completions; group g has g + 1 correct samples. The
    // rollout logprobs are those of a uniform policy, which the random tiny model is close
    // to, so that ratios stay inside the clip range and every completion has a gradient.
    let uniform = -(policy.config.vocab_size as f32).ln();
    let mut groups: Vec<Group> = (0..4u32)
        .map(|g| {
            let samples = (0..8u32)
                .map(|i| Sample {
                    prompt_ids: vec![20, 21 + g],
                    completion_ids: vec![30 + i, 40 + (i + g) % 7],
                    reward: if i <= g { 1.0 } else { 0.0 },
                    rollout_logprobs: vec![uniform, uniform],
                    policy_version: 0,
                })
                .collect();
            Group::new(g as u64, samples)
        })
        .collect();
    compute_advantages(&mut groups, crate::advantages::ScaleRewards::Group);
    let variance = |r_o: f64| {
        let cfg = RunConfig::default_with(&[format!("dppo.r_o={r_o}")]).unwrap();
        let algorithm = prompts::algorithm(&cfg);
        let inputs = variance::VarianceInputs {
            algorithm: algorithm.as_ref(),
            learner: &trainer.learner,
            groups: &groups,
            own: 0..4,
            num_drawn: 4,
            draws: 16,
        };
        variance::pruning_variance(&inputs, |phase| trainer.step_rng(0, phase)).unwrap()
    };
    assert_eq!(variance(0.0), 0.0, "no pruning, no scatter");
    let (low, high) = (variance(0.25), variance(0.75));
    assert!(
        low > 0.0 && high > 2.0 * low,
        "r_o 0.25: {low}, r_o 0.75: {high}"
    );
}

/// A trainer of the random tiny model, 4 prompts a step, with `extra` settings, after
/// one warm-up step: with the KL term on against the initial policy, every RL step then
/// moves the weights whatever the rewards. Its policy is at version 1.
fn small_trainer(extra: &[&str]) -> Trainer {
    let mut overrides = vec![
        "rollout.prompts_per_step=4".to_string(),
        "actor.beta=0.1".into(),
    ];
    overrides.extend(extra.iter().map(|s| s.to_string()));
    let cfg = RunConfig::default_with(&overrides).unwrap();
    let policy = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
    let (train, eval) = builtin_task("arithmetic", 64, 4, 0).unwrap();
    let mut trainer = Trainer::new(cfg, &policy, &Device::Cpu, train, eval).unwrap();
    trainer.warmup_step().unwrap();
    trainer
}

/// Every value of every tensor, by name.
fn values(weights: &dppo_model::Weights) -> BTreeMap<String, Vec<f32>> {
    weights
        .tensors()
        .iter()
        .map(|(n, t)| (n.clone(), t.flatten_all().unwrap().to_vec1().unwrap()))
        .collect()
}

fn staleness(line: &Map<String, Value>) -> u64 {
    line["rollout/staleness"].as_u64().unwrap()
}

#[test]
fn one_step_off_policy_trains_on_the_previous_version_and_gives_the_engine_a_copy() {
    let mut synchronous = small_trainer(&["rollout.one_step_off_policy=false"]);
    for _ in 0..3 {
        assert_eq!(staleness(&synchronous.step().unwrap()), 0);
    }
    let mut trainer = small_trainer(&["rollout.one_step_off_policy=true"]);
    assert_eq!(
        staleness(&trainer.step().unwrap()),
        0,
        "the first step waits"
    );
    let in_flight = |trainer: &mut Trainer| match trainer.rollouts.pending_mut() {
        Some(Pending::InFlight(next)) => next.step_and_version(),
        _ => panic!("the next step's rollout is in flight"),
    };
    assert_eq!(in_flight(&mut trainer), (1, 1));
    // The engine generates step 1's rollout with version 1 while version 2 is published;
    // the optimizer's next update must not reach the weights the engine holds.
    let engine = trainer.engine();
    assert_eq!(engine.policy_version(), 2);
    let published = engine.published_weights();
    let before = values(&published);
    assert_eq!(staleness(&trainer.step().unwrap()), 1);
    assert_eq!(values(&published), before);
    assert_ne!(values(&trainer.learner.weights().unwrap()), before);
    assert_eq!(in_flight(&mut trainer), (2, 2));
    assert_eq!(staleness(&trainer.step().unwrap()), 1);
}

#[test]
fn evaluating_between_off_policy_steps_leaves_the_run_unchanged() {
    let run = |evaluate_after: Option<u64>| {
        let mut trainer = small_trainer(&["rollout.one_step_off_policy=true"]);
        let mut waited = 0.0;
        for step in 0..3 {
            let line = trainer.step().unwrap();
            waited += line["timing_s/gen"].as_f64().unwrap();
            if evaluate_after == Some(step) {
                // Twice, as when a checkpoint follows an evaluation: the finished
                // rollout must survive the second wait.
                for _ in 0..2 {
                    trainer.evaluate().unwrap();
                    let pending = trainer.rollouts.pending_mut();
                    assert!(matches!(pending, Some(Pending::Done(_))));
                }
            }
        }
        assert!(waited > 0.0);
        values(&trainer.learner.weights().unwrap())
    };
    assert_eq!(run(None), run(Some(1)));
}

/// Every optimizer moment, by parameter.
fn moments(trainer: &Trainer) -> BTreeMap<String, (Vec<f32>, Vec<f32>)> {
    let flat = |t: &candle_core::Tensor| t.flatten_all().unwrap().to_vec1().unwrap();
    trainer
        .learner
        .optimizer
        .moments
        .iter()
        .map(|(n, (m, v))| (n.clone(), (flat(m), flat(v))))
        .collect()
}

#[test]
fn non_finite_steps_change_nothing_and_stop_the_run_after_three_in_a_row() {
    let mut trainer = small_trainer(&["rollout.one_step_off_policy=true"]);
    assert_eq!(trainer.cfg.train.max_nonfinite_steps, 3, "the default");
    let line = trainer.step().unwrap();
    assert_eq!(line["train/nonfinite_steps"], 0);
    let good = values(&trainer.learner.weights().unwrap());
    let (good_moments, good_step) = (moments(&trainer), trainer.learner.optimizer.step);
    let version = trainer.policy_version();
    for skipped in 1..=3u64 {
        // The engine's logprobs of the next step's rollout come back NaN.
        trainer.rollouts.settle().unwrap();
        let Some(Pending::Done(rollout)) = trainer.rollouts.pending_mut() else {
            panic!("a finished rollout waits for the next step");
        };
        for sample in rollout.groups.iter_mut().flat_map(|g| g.samples.iter_mut()) {
            sample.rollout_logprobs.fill(f32::NAN);
        }
        let line = trainer.step().unwrap();
        assert_eq!(line["train/nonfinite_steps"], skipped);
        assert_eq!(values(&trainer.learner.weights().unwrap()), good);
        assert_eq!(moments(&trainer), good_moments);
        assert_eq!(trainer.learner.optimizer.step, good_step);
        assert_eq!(trainer.policy_version(), version, "nothing new to publish");
        assert_eq!(trainer.nonfinite_limit().is_some(), skipped == 3);
    }
    let err = trainer.nonfinite_limit().unwrap().to_string();
    assert!(
        err.contains("3 optimizer steps in a row") && err.contains("max_nonfinite_steps"),
        "{err}"
    );
    // The checkpoint written before stopping holds the last good weights.
    let dir = std::env::temp_dir().join(format!("dppo-nonfinite-{}", std::process::id()));
    let ckpt = trainer.save_checkpoint(&dir, 1, None).unwrap();
    let saved = dppo_model::Policy::load(ckpt.to_str().unwrap(), &Device::Cpu).unwrap();
    assert_eq!(values(&saved.weights), good);
    std::fs::remove_dir_all(&dir).unwrap();
    // A finite step resets the streak.
    trainer.step().unwrap();
    assert!(trainer.nonfinite_limit().is_none());
    assert_ne!(values(&trainer.learner.weights().unwrap()), good);
}

#[test]
fn an_empty_training_set_is_a_config_error() {
    let cfg = RunConfig::default_with(&[]).unwrap();
    let policy = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
    let (_, eval) = builtin_task("arithmetic", 0, 4, 0).unwrap();
    let err = Trainer::new(cfg, &policy, &Device::Cpu, Vec::new(), eval)
        .err()
        .unwrap();
    assert!(err.to_string().contains("training set is empty"), "{err}");
}

#[test]
fn a_run_restores_only_its_algorithms_share_of_an_old_checkpoint() {
    // A checkpoint in the format of commit 5c72f55, which carries both the prompt history
    // and GRESO's state whatever the algorithm (tests/resume.rs resumes it bit for bit).
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/checkpoint-5c72f55/step-000002");
    let old: serde_json::Value =
        serde_json::from_str(&checkpoint::read_state(&dir).unwrap()).unwrap();
    let policy = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
    let restored = |algorithm: &str| {
        let cfg = RunConfig::default_with(&[format!("algorithm={algorithm}")]).unwrap();
        let (train, eval) = builtin_task("arithmetic", 64, 4, 0).unwrap();
        let mut trainer = Trainer::new(cfg, &policy, &Device::Cpu, train, eval).unwrap();
        trainer.restore(&dir).unwrap();
        trainer.prompts.state()
    };
    let greso = restored("greso");
    let want: GresoState = serde_json::from_value(old["greso"].clone()).unwrap();
    assert_eq!(
        (greso.algorithm.greso, greso.algorithm.history),
        (Some(want), None)
    );
    let dppo = restored("dppo");
    let want: PromptHistory = serde_json::from_value(old["history"].clone()).unwrap();
    assert_eq!(
        (dppo.algorithm.history, dppo.algorithm.greso),
        (Some(want), None)
    );
    assert_eq!(dppo.drawn, old["drawn"].as_u64().unwrap());
    let grpo = restored("grpo");
    assert_eq!(grpo.algorithm, AlgorithmState::default());
}

#[test]
fn a_restored_off_policy_run_gives_the_engine_a_copy() {
    let off_policy = ["rollout.one_step_off_policy=true"];
    let mut trainer = small_trainer(&off_policy);
    trainer.step().unwrap();
    let dir = std::env::temp_dir().join(format!("dppo-restore-copy-{}", std::process::id()));
    let ckpt = trainer.save_checkpoint(&dir, 1, None).unwrap();
    let mut resumed = small_trainer(&off_policy);
    resumed.restore(&ckpt).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    // The engine generates the next rollout while the optimizer updates the learner's
    // tensors in place: what it generates with must not move.
    let published = values(&resumed.engine().published_weights());
    let var = resumed.learner.vars.values().next().unwrap();
    var.set(&(var.as_tensor() * 2.0).unwrap()).unwrap();
    assert_eq!(values(&resumed.engine().published_weights()), published);
}
