//! dppo-engine: the generation engine. A paged KV cache ([`KvPool`] bookkeeping, blocks
//! read in place by [`paged_attn`] on the CPU, by [`cuda_attn`] on a GPU, by [`generic_attn`]
//! on any device), a
//! continuous-batching [`Scheduler`], a per-sequence [`sampler`], and an [`Engine`] handle that takes requests from any thread.

mod cost;
pub mod cuda_attn;
pub mod device_sample;
mod device_timing;
pub mod diff;
pub mod engine;
pub mod generic_attn;
pub mod gumbel;
#[cfg(any(all(test, target_os = "linux"), feature = "cuda"))]
mod kernel_args;
#[cfg(all(test, target_os = "linux"))]
mod kernel_emu;
pub mod kv_pool;
pub mod naive;
#[cfg(feature = "cuda")]
mod nvrtc;
pub mod paged_attn;
pub mod plan;
mod publish;
pub mod request;
pub mod runner;
pub mod sampler;
pub mod scheduler;
pub mod sequence;
pub mod truncation;
mod worker;

pub use cost::IterationCost;
pub use cuda_attn::AttentionKernel;
pub use device_sample::SamplingPlace;
pub use dppo_model::fused::inference::FusedKernels;
pub use engine::{Engine, EngineConfig, RequestHandle};
pub use kv_pool::{BlockCopy, BlockId, KvPool};
pub use plan::{Plan, ScheduledSeq};
pub use request::{Completion, Event, GenerateRequest};
pub use runner::AttentionMode;
pub use sampler::{SamplingParams, SeqRng, MAX_TOP_LOGPROBS};
pub use scheduler::{Scheduler, SchedulerConfig, SeqRequest};
pub use sequence::{FinishReason, Priority, RequestId, SeqId, Sequence};
pub use worker::EngineStats;

/// Errors of the engine; request errors say what to change.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    #[error("invalid engine config: {0}")]
    InvalidConfig(String),
    #[error("the engine has shut down")]
    Closed,
    #[error(transparent)]
    Model(#[from] dppo_model::ModelError),
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}
