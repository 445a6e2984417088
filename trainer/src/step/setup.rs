//! From a run's config to the learner's and the engine's: the settings each takes, the
//! GPU memory budget that sizes the KV cache, and the start-up checks between them.

use candle_core::{DType, Device};
use dppo_engine::EngineConfig;
use dppo_model::Policy;

use crate::config::RunConfig;
use crate::learner::LearnerConfig;
use crate::memory_budget::{
    self, BudgetInputs, LearnerInputs, MemoryBudget, ModelShape, Precision,
};
use crate::optim::{AdamWConfig, LrSchedule};
use crate::TrainError;

/// The learner's settings (`[actor]`, `[pack]`, `[train]`) on `device`.
pub(super) fn learner_config(cfg: &RunConfig, device: &Device) -> LearnerConfig {
    LearnerConfig {
        loss: cfg.loss(),
        adamw: AdamWConfig {
            weight_decay: cfg.actor.weight_decay,
            ..AdamWConfig::default()
        },
        schedule: LrSchedule {
            lr: cfg.actor.lr,
            warmup_steps: cfg.actor.warmup_steps,
            cosine_total_steps: None,
            min_lr: 0.0,
        },
        grad_clip: cfg.actor.grad_clip,
        pack_tokens: cfg.pack.tokens,
        pack_window: cfg.pack.window,
        compute_dtype: cfg.train.compute_dtype.resolve(device),
    }
}

/// The engine's settings (`[engine]`, `deterministic`) on `device`: on a GPU the KV cache
/// gets what the memory budget leaves for sequences of `seq_len` tokens; the CPU keeps its
/// size.
pub(super) fn engine_config(
    cfg: &RunConfig,
    policy: &Policy,
    device: &Device,
    learner_dtype: DType,
    seq_len: usize,
) -> Result<EngineConfig, TrainError> {
    let mut engine = EngineConfig {
        kv_cache_bytes: 1 << 30,
        isolate_high_priority: cfg.deterministic,
        attention: cfg.engine.attention,
        dtype: Some(cfg.engine.dtype.resolve(device)),
        sampling: cfg.engine.sampling,
        lazy_noise: cfg.engine.lazy_noise,
        split_draws: cfg.engine.split_draws,
        fused_kernels: cfg.engine.fused_kernels,
        rope_kernel: cfg.engine.rope_kernel,
        rope_writes_kv: cfg.engine.rope_writes_kv,
        rope_qk_norm: cfg.engine.rope_qk_norm,
        layer_kernels: cfg.engine.layer_kernels,
        cuda_graphs: cfg.engine.cuda_graphs,
        ..EngineConfig::default()
    };
    if let Some((free, total)) = dppo_model::device::memory_info(device)? {
        let budget = gpu_budget(cfg, policy, &engine, learner_dtype, (free, total), seq_len)?;
        tracing::info!("GPU memory budget:\n{budget}");
        engine.kv_cache_tokens = Some(budget.kv_tokens as usize);
    }
    Ok(engine)
}

/// Start-up checks: the `longest` prompt plus `max_response_len` must fit the model's
/// `context` (else the first rollout would fail, after the warm-up) and one packed buffer.
pub(super) fn check_lengths(
    cfg: &RunConfig,
    longest: usize,
    context: usize,
) -> Result<(), TrainError> {
    let needed = longest + cfg.rollout.max_response_len;
    if needed > context {
        return Err(TrainError::Config(format!(
            "rollout.max_response_len = {} with the longest prompt ({longest} tokens) needs \
             {needed} tokens, over the model's context of {context}; set \
             rollout.max_response_len <= {} (or leave long prompts out with \
             data.max_prompt_length)",
            cfg.rollout.max_response_len,
            context.saturating_sub(longest)
        )));
    }
    if needed > cfg.pack.tokens {
        return Err(TrainError::Config(format!(
            "pack.tokens = {} is smaller than the longest prompt ({longest} tokens) plus \
             rollout.max_response_len ({}); set pack.tokens >= {needed}",
            cfg.pack.tokens, cfg.rollout.max_response_len
        )));
    }
    Ok(())
}

/// The memory budget of a co-located run on a GPU with `free` of `total` bytes, in the
/// engine's and the learner's dtypes.
fn gpu_budget(
    cfg: &RunConfig,
    policy: &Policy,
    engine: &EngineConfig,
    learner_dtype: DType,
    (free, total): (u64, u64),
    seq_len: usize,
) -> Result<MemoryBudget, TrainError> {
    Ok(memory_budget::budget(&BudgetInputs {
        model: ModelShape::from(&policy.config),
        engine_dtype: precision(engine.dtype.unwrap_or(DType::F32)),
        learner: Some(LearnerInputs {
            compute_dtype: precision(learner_dtype),
            pack_tokens: cfg.pack.tokens as u64,
        }),
        total_memory: total,
        free_memory: free,
        gpu_memory_utilization: cfg.engine.gpu_memory_utilization,
        block_size: engine.block_size as u64,
        max_batched_tokens: engine.max_batched_tokens as u64,
        seq_len: seq_len as u64,
    })?)
}

/// The memory budget's name of a floating-point dtype.
fn precision(dtype: DType) -> Precision {
    match dtype {
        DType::BF16 => Precision::Bf16,
        DType::F16 => Precision::F16,
        _ => Precision::F32,
    }
}
