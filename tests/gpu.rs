//! The GPU path on a real GPU, against the CPU: gated at run time on `Device::new_cuda(0)`
//! succeeding, so that they pass as skipped (and say so) in a build without the `cuda`
//! feature or on a machine without a GPU. `scripts/test-gpu` runs them on a GPU machine.

use candle_core::{DType, Device, Tensor};
use dppo_engine::{AttentionMode, Engine, EngineConfig};
use dppo_model::{Arch, CausalLm, ModelConfig, Policy, Weights};
use dppo_trainer::learner::{Learner, LearnerConfig};
use dppo_trainer::prune::Algorithm;
use dppo_trainer::train_batch::TrainBatch;

use crate::engine::{
    assert_bf16_agrees_with_f32, assert_matches_reference, config, policy, reference, run,
    smollm2_requests, workload,
};
use crate::trainer;
use crate::util::{random_weights, small_config};

/// GPU 0, or `None` after printing why these tests are skipped.
fn cuda() -> Option<Device> {
    match Device::new_cuda(0) {
        Ok(device) => Some(device),
        Err(e) if cfg!(feature = "cuda") => {
            eprintln!("skipped: no usable GPU ({e})");
            None
        }
        Err(_) => {
            eprintln!("skipped: this build has no cuda feature (scripts/test-gpu builds one)");
            None
        }
    }
}

/// `policy` with its weights on `device`.
fn on(policy: &Policy, device: &Device) -> Policy {
    Policy {
        weights: policy.weights.to_device(device).unwrap(),
        ..policy.clone()
    }
}

/// The generic attention on the GPU in f32 (block sizes, preemption, groups) gives the CPU
/// contiguous reference's tokens, logprobs within 1e-4.
#[test]
fn generic_attention_on_cuda_equals_the_cpu_reference() {
    let Some(gpu) = cuda() else { return };
    let policy = policy();
    let reqs = workload(10, 3, policy.config.vocab_size);
    let want = reference(&policy, &reqs);
    for (block_size, kv_tokens) in [(16, 4096), (4, 64)] {
        let cfg = EngineConfig {
            dtype: Some(DType::F32),
            ..config(block_size, kv_tokens, AttentionMode::Auto)
        };
        let engine = Engine::new(&on(&policy, &gpu), cfg, gpu.clone()).unwrap();
        let what = format!("cuda, block_size {block_size}, {kv_tokens} slots");
        assert_matches_reference(&run(&engine, &reqs), &want, &what);
    }
}

/// SmolLM2 in bf16 on the GPU (its default dtype there) against f32 on the CPU.
#[test]
fn smollm2_bf16_on_cuda_agrees_with_f32_on_the_cpu() {
    let Some(gpu) = cuda() else { return };
    let (policy, reqs) = smollm2_requests(1, 16);
    let cpu = Engine::new(&policy, config(16, 1024, AttentionMode::Auto), Device::Cpu).unwrap();
    let engine = Engine::new(
        &on(&policy, &gpu),
        config(16, 1024, AttentionMode::Auto),
        gpu.clone(),
    )
    .unwrap();
    assert_bf16_agrees_with_f32(&run(&cpu, &reqs), &run(&engine, &reqs));
}

/// The trainer suite's batch (6 prompts x 4 samples) for its small random model.
fn model_and_batch() -> (ModelConfig, Weights, TrainBatch) {
    let config = small_config(Arch::Llama);
    let weights = random_weights(&config, 5);
    let groups = trainer::batch(&CausalLm::new(&config, &weights).unwrap());
    let batch = trainer::train_batch(&groups, &trainer::all_kept(&groups), Algorithm::Grpo);
    (config, weights, batch)
}

/// The learner's packed forward/backward on the GPU gives the CPU's gradients (f32, within
/// 1e-4 of the largest), and its AdamW steps (the tensor-op path) keep f32 masters and
/// moments on the GPU, for f32 and bf16 compute.
#[test]
fn a_learner_step_on_cuda_follows_the_cpu() {
    let Some(gpu) = cuda() else { return };
    let (config, weights, batch) = model_and_batch();
    let flat = |grads: &std::collections::BTreeMap<String, Tensor>| -> Vec<f32> {
        grads
            .values()
            .flat_map(|g| {
                g.to_device(&Device::Cpu)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            })
            .collect()
    };
    let cfg = LearnerConfig::token_mean(1e-2, 1.0, 64, 8);
    let cpu = Learner::new(&config, &weights, cfg).unwrap();
    let want = flat(&cpu.gradients(&batch).unwrap().0);
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    for compute_dtype in [DType::F32, DType::BF16] {
        let cfg = LearnerConfig {
            compute_dtype,
            ..cfg
        };
        let gpu_weights = weights.to_device(&gpu).unwrap();
        let mut learner = Learner::new(&config, &gpu_weights, cfg).unwrap();
        if compute_dtype == DType::F32 {
            let got = flat(&learner.gradients(&batch).unwrap().0);
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!((a - b).abs() <= 1e-4 * scale, "gradient {i}: {a} vs {b}");
            }
        }
        for _ in 0..3 {
            let m = learner.step(&batch).unwrap();
            assert!(!m.is_nonfinite, "{compute_dtype:?}: {m:?}");
        }
        assert!(learner
            .vars
            .values()
            .all(|v| v.dtype() == DType::F32 && v.device().is_cuda()));
        assert!(learner
            .optimizer
            .moments
            .values()
            .all(|(m, v)| m.dtype() == DType::F32 && v.device().is_cuda()));
    }
}
