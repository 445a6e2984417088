//! The learner against the rollout: logprobs at the rollout's temperature, and the
//! mismatch metrics of every step (#41 points 1, 3 and 6).

use candle_core::{Device, Tensor};
use dppo_model::ops::log_softmax_last_dim;
use dppo_model::{Arch, CausalAttention, CausalLm};
use dppo_trainer::learner::LearnerConfig;
use dppo_trainer::loss::{buffer_loss, Normalisers, TrainSeq};
use serde_json::Value;

use crate::util::{random_weights, run_dppo, small_config};

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

/// A synchronous run at temperature 0.7 logs the mismatch of every trained step, near zero
/// (engine and learner compute the same distribution in f32), and the response lengths.
#[test]
fn a_run_logs_the_mismatch_and_response_lengths() {
    let out = tempfile::tempdir().unwrap();
    let dir = out.path().join("run");
    let (code, stdout, stderr) = run_dppo(&[
        "run",
        "--set",
        "steps=2",
        "--set",
        "warmup.steps=20",
        "--set",
        "data.num_eval=20",
        "--set",
        "rollout.one_step_off_policy=false",
        "--set",
        "rollout.temperature=0.7",
        "--out",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    let steps: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|v: &Value| v.get("step").is_some() && v.get("reward/mean").is_some())
        .collect();
    assert_eq!(steps.len(), 2, "{text}");
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
    let max = first["mismatch/logprob_abs_diff_max"].as_f64().unwrap();
    assert!(max < 1e-4, "{first}");
    assert_eq!(first["mismatch/ratio_outside_frac"].as_f64().unwrap(), 0.0);
}
