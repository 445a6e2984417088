//! The paged attention kernels (`engine.attention = "cuda"`) on the GPU: the kernels alone
//! against the generic path and the f64 reference, in f32, bf16 and f16 (the attention's
//! two defaults here, its variants after every other check of the device); then the engine on
//! them against the CPU, greedy, with forked samples, 4-token blocks and a pool that
//! preempts (f32), in bf16 without and with candle-nn's fused kernels, and the same with
//! `engine.rope_kernel`, then also `engine.layer_kernels`, then also `engine.rope_writes_kv`, on
//! a model with q/k/v biases; and on the doctor's own model, whose q/k norms the rope kernel
//! takes with `engine.rope_qk_norm`. Near the end, the engine's defaults on a head_dim-64
//! variant (the tensor-core attention's path), then with `engine.cuda_graphs`.

use candle_core::Device;
use dppo_engine::{Completion, GenerateRequest};
use dppo_model::Policy;

#[cfg(any(test, feature = "cuda"))]
use candle_core::DType;
#[cfg(feature = "cuda")]
use dppo_engine::AttentionKernel;
#[cfg(any(test, feature = "cuda"))]
use dppo_engine::{AttentionMode, EngineConfig};

#[cfg(any(test, feature = "cuda"))]
use super::compare::{compare_greedy, generate_with, BUG_FIX};
#[cfg(any(test, feature = "cuda"))]
use super::full::preemption;
use super::Check;
#[cfg(any(test, feature = "cuda"))]
use super::SEED;
use crate::TrainError;

const NAME: &str = "paged attention kernels";
/// The random weights' standard deviation in the rope kernel's model. Without q/k norms the
/// doctor's usual draw makes attention scores so large that bf16's rounding alone flips
/// greedy choices: on the CPU's generic path, with no kernel of ours, 136 of 512 greedy tokens
/// agreed with f32 (mean logprob difference 9.5e-2). At 0.07, 335 of 512 (1.8e-2).
#[cfg(any(test, feature = "cuda"))]
const VARIANT_STD: f32 = 0.07;

/// Skipped on the CPU (the kernels' CPU twin and their emulation are checked by the tests).
pub(super) fn paged_attention(
    policy: &Policy,
    device: &Device,
    reqs: &[GenerateRequest],
    want: &[Completion],
) -> Result<Vec<Check>, TrainError> {
    if !device.is_cuda() {
        return Ok(vec![Check::skip(
            NAME,
            "the CUDA kernels run on a GPU; their CPU twin and emulation are checked by the \
             tests",
        )]);
    }
    on_gpu(policy, device, reqs, want)
}

#[cfg(feature = "cuda")]
fn on_gpu(
    policy: &Policy,
    device: &Device,
    reqs: &[GenerateRequest],
    want: &[Completion],
) -> Result<Vec<Check>, TrainError> {
    // The default attention kernels (tensor cores where they serve, the scalar kernel
    // elsewhere); the other variants come last of all the device's checks
    // ([`variant_kernels`]).
    let mut checks = vec![checked_alone(device, AttentionKernel::SCALAR)];
    let tensor = AttentionKernel::TENSOR_CORE;
    checks.push(match device {
        Device::Cuda(d) if !dppo_engine::cuda_attn::tensor_cores(d)? => Check::skip(
            variant_name(tensor),
            "the GPU is older than sm_80: the scalar kernel serves every model",
        ),
        _ => checked_alone(device, tensor),
    });
    // The attention kernels alone here; the rope and layer kernels have checks of their own.
    let base = EngineConfig {
        attention: AttentionMode::Cuda,
        rope_kernel: false,
        layer_kernels: false,
        ..EngineConfig::default()
    };
    checks.extend(engine_checks(
        policy,
        device,
        (reqs, want),
        (base, "paged kernels"),
        &[false, true],
    ));
    // The doctor's model has q/k norms: the rope kernel takes them with
    // `engine.rope_qk_norm` (bf16 with the fused kernels, which concatenate the projections),
    // the layer kernels on too: the engine's defaults on a GPU.
    let qk_norms = EngineConfig {
        rope_kernel: true,
        rope_qk_norm: true,
        layer_kernels: true,
        ..base
    };
    checks.extend(engine_checks(
        policy,
        device,
        (reqs, want),
        (qk_norms, "rope kernel q/k norms"),
        &[true],
    ));
    checks.extend(variant_checks(policy, device, reqs, AttentionMode::Cuda));
    Ok(checks)
}

/// The attention kernel `variant` alone on the checked batches, against the generic path and
/// the f64 reference (its variants' checks named after them).
#[cfg(feature = "cuda")]
fn kernels_alone(device: &Device, variant: AttentionKernel) -> Result<Check, TrainError> {
    let reports = dppo_engine::cuda_attn::device_check::run(device, variant)?;
    let detail = reports
        .iter()
        .map(|r| {
            format!(
                "{:?}: {} cases, max diff {:.1e} vs f64, {:.1e} vs generic (<= {:.0e}), {} \
                 pools differ",
                r.dtype, r.cases, r.vs_reference, r.vs_generic, r.tolerance, r.pools_differing
            )
        })
        .chain(reports.iter().filter_map(|r| r.first_failure.clone()))
        .collect::<Vec<_>>()
        .join("; ");
    Ok(Check::expect(
        reports.iter().all(|r| r.passed()),
        variant_name(variant),
        detail,
        BUG_FIX,
    ))
}

/// The check's name for the attention kernel `variant`.
/// The attention kernel's variants besides the default (an experiment of `bench rollout`),
/// each alone on the checked batches: run after every other check of the device, since a
/// variant that faults can leave the GPU's context unusable (CUDA's sticky errors) for all
/// that follows it. A variant that fails fails its own check; on the CPU, none.
pub(super) fn variant_kernels(device: &Device) -> Vec<Check> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        return AttentionKernel::VARIANTS
            .into_iter()
            .filter(|v| !v.is_default())
            .map(|variant| checked_alone(device, variant).of_experiment())
            .collect();
    }
    let _ = device;
    Vec::new()
}

/// The engine's defaults on the kernels in bf16 on a head_dim-64 variant of the doctor's
/// model (Qwen2.5-0.5B's heads; the doctor's own are 32 wide and run `s1_v8`), so on the
/// attention's tensor-core default where the GPU has it, against the variant's CPU
/// completions; then with `engine.cuda_graphs` (an experiment's check until a GPU passes
/// it) against that engine, where only the padding and the replay differ, and the CPU,
/// failing where no step was replayed. Run after the other checks but the variants': a
/// replay that faults leaves the GPU's context unusable for all that follows it.
pub(super) fn wide_heads(policy: &Policy, device: &Device, reqs: &[GenerateRequest]) -> Vec<Check> {
    #[cfg(feature = "cuda")]
    if device.is_cuda() {
        return wide_heads_checks(policy, device, reqs, AttentionMode::Cuda, true);
    }
    let _ = (policy, device, reqs);
    Vec::new()
}

/// [`wide_heads`] on `attention`, the graphs' check where `graphs`.
#[cfg(any(test, feature = "cuda"))]
fn wide_heads_checks(
    policy: &Policy,
    device: &Device,
    reqs: &[GenerateRequest],
    attention: AttentionMode,
    graphs: bool,
) -> Vec<Check> {
    const WIDE: &str = "paged kernels at head_dim 64: greedy bf16";
    const GRAPHS: &str = "cuda graphs: greedy bf16";
    let (variant, want) = match reference(policy, reqs, |c| c.head_dim = 64, super::WEIGHT_STD) {
        Ok(reference) => reference,
        Err(e) => return vec![Check::fail(WIDE, e.to_string(), BUG_FIX)],
    };
    let eager = EngineConfig {
        attention,
        kv_cache_tokens: Some(4096),
        dtype: Some(DType::BF16),
        ..EngineConfig::default()
    };
    let (plain, wide) = match generate_with(&variant, device, eager, reqs) {
        Ok((plain, engine)) => {
            let wide = kernel_check(WIDE, &want, &plain, &engine);
            (plain, wide)
        }
        Err(e) => return vec![Check::fail(WIDE, e.to_string(), BUG_FIX)],
    };
    if !graphs {
        return vec![wide];
    }
    let with_graphs = EngineConfig {
        cuda_graphs: true,
        ..eager
    };
    let graphs = match generate_with(&variant, device, with_graphs, reqs) {
        Ok((got, engine)) => {
            let stats = engine.stats();
            let (padded, replays) = (stats.cost.padded_steps, stats.cost.graph_replays);
            let vs_eager = compare_greedy(&plain, &got, DType::BF16, false);
            let vs_cpu = compare_greedy(&want, &got, DType::BF16, false);
            let passed = replays > 0
                && vs_eager.status == super::Status::Ok
                && vs_cpu.status == super::Status::Ok;
            let detail = format!(
                "{replays} of {padded} padded decode steps replayed; against the engine without \
                 graphs: {}; against the CPU: {}",
                vs_eager.detail, vs_cpu.detail
            );
            Check::expect(passed, GRAPHS, detail, BUG_FIX)
        }
        Err(e) => Check::fail(GRAPHS, e.to_string(), BUG_FIX),
    };
    vec![wide, graphs.of_experiment()]
}

/// `got` (`engine`'s greedy completions) against the CPU's `want` in bf16, as a check named
/// `name` that says which attention kernel ran.
#[cfg(any(test, feature = "cuda"))]
fn kernel_check(
    name: &str,
    want: &[Completion],
    got: &[Completion],
    engine: &dppo_engine::Engine,
) -> Check {
    let check = compare_greedy(want, got, DType::BF16, false);
    let on = match engine.stats().attention_kernel {
        Some(kernel) => format!("attention kernel {kernel}"),
        None => "the generic path".to_string(),
    };
    Check {
        name: name.to_string(),
        detail: format!("on {on}: {}", check.detail),
        ..check
    }
}

/// A variant of `policy`'s model (`edit` applied to its config, random weights of standard
/// deviation `std`) and its CPU f32 greedy completions of `reqs`: the reference its engine
/// checks compare with.
#[cfg(any(test, feature = "cuda"))]
fn reference(
    policy: &Policy,
    reqs: &[GenerateRequest],
    edit: impl FnOnce(&mut dppo_model::ModelConfig),
    std: f32,
) -> Result<(Policy, Vec<Completion>), TrainError> {
    let mut config = policy.config.clone();
    edit(&mut config);
    let weights = dppo_model::Weights::random(&config, std, SEED, &Device::Cpu)?;
    let variant = Policy::new(config, weights, policy.tokenizer.clone())?;
    let cpu = EngineConfig {
        dtype: Some(DType::F32),
        ..EngineConfig::default()
    };
    let want = generate_with(&variant, &Device::Cpu, cpu, reqs)?.0;
    Ok((variant, want))
}

/// [`kernels_alone`], an error failing the variant's check.
#[cfg(feature = "cuda")]
fn checked_alone(device: &Device, variant: AttentionKernel) -> Check {
    kernels_alone(device, variant)
        .unwrap_or_else(|e| Check::fail(variant_name(variant), e.to_string(), BUG_FIX))
}

#[cfg(feature = "cuda")]
fn variant_name(variant: AttentionKernel) -> String {
    match variant == AttentionKernel::SCALAR {
        true => NAME.to_string(),
        false => format!("{NAME}, variant {variant}"),
    }
}

/// The engine of `base` (its attention backend and switches) against the CPU's greedy
/// `want` for `reqs`: each prompt sampled twice (the second sample forks the first's blocks)
/// with 4-token blocks in a pool that preempts, in f32; then in bf16 without and with the
/// fused kernels, as `bf16_fused` lists. Checks named after `label`; an engine error fails
/// its own check, not the checks after it.
#[cfg(any(test, feature = "cuda"))]
fn engine_checks(
    policy: &Policy,
    device: &Device,
    (reqs, want): (&[GenerateRequest], &[Completion]),
    (base, label): (EngineConfig, &str),
    bf16_fused: &[bool],
) -> Vec<Check> {
    let forked: Vec<GenerateRequest> = reqs
        .iter()
        .map(|r| GenerateRequest { n: 2, ..r.clone() })
        .collect();
    let twice: Vec<Completion> = want.iter().flat_map(|c| [c.clone(), c.clone()]).collect();
    let failed = |name: &str, e: TrainError| Check::fail(name, e.to_string(), BUG_FIX);
    let name = format!("{label}: forks, preemption f32");
    let preemption = preemption(policy, device, (&forked, &twice), base, &name)
        .unwrap_or_else(|e| failed(&name, e));
    let bf16 = |fused: bool| {
        let name = match fused {
            true => format!("{label}, fused: greedy bf16"),
            false => format!("{label}: greedy bf16"),
        };
        let cfg = EngineConfig {
            kv_cache_tokens: Some(4096),
            dtype: Some(DType::BF16),
            fused_kernels: fused.into(),
            ..base
        };
        match generate_with(policy, device, cfg, reqs) {
            Ok((got, _)) => Check {
                name,
                ..compare_greedy(want, &got, DType::BF16, false)
            },
            Err(e) => failed(&name, e),
        }
    };
    std::iter::once(preemption)
        .chain(bf16_fused.iter().map(|&fused| bf16(fused)))
        .collect()
}

/// [`engine_checks`] with `engine.rope_kernel`, then with `engine.layer_kernels` too, then
/// with `engine.rope_writes_kv` as well (an experiment's checks), on a
/// Qwen2-style variant of the doctor's model (q/k/v biases, no q/k norms: the projections
/// the rope kernel serves; smaller weights, [`VARIANT_STD`]), against the variant's own CPU
/// completions; in bf16 with the fused kernels only (the kernels need the projections they
/// concatenate). A failure to build the variant or its reference fails one check, not the
/// doctor.
#[cfg(any(test, feature = "cuda"))]
fn variant_checks(
    policy: &Policy,
    device: &Device,
    reqs: &[GenerateRequest],
    attention: AttentionMode,
) -> Vec<Check> {
    let qwen2 = |config: &mut dppo_model::ModelConfig| {
        config.arch = dppo_model::Arch::Qwen2;
        config.qkv_bias = true;
        config.qk_norm = false;
    };
    let (variant, want) = match reference(policy, reqs, qwen2, VARIANT_STD) {
        Ok(reference) => reference,
        Err(e) => return vec![Check::fail("rope kernel", e.to_string(), BUG_FIX)],
    };
    [
        ((false, false), "rope kernel"),
        ((true, false), "layer kernels"),
        ((true, true), "rope K/V writes"),
    ]
    .into_iter()
    .flat_map(|((layer_kernels, rope_writes_kv), label)| {
        let base = EngineConfig {
            attention,
            rope_kernel: true,
            rope_writes_kv,
            layer_kernels,
            ..EngineConfig::default()
        };
        let checks = engine_checks(&variant, device, (reqs, &want), (base, label), &[true]);
        // `engine.rope_writes_kv` is off by default until a GPU has passed it.
        checks.into_iter().map(move |c| match rope_writes_kv {
            true => c.of_experiment(),
            false => c,
        })
    })
    .collect()
}

#[cfg(not(feature = "cuda"))]
fn on_gpu(
    _: &Policy,
    device: &Device,
    _: &[GenerateRequest],
    _: &[Completion],
) -> Result<Vec<Check>, TrainError> {
    Ok(vec![Check::skip(
        NAME,
        format!("no CUDA kernels in this build for {:?}", device.location()),
    )])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::doctor::workload::{greedy_requests, model, Workload};
    use crate::doctor::Status;

    /// The engine checks the GPU runs on the kernels, run here through the generic path (the
    /// CPU kernel has no bf16) on `dppo doctor --full`'s model and requests: their forked
    /// samples line up with the CPU's completions, the pool preempts, and bf16 agrees, with
    /// and without the fused kernels, on the doctor's model and on the rope and layer
    /// kernels' variant.
    #[test]
    fn the_engine_checks_pass_through_the_generic_path() {
        let policy = model(true).unwrap();
        let reqs = greedy_requests(&Workload::of(true), policy.config.vocab_size);
        let cfg = EngineConfig {
            dtype: Some(DType::F32),
            ..EngineConfig::default()
        };
        let want = generate_with(&policy, &Device::Cpu, cfg, &reqs).unwrap().0;
        let base = EngineConfig {
            attention: AttentionMode::Generic,
            ..EngineConfig::default()
        };
        let mut checks = engine_checks(
            &policy,
            &Device::Cpu,
            (&reqs, &want),
            (base, "paged kernels"),
            &[false, true],
        );
        checks.extend(variant_checks(
            &policy,
            &Device::Cpu,
            &reqs,
            AttentionMode::Generic,
        ));
        // The head_dim-64 variant (Qwen2.5-0.5B's heads, the tensor-core kernel's on a GPU)
        // agrees in bf16 as the doctor requires there.
        let wide = wide_heads_checks(&policy, &Device::Cpu, &reqs, AttentionMode::Generic, false);
        assert_eq!(wide.len(), 1);
        assert!(
            wide[0].detail.starts_with("on the generic path: "),
            "{}",
            wide[0].detail
        );
        checks.extend(wide);
        assert_eq!(checks.len(), 10);
        for check in &checks {
            assert_eq!(check.status, Status::Ok, "{}: {}", check.name, check.detail);
        }
        assert!(
            !checks[0].detail.contains(" 0 preemptions"),
            "{}",
            checks[0].detail
        );
    }
}
