//! The DPPO learner: GRPO at zero rates, Monte-Carlo unbiasedness of pruning (with proof of
//! power against the biased baselines), packing invariance, and learning progress.

use std::collections::BTreeMap;

use candle_core::{Device, Tensor};
use dppo_model::ops::token_logprobs;
use dppo_model::{Arch, CausalAttention, CausalLm};
use dppo_trainer::learner::{Learner, LearnerConfig};
use dppo_trainer::loss::LossAgg;
use dppo_trainer::prune::{
    cppo_completions, full_batch_normalisers, prune_completions, Algorithm, BatchShape,
    CandidateRule, CompletionScope, Cppo, Kept, LevelConfig, PromptHistory, PromptPredictor,
    PruneMode, PruningAlgorithm,
};
use dppo_trainer::train_batch::{build_train_batch, TrainBatch};
use dppo_trainer::{compute_advantages, Group, Sample, ScaleRewards};
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::util::{random_weights, small_config};

mod unbiased;

const G: usize = 4;
const MAX_LEN: usize = 6;

fn learner(agg: LossAgg, pack_tokens: usize) -> Learner {
    let cfg = small_config(Arch::Llama);
    let weights = random_weights(&cfg, 5);
    let mut lc = LearnerConfig::token_mean(1e-2, 0.0, pack_tokens, 8);
    lc.loss.loss_agg = agg;
    Learner::new(&cfg, &weights, lc).unwrap()
}

/// Completion-token logprobs of `prompt + completion` under `model`, one sequence alone.
fn logprobs_of(model: &CausalLm, prompt: &[u32], completion: &[u32]) -> Vec<f32> {
    let ids: Vec<u32> = prompt.iter().chain(completion).copied().collect();
    let n = ids.len();
    let t = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
    let pos = Tensor::arange(0u32, n as u32, &Device::Cpu).unwrap();
    let h = model.forward(&t, &pos, &mut CausalAttention).unwrap();
    let p = prompt.len();
    let logits = model.logits(&h.narrow(0, p - 1, n - p).unwrap()).unwrap();
    token_logprobs(&logits, &t.narrow(0, p, n - p).unwrap())
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// A fixed batch: 6 prompts x G samples, 0/1 rewards (two groups without signal), rollout
/// logprobs near the model's (so that some ratios clip).
pub(crate) fn batch(model: &CausalLm) -> Vec<Group> {
    let mut rng = StdRng::seed_from_u64(9);
    let vocab = model.config().vocab_size as u32;
    let rewards = [
        [1., 0., 0., 1.],
        [1., 1., 1., 1.],
        [0., 0., 1., 0.],
        [0., 0., 0., 0.],
        [1., 1., 0., 1.],
        [0., 1., 1., 0.],
    ];
    let mut groups: Vec<Group> = rewards
        .iter()
        .enumerate()
        .map(|(j, rs)| {
            let prompt: Vec<u32> = (0..2 + j % 3).map(|_| rng.random_range(0..vocab)).collect();
            let samples = rs
                .iter()
                .map(|&reward| {
                    let len = 2 + rng.random_range(0..MAX_LEN - 1);
                    let completion: Vec<u32> =
                        (0..len).map(|_| rng.random_range(0..vocab)).collect();
                    let lp = logprobs_of(model, &prompt, &completion);
                    let rollout_logprobs =
                        lp.iter().map(|x| x + rng.random_range(-0.4..0.4)).collect();
                    Sample {
                        prompt_ids: prompt.clone(),
                        completion_ids: completion,
                        reward,
                        rollout_logprobs,
                        policy_version: 0,
                    }
                })
                .collect();
            Group::new(j as u64, samples)
        })
        .collect();
    compute_advantages(&mut groups, ScaleRewards::Group);
    groups
}

/// Fixed random directions to project gradients on.
fn directions(learner: &Learner, num: usize) -> Vec<BTreeMap<String, Tensor>> {
    (0..num as u64)
        .map(|d| {
            let mut rng = StdRng::seed_from_u64(100 + d);
            learner
                .vars
                .iter()
                .map(|(n, v)| {
                    let data: Vec<f32> = (0..v.elem_count())
                        .map(|_| rng.random_range(-1.0..1.0))
                        .collect();
                    (
                        n.clone(),
                        Tensor::from_vec(data, v.shape(), &Device::Cpu).unwrap(),
                    )
                })
                .collect()
        })
        .collect()
}

fn project(grads: &BTreeMap<String, Tensor>, dirs: &[BTreeMap<String, Tensor>]) -> Vec<f64> {
    dirs.iter()
        .map(|d| {
            grads
                .iter()
                .map(|(n, g)| {
                    (g * &d[n])
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap() as f64
                })
                .sum()
        })
        .collect()
}

pub(crate) fn all_kept(groups: &[Group]) -> Vec<Kept> {
    let mut rng = StdRng::seed_from_u64(0);
    prune_completions(
        groups,
        &LevelConfig::off(),
        CompletionScope::Group,
        0.0,
        &mut rng,
    )
}

/// The train batch of `kept` with `algorithm`'s normalisers, every prompt of `groups` drawn.
pub(crate) fn train_batch(groups: &[Group], kept: &[Kept], algorithm: Algorithm) -> TrainBatch {
    let shape = BatchShape {
        prompts_per_step: groups.len(),
        group_size: G,
        max_len: MAX_LEN,
        beta: 0.0,
        scope: CompletionScope::Group,
    };
    let norm = match algorithm {
        Algorithm::Cppo => Cppo::new(shape, 0.0).normalisers(groups, kept, groups.len()),
        Algorithm::Grpo | Algorithm::Dppo | Algorithm::Greso => {
            full_batch_normalisers(groups, groups.len(), &shape)
        }
    };
    build_train_batch(groups, kept, norm)
}

#[test]
fn zero_rates_are_grpo_bit_for_bit() {
    let learner = learner(LossAgg::TokenMean, 64);
    let groups = batch(&learner.model);
    let grpo = all_kept(&groups);
    let mut rng = StdRng::seed_from_u64(1);
    let mut history = PromptHistory::new(0.5);
    history.update(&groups, 0);
    let zero = LevelConfig::off();
    let w_q = history.select(
        &(0..6).collect::<Vec<_>>(),
        &zero,
        PromptPredictor::SignalEma,
        &mut rng,
    );
    assert!(w_q.iter().all(|w| *w == Some(1.0)));
    let dppo = prune_completions(&groups, &zero, CompletionScope::Group, 0.0, &mut rng);
    assert_eq!(dppo, grpo);
    assert!(dppo.iter().all(|k| k.weight == 1.0));
    let (g1, m1) = learner
        .gradients(&train_batch(&groups, &grpo, Algorithm::Grpo))
        .unwrap();
    let (g2, m2) = learner
        .gradients(&train_batch(&groups, &dppo, Algorithm::Dppo))
        .unwrap();
    assert_eq!(m1.pg_loss.to_bits(), m2.pg_loss.to_bits());
    for (name, g) in &g1 {
        let (a, b) = (crate::util::flat(g), crate::util::flat(&g2[name]));
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{name}"
        );
    }
}

#[test]
fn dropping_zero_advantage_items_changes_nothing() {
    let learner = learner(LossAgg::SeqMeanTokenMean, 64);
    let groups = batch(&learner.model);
    let signal = all_kept(&groups);
    let mut everything = Vec::new();
    for (g, group) in groups.iter().enumerate() {
        for i in 0..group.samples.len() {
            everything.push(Kept {
                group_idx: g,
                sample_idx: i,
                weight: 1.0,
            });
        }
    }
    assert!(
        everything.len() > signal.len(),
        "the batch has zero-advantage groups"
    );
    let (a, ma) = learner
        .gradients(&train_batch(&groups, &signal, Algorithm::Dppo))
        .unwrap();
    let (b, mb) = learner
        .gradients(&train_batch(&groups, &everything, Algorithm::Dppo))
        .unwrap();
    assert!((ma.pg_loss - mb.pg_loss).abs() <= 1e-7);
    for (name, g) in &a {
        assert_close!(crate::util::flat(g), crate::util::flat(&b[name]), 1e-6);
    }
}

#[test]
fn one_buffer_equals_many_buffers() {
    let groups = batch(&learner(LossAgg::TokenMean, 64).model);
    let kept = all_kept(&groups);
    let one = learner(LossAgg::TokenMean, 4096);
    let many = learner(LossAgg::TokenMean, 12);
    let tb = train_batch(&groups, &kept, Algorithm::Dppo);
    let (a, ma) = one.gradients(&tb).unwrap();
    let (b, mb) = many.gradients(&tb).unwrap();
    assert_eq!(ma.num_buffers, 1);
    assert!(mb.num_buffers >= 4, "{} buffers", mb.num_buffers);
    assert!((ma.pg_loss - mb.pg_loss).abs() <= 1e-6);
    for (name, g) in &a {
        let scale = crate::util::flat(g)
            .iter()
            .fold(1f32, |m, x| m.max(x.abs()));
        assert_close!(
            crate::util::flat(g),
            crate::util::flat(&b[name]),
            1e-5 * scale
        );
    }
}

#[test]
fn repeated_steps_raise_the_advantage_weighted_logprob() {
    let mut learner = learner(LossAgg::SeqMeanTokenMean, 64);
    let groups = batch(&learner.model);
    let kept = all_kept(&groups);
    let objective = |model: &CausalLm| -> f64 {
        kept.iter()
            .map(|k| {
                let s = &groups[k.group_idx].samples[k.sample_idx];
                let lp: f32 = logprobs_of(model, &s.prompt_ids, &s.completion_ids)
                    .iter()
                    .sum();
                groups[k.group_idx].advantages[k.sample_idx] * lp as f64
            })
            .sum()
    };
    let before = objective(&learner.model);
    // Rollout logprobs = current ones each step (on-policy), as in the real loop.
    for _ in 0..5 {
        let mut fresh = groups.clone();
        for g in fresh.iter_mut() {
            for s in g.samples.iter_mut() {
                s.rollout_logprobs = logprobs_of(&learner.model, &s.prompt_ids, &s.completion_ids);
            }
        }
        learner
            .step(&train_batch(&fresh, &kept, Algorithm::Dppo))
            .unwrap();
    }
    let after = objective(&learner.model);
    assert!(after > before + 1.0, "objective {before} -> {after}");
}

#[test]
fn kl_reference_is_the_frozen_initial_policy() {
    let plain = learner(LossAgg::TokenMean, 64);
    let mut cfg = plain.cfg;
    cfg.loss.beta = 0.5;
    let model_cfg = plain.model.config().clone();
    let mut with_kl = Learner::new(&model_cfg, &plain.weights().unwrap(), cfg).unwrap();
    let groups = batch(&plain.model);
    let tb = train_batch(&groups, &all_kept(&groups), Algorithm::Dppo);
    // At the reference, k3 KL and its gradient are zero.
    let (a, ma) = plain.gradients(&tb).unwrap();
    let (b, mb) = with_kl.gradients(&tb).unwrap();
    assert!((ma.pg_loss - mb.pg_loss).abs() < 1e-7);
    for (name, g) in &a {
        assert_close!(crate::util::flat(g), crate::util::flat(&b[name]), 1e-6);
    }
    // After steps the policy moves, the reference does not, and the KL term is positive.
    let reference_before =
        logprobs_of(&with_kl.reference.as_ref().unwrap().model, &[1, 2], &[3, 4]);
    for _ in 0..3 {
        with_kl.step(&tb).unwrap();
    }
    assert_eq!(
        logprobs_of(&with_kl.reference.as_ref().unwrap().model, &[1, 2], &[3, 4]),
        reference_before
    );
    let without = Learner::new(&model_cfg, &with_kl.weights().unwrap(), plain.cfg).unwrap();
    let (_, m_kl) = with_kl.gradients(&tb).unwrap();
    let (_, m_plain) = without.gradients(&tb).unwrap();
    assert!(
        m_kl.pg_loss > m_plain.pg_loss,
        "{} vs {}",
        m_kl.pg_loss,
        m_plain.pg_loss
    );
}
