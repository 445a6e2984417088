use super::*;
use crate::loss::Normalisers;
use candle_core::Device;

/// Every bit of the weights, the optimizer moments and the optimizer's step count.
fn state_bits(learner: &Learner) -> (Vec<Vec<u32>>, u64) {
    let bits = |t: &Tensor| -> Vec<u32> {
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        v.iter().map(|x| x.to_bits()).collect()
    };
    let mut all: Vec<Vec<u32>> = learner.vars.values().map(|v| bits(v)).collect();
    for (m, v) in learner.optimizer.moments.values() {
        all.extend([bits(m), bits(v)]);
    }
    (all, learner.optimizer.step)
}

/// Two sequences of the tiny model with `advantage` (and its negation).
fn batch(advantage: f64) -> TrainBatch {
    let seq = |tokens: Vec<u32>, advantage: f64| TrainSeq {
        rollout_logprobs: vec![-4.0; tokens.len() - 2],
        num_prompt_tokens: 2,
        tokens,
        advantage,
        weight: 1.0,
    };
    TrainBatch {
        seqs: vec![
            seq(vec![5, 6, 7, 8, 9], advantage),
            seq(vec![5, 6, 10, 11], -advantage),
        ],
        norm: Normalisers {
            num_seqs: 2.0,
            num_tokens: 5.0,
            max_len: 3.0,
        },
    }
}

#[test]
fn a_non_finite_loss_changes_no_weight_moment_or_step_count() {
    let policy = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
    let cfg = LearnerConfig::token_mean(1e-2, 1.0, 64, 8);
    let mut learner = Learner::new(&policy.config, &policy.weights, cfg).unwrap();
    assert!(!learner.step(&batch(1.0)).unwrap().is_nonfinite);
    let good = state_bits(&learner);
    assert_eq!(good.1, 1);
    for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
        let m = learner.step(&batch(bad)).unwrap();
        assert!(m.is_nonfinite, "advantage {bad}: {m:?}");
        assert!(
            state_bits(&learner) == good,
            "advantage {bad} changed the state"
        );
    }
    let m = learner.step(&batch(1.0)).unwrap();
    assert!(!m.is_nonfinite && m.pg_loss.is_finite());
    let after = state_bits(&learner);
    assert_eq!(after.1, 2, "the skipped steps did not count");
    assert!(after.0 != good.0, "a finite step still trains");
}

/// bf16 compute: the gradients reach the f32 masters as f32 and point where the f32
/// learner's do; after a step the masters and the AdamW moments are still f32.
#[test]
fn bf16_compute_keeps_f32_masters_and_moments_and_follows_f32_gradients() {
    let policy = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
    let learner = |compute_dtype| {
        let cfg = LearnerConfig {
            compute_dtype,
            ..LearnerConfig::token_mean(1e-2, 1.0, 64, 8)
        };
        Learner::new(&policy.config, &policy.weights, cfg).unwrap()
    };
    let (f32_learner, mut bf16_learner) = (learner(DType::F32), learner(DType::BF16));
    let (want, _) = f32_learner.gradients(&batch(1.0)).unwrap();
    let (got, _) = bf16_learner.gradients(&batch(1.0)).unwrap();
    let flat = |g: &BTreeMap<String, Tensor>| -> Vec<f32> {
        g.values()
            .flat_map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
            .collect()
    };
    assert!(got.values().all(|g| g.dtype() == DType::F32));
    let (a, b) = (flat(&want), flat(&got));
    let dot: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    let cosine = dot / (norm(&a) * norm(&b));
    assert!(cosine > 0.99, "cosine of bf16 and f32 gradients: {cosine}");
    assert!(!bf16_learner.step(&batch(1.0)).unwrap().is_nonfinite);
    assert!(bf16_learner.vars.values().all(|v| v.dtype() == DType::F32));
    assert!(bf16_learner
        .optimizer
        .moments
        .values()
        .all(|(m, v)| m.dtype() == DType::F32 && v.dtype() == DType::F32));
}

/// bf16 compute runs its layers in bf16, not in f32 over bf16-rounded weights.
#[test]
fn bf16_compute_runs_the_layers_in_bf16() {
    let policy = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
    let cfg = LearnerConfig {
        compute_dtype: DType::BF16,
        ..LearnerConfig::token_mean(1e-2, 1.0, 64, 8)
    };
    let learner = Learner::new(&policy.config, &policy.weights, cfg).unwrap();
    let (model, _) = learner.compute_model().unwrap();
    assert_eq!(model.dtype(), DType::BF16);
    let ids = Tensor::new(&[5u32, 6, 7], &Device::Cpu).unwrap();
    let positions = Tensor::new(&[0u32, 1, 2], &Device::Cpu).unwrap();
    let hidden = model
        .forward(&ids, &positions, &mut dppo_model::CausalAttention)
        .unwrap();
    assert_eq!(hidden.dtype(), DType::BF16);
}

/// Under bf16 compute the KL reference reads the same casts as the policy (embedding and
/// lm-head f32), so that at equal weights their logprobs are equal and the KL term is 0.
#[test]
fn the_bf16_reference_computes_what_the_policy_does_at_equal_weights() {
    let policy = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
    let mut cfg = LearnerConfig {
        compute_dtype: DType::BF16,
        ..LearnerConfig::token_mean(1e-2, 1.0, 64, 8)
    };
    cfg.loss.beta = 0.1;
    let learner = Learner::new(&policy.config, &policy.weights, cfg).unwrap();
    let (model, _) = learner.compute_model().unwrap();
    let reference = &learner.reference.as_ref().unwrap().model;
    let ids = Tensor::new(&[5u32, 6, 7, 8], &Device::Cpu).unwrap();
    let positions = Tensor::new(&[0u32, 1, 2, 3], &Device::Cpu).unwrap();
    let targets = Tensor::new(&[6u32, 7, 8, 9], &Device::Cpu).unwrap();
    let logprobs = |m: &CausalLm| -> Vec<f32> {
        let hidden = m
            .forward(&ids, &positions, &mut dppo_model::CausalAttention)
            .unwrap();
        let stats = m.token_stats(&hidden, &targets).unwrap();
        stats
            .logprobs
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    assert_eq!(logprobs(&model), logprobs(reference));
}
