//! The device check: a small random-weight model on the device against the CPU in the same
//! process (greedy tokens and logprobs in f32 and bf16, one learner step, KV blocks freed),
//! the hand-offs between streams, and one timed rollout on the device. On the CPU the f32 results must be equal.

use std::time::{Duration, Instant};

use candle_core::{DType, Device};
use dppo_engine::{
    AttentionMode, Completion, Engine, EngineConfig, GenerateRequest, SamplingParams,
};
use dppo_model::device::timed;
use dppo_model::{Policy, Weights};

use super::compare::{compare_greedy, generate_with, BUG_FIX};
use super::workload::{greedy_requests, model, Workload};
use super::{Check, SEED};
use crate::learner::{Learner, LearnerConfig};
use crate::loss::{Normalisers, TrainSeq};
use crate::train_batch::TrainBatch;
use crate::TrainError;

/// Largest relative difference of the learner's loss and gradient norm, per dtype.
const LEARNER_TOL_F32: f64 = 1e-3;
const LEARNER_TOL_BF16: f64 = 5e-2;

/// Every check of the device section.
pub(super) fn device_checks(device: &Device, full: bool) -> Vec<Check> {
    let work = Workload::of(full);
    let mut checks = Vec::new();
    if let Err(e) = run_checks(device, full, &work, &mut checks) {
        let error = e.to_string();
        let fix = fix_for(&error);
        checks.push(Check::fail("device check", error, fix));
    }
    checks
}

/// The likely fix of an error the device raised.
fn fix_for(error: &str) -> &'static str {
    if error.contains("PTX") {
        "the kernels' PTX is newer than the driver loads: rebuild with an nvcc no newer \
         than the driver's CUDA version, or upgrade the driver"
    } else if error.contains("OUT_OF_MEMORY") || error.contains("out of memory") {
        "free the GPU's memory (another process holds it: see `nvidia-smi`)"
    } else if error.contains("NOT_FOUND") || error.contains(".so") {
        "a CUDA library is missing: put NVIDIA's libraries on LD_LIBRARY_PATH"
    } else {
        BUG_FIX
    }
}

fn run_checks(
    device: &Device,
    full: bool,
    work: &Workload,
    checks: &mut Vec<Check>,
) -> Result<(), TrainError> {
    let policy = model(full)?;
    let on_device = Policy {
        weights: policy.weights.to_device(device)?,
        ..policy.clone()
    };
    checks.push(Check::ok(
        "model",
        format!(
            "random weights (seed {SEED}), {} parameters, {} layers, hidden {}",
            policy.config.num_parameters(),
            policy.config.num_hidden_layers,
            policy.config.hidden_size
        ),
    ));
    let reqs = greedy_requests(work, policy.config.vocab_size);
    let want = generate(&policy, &Device::Cpu, DType::F32, &reqs)?.0;
    let exact = device.is_cpu();
    for dtype in [DType::F32, DType::BF16] {
        let (got, held) = generate(&on_device, device, dtype, &reqs)?;
        checks.push(compare_greedy(&want, &got, dtype, exact));
        checks.push(Check::expect(
            held == 0,
            format!("kv freed {}", dtype.as_str()),
            format!("{held} KV blocks held after generation"),
            "the engine leaks KV blocks: report it with `dppo doctor --json`",
        ));
    }
    let batch = train_batch(&reqs, &want);
    let cpu = learner_step(&policy.config, &policy.weights, DType::F32, &batch)?;
    for dtype in [DType::F32, DType::BF16] {
        let got = learner_step(&policy.config, &on_device.weights, dtype, &batch)?;
        checks.push(compare_learner(cpu, got, dtype, exact));
    }
    if full {
        // On a GPU `auto` is the paged kernels (checked below): this one keeps the generic
        // path, which `auto` takes for heads the kernels refuse, checked on the device.
        let (attention, name) = if device.is_cuda() {
            (AttentionMode::Generic, "generic path: preemption f32")
        } else {
            (AttentionMode::Auto, "preemption f32")
        };
        let base = EngineConfig {
            attention,
            ..EngineConfig::default()
        };
        checks.push(super::full::preemption(
            &on_device,
            device,
            (&reqs, &want),
            base,
            name,
        )?);
        checks.extend(super::full::learner_checks(&policy, device, &batch)?);
    }
    checks.push(super::handoff::hand_offs(
        &on_device, device, &reqs, &batch,
    )?);
    checks.extend(super::sampling::device_sampling(device)?);
    checks.extend(super::paged::paged_attention(
        &on_device, device, &reqs, &want,
    )?);
    checks.push(timed_rollout(&on_device, device, work.rollout)?);
    checks.extend(super::sampling::kernel_switches(device));
    checks.extend(super::paged::wide_heads(&on_device, device, &reqs));
    checks.extend(super::paged::variant_kernels(device));
    Ok(())
}

/// The completions of `reqs` by an engine on `device` in `dtype`, and the KV blocks it
/// still holds afterwards.
fn generate(
    policy: &Policy,
    device: &Device,
    dtype: DType,
    reqs: &[GenerateRequest],
) -> Result<(Vec<Completion>, usize), TrainError> {
    let cfg = EngineConfig {
        kv_cache_tokens: Some(4096),
        dtype: Some(dtype),
        ..EngineConfig::default()
    };
    let (out, engine) = generate_with(policy, device, cfg, reqs)?;
    Ok((out, blocks_held(&engine)))
}

/// KV blocks the engine holds once it has published its occupancy after the last
/// iteration (which follows the last token's delivery), waiting up to two seconds.
fn blocks_held(engine: &Engine) -> usize {
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let held = engine.stats().blocks_used;
        if held == 0 || Instant::now() > deadline {
            return held;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A training batch of the greedy completions: advantages of both signs and unequal sizes,
/// so that neither the loss nor the gradient is zero.
fn train_batch(reqs: &[GenerateRequest], completions: &[Completion]) -> TrainBatch {
    let seqs: Vec<TrainSeq> = reqs
        .iter()
        .zip(completions)
        .enumerate()
        .map(|(i, (req, c))| TrainSeq {
            tokens: [req.prompt_ids.clone(), c.token_ids.clone()].concat(),
            num_prompt_tokens: req.prompt_ids.len(),
            advantage: if i % 2 == 0 { 1.0 } else { -0.5 },
            weight: 1.0,
            rollout_logprobs: c.logprobs.clone(),
        })
        .collect();
    let num_tokens: usize = completions.iter().map(|c| c.token_ids.len()).sum();
    let max_len = completions.iter().map(|c| c.token_ids.len()).max();
    TrainBatch {
        norm: Normalisers {
            num_seqs: seqs.len() as f64,
            num_tokens: num_tokens as f64,
            max_len: max_len.unwrap_or(0) as f64,
        },
        seqs,
    }
}

/// The loss and gradient norm of one learner step on the device of `weights`.
fn learner_step(
    config: &dppo_model::ModelConfig,
    weights: &Weights,
    compute_dtype: DType,
    batch: &TrainBatch,
) -> Result<(f64, f64), TrainError> {
    let cfg = LearnerConfig {
        compute_dtype,
        ..LearnerConfig::token_mean(1e-3, 1.0, 256, 8)
    };
    let mut learner = Learner::new(config, weights, cfg)?;
    let m = learner.step(batch)?;
    Ok((m.pg_loss, m.grad_norm))
}

fn compare_learner(want: (f64, f64), got: (f64, f64), dtype: DType, exact: bool) -> Check {
    let tol = match (dtype == DType::F32, exact) {
        (true, true) => 0.0,
        (true, false) => LEARNER_TOL_F32,
        (false, _) => LEARNER_TOL_BF16,
    };
    let rule = if tol == 0.0 {
        "equal".to_string()
    } else {
        format!("<= {tol:.0e}")
    };
    let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1e-6);
    let (loss, norm) = (rel(got.0, want.0), rel(got.1, want.1));
    let finite = got.0.is_finite() && got.1.is_finite();
    Check::expect(
        finite && loss <= tol && norm <= tol,
        format!("learner {}", dtype.as_str()),
        format!(
            "loss {:.6} vs CPU {:.6}, grad norm {:.6} vs {:.6}: relative diffs {loss:.1e}, \
             {norm:.1e} ({rule})",
            got.0, want.0, got.1, want.1
        ),
        BUG_FIX,
    )
}

/// Tokens per second of a sampled rollout on `device` in its default dtype.
fn timed_rollout(
    policy: &Policy,
    device: &Device,
    (prompts, samples, new_tokens): (usize, usize, usize),
) -> Result<Check, TrainError> {
    let vocab = policy.config.vocab_size;
    let reqs: Vec<GenerateRequest> = (0..prompts)
        .map(|p| {
            let ids = (0..8 + p % 16)
                .map(|i| ((i * 13 + p * 3 + 1) % vocab) as u32)
                .collect();
            GenerateRequest {
                sampling: SamplingParams {
                    temperature: 1.0,
                    seed: Some(p as u64),
                    ..SamplingParams::default()
                },
                ignore_eos: true,
                ..GenerateRequest::new(ids, samples, new_tokens)
            }
        })
        .collect();
    let cfg = EngineConfig {
        kv_cache_tokens: Some(prompts * samples * (24 + new_tokens)),
        max_num_seqs: prompts * samples,
        ..EngineConfig::default()
    };
    let engine = Engine::new(policy, cfg, device.clone())?;
    let (out, took) = timed(device, || Ok::<_, TrainError>(engine.generate(reqs)?))?;
    let tokens: usize = out.iter().flatten().map(|c| c.token_ids.len()).sum();
    let expected = prompts * samples * new_tokens;
    let seconds = took.as_secs_f64();
    Ok(Check::expect(
        tokens == expected,
        "rollout",
        format!(
            "{prompts} prompts x {samples} samples x {new_tokens} tokens in {seconds:.2} s: \
             {:.0} tokens/s",
            tokens as f64 / seconds
        ),
        "the engine stopped early: report it with `dppo doctor --json`",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_errors_get_the_fix_of_their_kind() {
        let ptx = "DriverError(CUDA_ERROR_UNSUPPORTED_PTX_VERSION, \"the provided PTX was \
                   compiled with an unsupported toolchain.\")";
        assert!(fix_for(ptx).contains("nvcc no newer"));
        assert!(fix_for("DriverError(CUDA_ERROR_OUT_OF_MEMORY, ..)").contains("nvidia-smi"));
        assert!(fix_for("libcublasLt.so.13: cannot open").contains("LD_LIBRARY_PATH"));
        assert_eq!(fix_for("shape mismatch"), BUG_FIX);
    }
}
