//! The GPU path on a real GPU, against the CPU: gated at run time on the GPU opening, so
//! that they pass as skipped (and say so) in a build without the `cuda` feature or on a
//! machine without a GPU. The engine's attention (on a GPU `auto` is the paged CUDA
//! kernels; the generic path too, with preemption), the learner's gradients and optimizer
//! state and the hand-offs between streams are `dppo doctor --full`'s device checks, run here as they run from the GPU kit's binary; SmolLM2's own weights (which the
//! kit cannot carry) are checked here only. `scripts/test-gpu` runs them on a GPU machine.

use candle_core::Device;
use dppo_engine::{AttentionMode, Engine};
use dppo_model::{DeviceSpec, Policy};
use dppo_trainer::doctor::{self, Options, Status};

use crate::engine::{assert_bf16_agrees_with_f32, config, run, smollm2_requests};

/// GPU 0, or `None` after printing why these tests are skipped.
fn cuda() -> Option<Device> {
    match DeviceSpec::Cuda(0).open() {
        Ok(device) => Some(device),
        Err(e) => {
            eprintln!("skipped: {e} (scripts/test-gpu builds and runs these on a GPU)");
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

/// Every check of `dppo doctor --device cuda --full` passes.
#[test]
fn doctor_full_passes_on_cuda() {
    if cuda().is_none() {
        return;
    }
    let report = doctor::run(&Options {
        device: DeviceSpec::Cuda(0),
        full: true,
        version: "test".into(),
        commit: None,
    });
    let failed: Vec<_> = report.failures().collect();
    assert!(failed.is_empty(), "{report}");
    let device = report.sections.iter().find(|s| s.name == "device").unwrap();
    assert!(
        device.checks.iter().all(|c| c.status == Status::Ok),
        "{report}"
    );
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
