//! On the CPU in f32 the learner's logprobs of sampled tokens are the engine's bit for bit,
//! whatever the engine's batch (preemption, prompts shared by their samples) and however
//! the learner packs them, so a synchronous step's ratio is exactly 1 (#41, point 4).

use candle_core::Device;
use dppo_engine::{AttentionMode, Engine, EngineConfig, GenerateRequest, SamplingParams};
use dppo_model::train_layer::LayerGrads;
use dppo_model::{CausalLm, Policy};
use dppo_trainer::learner::LearnerConfig;
use dppo_trainer::loss::{buffer_loss, LossConfig, Normalisers, TrainSeq};

use crate::engine::{config, run};

/// A rollout of `reqs` through an engine of `engine_cfg`, as the learner's sequences.
fn rollout(policy: &Policy, engine_cfg: EngineConfig, reqs: &[GenerateRequest]) -> Vec<TrainSeq> {
    let engine = Engine::new(policy, engine_cfg, Device::Cpu).unwrap();
    let out = run(&engine, reqs);
    let stats = engine.stats();
    assert!(stats.num_preemptions > 0, "the pool was meant to run out");
    let mut seqs = Vec::new();
    for (req, completions) in reqs.iter().zip(out) {
        for c in completions {
            assert!(!c.token_ids.is_empty());
            let mut tokens = req.prompt_ids.clone();
            tokens.extend(&c.token_ids);
            seqs.push(TrainSeq {
                tokens,
                num_prompt_tokens: req.prompt_ids.len(),
                rollout_logprobs: c.logprobs,
                advantage: 1.0,
                weight: 1.0,
            });
        }
    }
    seqs
}

/// Requests of `n` samples each, seeded, at `temperature` and `top_p`.
fn sampled(
    prompts: Vec<Vec<u32>>,
    n: usize,
    max_tokens: usize,
    t: f32,
    top_p: f32,
) -> Vec<GenerateRequest> {
    prompts
        .into_iter()
        .enumerate()
        .map(|(i, ids)| {
            let mut r = GenerateRequest::new(ids, n, max_tokens);
            r.sampling = SamplingParams {
                temperature: t,
                top_p,
                seed: Some(100 + i as u64),
                ..SamplingParams::default()
            };
            r.ignore_eos = true;
            r
        })
        .collect()
}

/// The learner's model as the trainer builds it for f32 CPU training: trainable vars, the
/// decoder layers as single ops with their own backward.
fn learner_model(policy: &Policy) -> CausalLm {
    let (_vars, weights) = policy.weights.to_vars().unwrap();
    CausalLm::new(&policy.config, &weights)
        .unwrap()
        .with_layer_grads(LayerGrads::new())
}

/// Every packing of `seqs` below (all in one buffer, one per buffer, pairs in reverse
/// order) gives the rollout's logprobs exactly: zero difference, every ratio exactly 1.
fn assert_exact(policy: &Policy, seqs: &[TrainSeq], temperature: f32, top_p: f32) {
    let model = learner_model(policy);
    let loss = LossConfig {
        temperature: f64::from(temperature),
        top_p: f64::from(top_p),
        ..LearnerConfig::token_mean(1e-3, 1.0, 1024, 8).loss
    };
    let norm = Normalisers {
        num_seqs: seqs.len() as f64,
        num_tokens: 100.0,
        max_len: 100.0,
    };
    let all: Vec<&TrainSeq> = seqs.iter().collect();
    let reversed: Vec<&TrainSeq> = seqs.iter().rev().collect();
    let mut packings: Vec<Vec<&TrainSeq>> = vec![all.clone()];
    packings.extend(all.iter().map(|s| vec![*s]));
    packings.extend(reversed.chunks(2).map(<[_]>::to_vec));
    let total: usize = seqs.iter().map(|s| s.rollout_logprobs.len()).sum();
    for (p, packing) in packings.iter().enumerate() {
        let out = buffer_loss(&model, None, packing, &loss, &norm).unwrap();
        let m = out.mismatch;
        assert!(m.tokens > 0);
        assert_eq!(m.abs_max, 0.0, "packing {p}: {m:?}");
        assert_eq!(m.k3_sum, 0.0, "packing {p}: every ratio is exactly 1");
        assert_eq!(m.outside, 0);
    }
    assert_eq!(
        packings[0]
            .iter()
            .map(|s| s.num_completion_tokens())
            .sum::<usize>(),
        total
    );
}

#[test]
fn the_learner_equals_the_engine_bit_for_bit_on_builtin_tiny() {
    let policy = Policy::load("builtin:tiny", &Device::Cpu).unwrap();
    let tok = &policy.tokenizer;
    let prompts: Vec<Vec<u32>> = ["12+7=", "what is 3*4?", "99-1", "a"]
        .iter()
        .map(|p| tok.encode(p, false).unwrap())
        .collect();
    for (t, top_p) in [(1.0, 1.0), (0.7, 0.9)] {
        let reqs = sampled(prompts.clone(), 4, 12, t, top_p);
        // Blocks of 4 slots and room for 48 tokens: samples are preempted and resumed.
        let engine_cfg = EngineConfig {
            max_batched_tokens: 16,
            ..config(4, 48, AttentionMode::Auto)
        };
        let seqs = rollout(&policy, engine_cfg, &reqs);
        assert_exact(&policy, &seqs, t, top_p);
    }
}

#[test]
fn the_learner_equals_the_engine_bit_for_bit_on_smollm2() {
    let path = crate::util::smollm2_gguf();
    let policy = Policy::load(path.to_str().unwrap(), &Device::Cpu).unwrap();
    let tok = &policy.tokenizer;
    let prompts: Vec<Vec<u32>> = ["What is 17 + 25?", "The capital of France is"]
        .iter()
        .map(|p| tok.encode(p, false).unwrap())
        .collect();
    let reqs = sampled(prompts, 3, 10, 1.0, 1.0);
    let engine_cfg = EngineConfig {
        max_batched_tokens: 8,
        ..config(4, 40, AttentionMode::Auto)
    };
    let seqs = rollout(&policy, engine_cfg, &reqs);
    assert_exact(&policy, &seqs, 1.0, 1.0);
}
