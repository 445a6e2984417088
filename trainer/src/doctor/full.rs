//! What `dppo doctor --full` adds to the device check: the properties the GPU tests assert,
//! in the binary that carries the kernels (tests/gpu.rs runs these same checks). The engine
//! under preemption and small blocks against the CPU, and the learner's every gradient and
//! its optimizer state after AdamW steps.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor};
use dppo_engine::{AttentionMode, Completion, EngineConfig, GenerateRequest};
use dppo_model::Policy;

use super::compare::{compare_greedy, diff, generate_with, BUG_FIX};
use super::Check;
use crate::learner::{Learner, LearnerConfig};
use crate::train_batch::TrainBatch;
use crate::TrainError;

/// Largest gradient difference from the CPU's, relative to the CPU's largest gradient.
const GRADIENT_TOL: f32 = 1e-4;
/// AdamW steps taken before the optimizer state is checked.
const ADAMW_STEPS: usize = 3;

/// Greedy f32 generation by an engine of `base` (its attention backend and switches) with
/// 4-token blocks and a KV pool too small for every sequence at once, so that sequences are
/// preempted and recomputed: the same tokens as the CPU's `want`, and at least one
/// preemption. The check is called `name`.
pub(super) fn preemption(
    policy: &Policy,
    device: &Device,
    (reqs, want): (&[GenerateRequest], &[Completion]),
    base: EngineConfig,
    name: &str,
) -> Result<Check, TrainError> {
    let longest = reqs
        .iter()
        .map(|r| r.prompt_ids.len() + r.max_tokens)
        .max()
        .unwrap_or(0);
    let cfg = EngineConfig {
        block_size: 4,
        kv_cache_tokens: Some(2 * longest.next_multiple_of(4)),
        dtype: Some(DType::F32),
        ..base
    };
    let attention = cfg.attention;
    let (got, engine) = generate_with(policy, device, cfg, reqs)?;
    let preemptions = engine.stats().num_preemptions;
    // The CPU kernel computes a recomputed prefill exactly as the decode steps it replaces.
    let exact = device.is_cpu() && matches!(attention, AttentionMode::Auto | AttentionMode::Cpu);
    let greedy = compare_greedy(want, &got, DType::F32, exact);
    Ok(Check::expect(
        greedy.status == super::Status::Ok && preemptions > 0,
        name,
        format!("block size 4, {preemptions} preemptions: {}", greedy.detail),
        BUG_FIX,
    ))
}

/// The f32 learner's gradients on `device` against the CPU's, element by element, then
/// AdamW steps in f32 and bf16 compute: finite, masters and moments f32 on `device`.
pub(super) fn learner_checks(
    policy: &Policy,
    device: &Device,
    batch: &TrainBatch,
) -> Result<Vec<Check>, TrainError> {
    let cfg = LearnerConfig::token_mean(1e-2, 1.0, 256, 8);
    let cpu = Learner::new(&policy.config, &policy.weights, cfg)?;
    let want = flat(&cpu.gradients(batch)?.0)?;
    let on_device = policy.weights.to_device(device)?;
    let learner = Learner::new(&policy.config, &on_device, cfg)?;
    let got = flat(&learner.gradients(batch)?.0)?;
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let worst = got
        .iter()
        .zip(&want)
        .map(|(&a, &b)| diff(a, b))
        .fold(0f32, f32::max);
    let tol = if device.is_cpu() { 0.0 } else { GRADIENT_TOL };
    let mut checks = vec![Check::expect(
        got.len() == want.len() && scale > 0.0 && worst <= tol * scale,
        "gradients f32",
        format!(
            "{} gradient elements, largest difference {:.1e} of the largest gradient \
             (<= {tol:.0e})",
            got.len(),
            worst / scale.max(f32::MIN_POSITIVE)
        ),
        BUG_FIX,
    )];
    for compute_dtype in [DType::F32, DType::BF16] {
        let mut learner = Learner::new(
            &policy.config,
            &on_device,
            LearnerConfig {
                compute_dtype,
                ..cfg
            },
        )?;
        let mut finite = true;
        for _ in 0..ADAMW_STEPS {
            finite &= !learner.step(batch)?.is_nonfinite;
        }
        let on = |t: &Tensor| t.dtype() == DType::F32 && t.device().same_device(device);
        let masters = learner.vars.values().all(|v| on(v.as_tensor()));
        let moments = learner
            .optimizer
            .moments
            .values()
            .all(|(m, v)| on(m) && on(v));
        checks.push(Check::expect(
            finite && masters && moments,
            format!("adamw {}", compute_dtype.as_str()),
            format!(
                "{ADAMW_STEPS} steps: finite {finite}, f32 masters on the device {masters}, \
                 f32 moments on the device {moments}"
            ),
            BUG_FIX,
        ));
    }
    Ok(checks)
}

/// Every gradient element, in name order, on the host.
fn flat(grads: &BTreeMap<String, Tensor>) -> Result<Vec<f32>, TrainError> {
    let mut out = Vec::new();
    for g in grads.values() {
        out.extend(
            g.to_device(&Device::Cpu)?
                .to_dtype(DType::F32)?
                .flatten_all()?
                .to_vec1::<f32>()?,
        );
    }
    Ok(out)
}
