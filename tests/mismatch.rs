//! The learner against the rollout: logprobs at the rollout's temperature, and the
//! mismatch metrics of every step (#41 points 1, 3 and 6).

use candle_core::{Device, Tensor};
use dppo_model::ops::log_softmax_last_dim;
use dppo_model::{Arch, CausalAttention, CausalLm};
use dppo_trainer::learner::LearnerConfig;
use dppo_trainer::loss::{buffer_loss, Normalisers, TrainSeq};
use serde_json::Value;

use crate::util::{metrics_lines, random_weights, run_with_sets, small_config};

/// Completion-token logprobs of `ids` (prompt of `p` tokens) under softmax(logits / t),
/// the sequence run alone through the contiguous attention.
fn tempered_logprobs(model: &CausalLm, ids: &[u32], p: usize, t: f64) -> Vec<f32> {
    let n = ids.len();
    let ids_t = Tensor::new(ids, &Device::Cpu).unwrap();
    let pos = Tensor::arange(0u32, n as u32, &Device::Cpu).unwrap();
    let hidden = model.forward(&ids_t, &pos, &mut CausalAttention).unwrap();
    let logits = (model
        .logits(&hidden.narrow(0, p - 1, n - p).unwrap())
        .unwrap()
        / t)
        .unwrap();
    let logp = log_softmax_last_dim(&logits)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    (p..n).map(|i| logp[i - p][ids[i] as usize]).collect()
}

/// At temperature 0.7 the learner's logprobs are those of softmax(logits / 0.7): against
/// rollout logprobs computed so, the mismatch is rounding; a learner at temperature 1 would
/// be far off.
#[test]
fn the_learner_computes_logprobs_at_the_rollout_temperature() {
    let cfg = small_config(Arch::Llama);
    let model = CausalLm::new(&cfg, &random_weights(&cfg, 5)).unwrap();
    let t = 0.7;
    let seqs: Vec<TrainSeq> = (0..3u32)
        .map(|s| {
            let ids: Vec<u32> = (0..9).map(|i| (i * 7 + s * 13 + 1) % 40).collect();
            TrainSeq {
                rollout_logprobs: tempered_logprobs(&model, &ids, 4, t),
                tokens: ids,
                num_prompt_tokens: 4,
                advantage: 1.0,
                weight: 1.0,
            }
        })
        .collect();
    let refs: Vec<&TrainSeq> = seqs.iter().collect();
    let norm = Normalisers {
        num_seqs: 3.0,
        num_tokens: 15.0,
        max_len: 5.0,
    };
    let base = LearnerConfig::token_mean(1e-3, 1.0, 64, 8).loss;
    let at = |temperature: f64| {
        let loss = dppo_trainer::loss::LossConfig {
            temperature,
            ..base
        };
        buffer_loss(&model, None, &refs, &loss, &norm)
            .unwrap()
            .mismatch
    };
    let tempered = at(t);
    assert_eq!(tempered.tokens, 15);
    assert!(tempered.abs_max < 1e-5, "{tempered:?}");
    let untempered = at(1.0);
    assert!(untempered.abs_max > 1e-2, "{untempered:?}");
}

/// A synchronous run at temperature 0.7 and top-p 0.9 logs the mismatch of every trained
/// step: zero, since on the CPU in f32 the learner computes the engine's logprobs bit for
/// bit (a learner ignoring the nucleus would be off by its missing mass, about 0.1 in
/// logprob). Also the response lengths.
#[test]
fn a_run_logs_the_mismatch_and_response_lengths() {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("run");
    let (code, stdout, stderr) = run_with_sets(
        &[
            "steps=2",
            "warmup.steps=100",
            "data.num_eval=20",
            "rollout.one_step_off_policy=false",
            "rollout.temperature=0.7",
            "rollout.top_p=0.9",
        ],
        &dir,
    );
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    let steps: Vec<Value> = metrics_lines(&dir)
        .into_iter()
        .filter(|v| v.get("step").is_some() && v.get("reward/mean").is_some())
        .collect();
    assert_eq!(steps.len(), 2, "{steps:?}");
    let first = &steps[0];
    for key in [
        "response_length/mean",
        "response_length/max",
        "response_length/clip_ratio",
        "mismatch/logprob_abs_diff_mean",
        "mismatch/k3_kl",
        "mismatch/ratio_outside_frac",
    ] {
        assert!(first[key].as_f64().unwrap().is_finite(), "{key}: {first}");
    }
    // Every step that trained (the first did, as checked above) measured no difference.
    for step in steps.iter().filter(|s| s.get("mismatch/k3_kl").is_some()) {
        let max = step["mismatch/logprob_abs_diff_max"].as_f64().unwrap();
        assert_eq!(max, 0.0, "{step}");
        assert_eq!(step["mismatch/k3_kl"].as_f64().unwrap(), 0.0, "{step}");
    }
    assert_eq!(first["mismatch/ratio_outside_frac"].as_f64().unwrap(), 0.0);
}

/// With the old logprobs recomputed, the ratio is 1 in value at the update, and the
/// correction weighs each token's policy gradient by its capped learner-rollout ratio, or
/// masks it: loss and gradient against a hand computation.
#[test]
fn corrections_weigh_the_gradient_as_computed_by_hand() {
    use candle_core::Var;
    use dppo_trainer::correction::{IsLevel, RolloutCorrection, RsLevel};
    use dppo_trainer::loss::{token_loss, LossAgg, LossConfig, RatioLevel};

    // Learner minus rollout logprob per token: two sequences of 2 and 3 tokens. The rollout
    // logprobs are f32, so the weights carry its rounding (hence the 1e-6 tolerances).
    let d = [0.1f64, 0.9, -0.8, 0.05, 0.0];
    let learner = [-1.0f64, -2.0, -0.5, -3.0, -1.5];
    let (adv, weight) = ([1.0f64, -0.5], [2.0f64, 1.0]);
    let make = |range: std::ops::Range<usize>, s: usize| TrainSeq {
        tokens: vec![0; 1 + range.len()],
        num_prompt_tokens: 1,
        advantage: adv[s],
        weight: weight[s],
        rollout_logprobs: range.map(|t| (learner[t] - d[t]) as f32).collect(),
    };
    let seqs = [make(0..2, 0), make(2..5, 1)];
    let refs: Vec<&TrainSeq> = seqs.iter().collect();
    let norm = Normalisers {
        num_seqs: 2.0,
        num_tokens: 10.0,
        max_len: 3.0,
    };
    let owner = [0usize, 0, 1, 1, 1];
    for (is, rs, w) in [
        (
            IsLevel::Token,
            RsLevel::None,
            [0.1f64.exp(), 2.0, (-0.8f64).exp(), 0.05f64.exp(), 1.0],
        ),
        (IsLevel::None, RsLevel::Token, [1.0, 0.0, 0.0, 1.0, 1.0]),
        (IsLevel::Sequence, RsLevel::Geometric, {
            let b = (-0.75f64).exp();
            [2.0, 2.0, b, b, b]
        }),
    ] {
        let cfg = LossConfig {
            eps_low: 0.2,
            eps_high: 0.28,
            loss_agg: LossAgg::TokenMean,
            ratio_level: RatioLevel::Token,
            beta: 0.0,
            temperature: 1.0,
            top_p: 1.0,
            recompute_old_logprobs: true,
            correction: RolloutCorrection {
                rollout_is: is,
                rollout_rs: rs,
                ..RolloutCorrection::default()
            },
        };
        let lp = Var::new(&learner, &Device::Cpu).unwrap();
        let out = token_loss(lp.as_tensor(), None, &refs, &cfg, &norm).unwrap();
        // Ratio 1: l_t = -A w_t; token-mean coefficient weight / N_tok.
        let coef = |t: usize| weight[owner[t]] / norm.num_tokens;
        let want: f64 = (0..5).map(|t| -coef(t) * adv[owner[t]] * w[t]).sum();
        let got = out.loss.to_scalar::<f64>().unwrap();
        assert!((got - want).abs() < 1e-6, "{is:?} {rs:?}: {got} vs {want}");
        let grad = out.loss.backward().unwrap();
        let grad = grad.get(&lp).unwrap().to_vec1::<f64>().unwrap();
        for t in 0..5 {
            let want = -coef(t) * adv[owner[t]] * w[t];
            assert!(
                (grad[t] - want).abs() < 1e-6,
                "{is:?} {rs:?}: grad {grad:?}"
            );
        }
        assert_eq!(out.num_clipped, 0, "a ratio of 1 is never clipped");
    }
}

/// A run with token TIS and masking on the recomputed old logprobs logs what the correction
/// did: one step off-policy the weights carry the last update's change, within 1% of 1 here,
/// so nothing is truncated or masked.
#[test]
fn a_corrected_run_logs_its_weights() {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("run");
    let (code, stdout, stderr) = run_with_sets(
        &[
            "steps=2",
            "warmup.steps=100",
            "data.num_eval=20",
            "actor.recompute_old_logprobs=true",
            "rollout_correction.rollout_is=token",
            "rollout_correction.rollout_rs=token",
        ],
        &dir,
    );
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    let trained: Vec<Value> = metrics_lines(&dir)
        .into_iter()
        .filter(|v| v.get("rollout_corr/is_weight_mean").is_some())
        .collect();
    assert!(!trained.is_empty(), "no corrected step");
    for step in &trained {
        // One step off-policy the learner is one update ahead of the rollout.
        let mean = step["rollout_corr/is_weight_mean"].as_f64().unwrap();
        assert!((mean - 1.0).abs() < 1e-2, "{step}");
        assert_eq!(step["rollout_corr/is_truncated_frac"].as_f64(), Some(0.0));
        assert_eq!(step["rollout_corr/rs_masked_frac"].as_f64(), Some(0.0));
    }
}
