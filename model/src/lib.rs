//! dppo-model: the policy network (one decoder for Llama, Qwen2 and Qwen3), its attention
//! seam, its weight files (HF safetensors, GGUF) and its tokenizer with chat template.
//!
//! The model knows nothing of KV caches: attention is delegated to an [`AttentionBackend`]
//! that the caller passes in (the trainer's packed backend, the engine's paged backend).

pub mod attention;
pub mod behaviour;
pub mod block_attn;
pub mod config;
pub mod cpu_kernel;
pub mod decoder;
pub mod device;
pub mod fast_exp;
pub mod fused;
pub mod host_data;
pub mod hub;
pub mod linear;
pub mod lm_head;
mod load;
pub mod ops;
pub mod packed;
pub mod parallel;
pub mod policy;
pub mod presets;
pub mod rope;
pub mod shapes;
pub mod streams;
pub mod template;
pub mod tokenizer;
pub mod train_layer;
pub mod uninit;
pub mod weights;

pub use attention::{AttentionBackend, CausalAttention, LayerKernels, Projection, QkNorms};
pub use config::{Arch, ModelConfig};
pub use cpu_kernel::{cpu_kernel, CpuKernel};
pub use decoder::CausalLm;
pub use device::{DeviceError, DeviceSpec};
pub use packed::{Grouping, PackedAttention, PackedRow, Part};
pub use policy::Policy;
pub use rope::RopeAt;
pub use shapes::{RandomSpec, Shape};
pub use template::{ChatMessage, ChatTemplate};
pub use tokenizer::TextTokenizer;
pub use weights::Weights;

/// Errors of the model crate; each names the file, key or tensor involved.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model config {origin}: {reason}")]
    Config { origin: String, reason: String },
    #[error("weights {origin}: {reason}")]
    Weights { origin: String, reason: String },
    #[error("tokenizer {origin}: {reason}")]
    Tokenizer { origin: String, reason: String },
    #[error("{var}: {reason}")]
    CpuKernel { var: &'static str, reason: String },
    #[error("chat template: {0}")]
    Template(String),
    /// A Hugging Face id (`Org/Name`) whose revision the local hub cache lacks.
    #[error(
        "{repo_id} is no file or directory here, and as a model id it is not in the Hugging \
         Face cache {cache} ({reason}); on a machine with network access run `{download}` \
         and copy its cache here (or set HF_HUB_CACHE to it); dppo never downloads"
    )]
    NotInHubCache {
        repo_id: String,
        cache: String,
        reason: String,
        download: String,
    },
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

/// Result with [`ModelError`].
pub type Result<T> = std::result::Result<T, ModelError>;

impl ModelError {
    pub(crate) fn io(path: &std::path::Path, source: std::io::Error) -> Self {
        ModelError::Io {
            path: path.display().to_string(),
            source,
        }
    }

    pub(crate) fn weights(origin: impl std::fmt::Display, reason: impl Into<String>) -> Self {
        ModelError::Weights {
            origin: origin.to_string(),
            reason: reason.into(),
        }
    }
}
