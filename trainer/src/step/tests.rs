//! The step loop's own tests: warm-up position, variance study, allocation, GRESO, one
//! step off-policy, non-finite steps.

use super::*;
use crate::data::builtin_task;
use crate::group::Sample;
use crate::prune::PromptStats;

#[test]
fn the_warm_up_draws_only_demonstrations_and_leaves_the_rl_position() {
    let overrides = [
        "warmup.examples=8".to_string(),
        "warmup.batch_size=4".into(),
    ];
    let cfg = RunConfig::default_with(&overrides).unwrap();
    let policy = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
    let (train, eval) = builtin_task("arithmetic", 64, 4, 0).unwrap();
    let mut trainer = Trainer::new(cfg, &policy, &Device::Cpu, train, eval).unwrap();
    let mut demos = trainer.demo_order.clone();
    for _ in 0..3 {
        trainer.warmup_step().unwrap();
    }
    assert_eq!(
        trainer.order.drawn, 0,
        "RL starts at the first training problem"
    );
    assert_eq!(trainer.demo_order.drawn, 12);
    assert!(demos.next(12).iter().all(|&i| i < 8));
    assert_eq!(trainer.policy_version, 3);
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
    let variance = |rate: f64| {
        let level = trainer.cfg.dppo.level(rate);
        trainer
            .pruning_variance(&groups, 0..4, 4, &level, 16)
            .unwrap()
    };
    assert_eq!(variance(0.0), 0.0, "no pruning, no scatter");
    let (low, high) = (variance(0.25), variance(0.75));
    assert!(
        low > 0.0 && high > 2.0 * low,
        "r_o 0.25: {low}, r_o 0.75: {high}"
    );
}

#[test]
fn greso_draws_until_the_rollout_batch_is_full() {
    let cfg = RunConfig::default_with(&["algorithm=greso".to_string()]).unwrap();
    let policy = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
    let (train, eval) = builtin_task("arithmetic", 256, 4, 0).unwrap();
    let mut trainer = Trainer::new(cfg, &policy, &Device::Cpu, train, eval).unwrap();
    // Every even prompt was all-correct on its last 16 visits: skipped with probability
    // 0.99 (GRESO's floor keeps 1%).
    for p in trainer.train.iter().filter(|p| p.prompt_id % 2 == 0) {
        trainer.greso.visits.insert(p.prompt_id, vec![1.0; 16]);
    }
    let drawn = trainer.draw_and_prune_prompts(0);
    let kept = drawn.w_q.iter().filter(|w| w.is_some()).count();
    assert_eq!(kept, 32, "the rollout batch stays full");
    assert!(
        drawn.problems.len() > 50,
        "about half the drawn prompts are skipped"
    );
    assert_eq!(trainer.order.drawn, drawn.problems.len() as u64);
    // With fewer rollable prompts than a batch, one pass over the training set ends it.
    for p in &trainer.train {
        trainer.greso.visits.insert(p.prompt_id, vec![1.0; 16]);
    }
    let drawn = trainer.draw_and_prune_prompts(0);
    assert_eq!(drawn.problems.len(), 256);
}

#[test]
fn allocation_decides_whether_prompt_pruning_refills_the_batch() {
    let policy = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
    let drawn_and_kept = |allocation: bool| {
        let cfg = RunConfig::default_with(&[
            "dppo.r_q=0.5".to_string(),
            format!("dppo.allocation={allocation}"),
        ])
        .unwrap();
        let (train, eval) = builtin_task("arithmetic", 256, 4, 0).unwrap();
        let mut trainer = Trainer::new(cfg, &policy, &Device::Cpu, train, eval).unwrap();
        // Every prompt seen; the even ones carried no signal: they are the candidates.
        for p in &trainer.train {
            let stats = PromptStats {
                score: if p.prompt_id % 2 == 0 { 0.0 } else { 1.0 },
                last_step: 0,
                visits: 1,
                zero_var_streak: u64::from(p.prompt_id % 2 == 0),
                right: 0.0,
                samples: 0,
                ability_sum: 0.0,
                group_size: 0,
            };
            trainer.history.entries.insert(p.prompt_id, stats);
        }
        // The first draw measures the candidate fraction that sizes the second.
        trainer.draw_and_prune_prompts(0);
        let drawn = trainer.draw_and_prune_prompts(0);
        let kept = drawn.w_q.iter().flatten().count();
        (drawn.problems.len(), kept)
    };
    let (drawn, kept) = drawn_and_kept(true);
    assert!(drawn > 32, "over-drawn: {drawn}");
    assert!(
        (28..=36).contains(&kept),
        "about a full batch rolled out: {kept}"
    );
    let (drawn, kept) = drawn_and_kept(false);
    assert_eq!(drawn, 32);
    assert!(
        (16..32).contains(&kept),
        "pruned prompts are not replaced: {kept}"
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
    let Some(Pending::InFlight(next)) = &trainer.pending else {
        panic!("step 1's rollout is in flight after step 0");
    };
    assert_eq!((next.step, next.version), (1, 1));
    // The engine generates step 1's rollout with version 1 while version 2 is published;
    // the optimizer's next update must not reach the weights the engine holds.
    let published = trainer.store.latest();
    assert_eq!(published.version, 2);
    let before = values(&published.weights);
    assert_eq!(staleness(&trainer.step().unwrap()), 1);
    assert_eq!(values(&published.weights), before);
    assert_ne!(values(&trainer.learner.weights().unwrap()), before);
    let Some(Pending::InFlight(next)) = &trainer.pending else {
        panic!("step 2's rollout is in flight after step 1");
    };
    assert_eq!((next.step, next.version), (2, 2));
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
                    assert!(matches!(trainer.pending, Some(Pending::Done(_))));
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
    let version = trainer.policy_version;
    for skipped in 1..=3u64 {
        // The engine's logprobs of the next step's rollout come back NaN.
        trainer.settle().unwrap();
        let Some(Pending::Done(rollout)) = &mut trainer.pending else {
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
        assert_eq!(trainer.policy_version, version, "nothing new to publish");
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
