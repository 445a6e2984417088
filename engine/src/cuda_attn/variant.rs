//! The paged attention kernel's variants: how many loads a thread keeps in flight, in the
//! scores (16-byte loads of a K row) and in the value pass (V loads, one a key). More loads in
//! flight mean fewer round trips to memory a chunk of keys and more registers a thread (fewer
//! blocks a multiprocessor). The arithmetic and its order are the same in every variant.

use std::fmt;

use crate::EngineError;

/// One variant of `paged_attention` (`bench rollout --score-loads --value-keys`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionKernel {
    pub score_loads: u32,
    pub value_keys: u32,
}

impl AttentionKernel {
    /// The variants kernels/paged_attention.cu instantiates; the first is the default, the
    /// only one measured on a GPU so far, and the only one in the module loaded at start.
    pub const VARIANTS: [Self; 5] = [
        Self::new(1, 8),
        Self::new(1, 16),
        Self::new(1, 32),
        Self::new(8, 8),
        Self::new(8, 32),
    ];

    pub const fn new(score_loads: u32, value_keys: u32) -> Self {
        Self {
            score_loads,
            value_keys,
        }
    }

    /// Whether this is the default, compiled into the kernels' main module.
    pub fn is_default(self) -> bool {
        self == Self::default()
    }

    /// The kernel's name for elements of `dtype_suffix` (`f32`, `bf16`, `f16`).
    pub fn kernel_name(self, dtype_suffix: &str) -> String {
        format!("paged_attention_{dtype_suffix}_{self}")
    }

    /// An error naming the variants where this is none of them.
    pub fn check(self) -> Result<(), EngineError> {
        if Self::VARIANTS.contains(&self) {
            return Ok(());
        }
        let known: Vec<String> = Self::VARIANTS.iter().map(|v| v.to_string()).collect();
        Err(EngineError::InvalidConfig(format!(
            "no paged attention kernel with {} score loads and {} value keys in flight; the \
             variants are {} (s: score loads, v: value keys)",
            self.score_loads,
            self.value_keys,
            known.join(", ")
        )))
    }
}

impl Default for AttentionKernel {
    fn default() -> Self {
        Self::VARIANTS[0]
    }
}

/// `s<score loads>_v<value keys>`, the kernels' suffix.
impl fmt::Display for AttentionKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s{}_v{}", self.score_loads, self.value_keys)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every variant the host can name is one the kernel source instantiates, under the name
    /// the launchers look up, and the default is in the main module, the others only in the
    /// variants' module.
    #[test]
    fn every_variant_is_instantiated_under_its_name() {
        let source = super::super::SOURCE;
        let (main, variants) = source
            .split_once("#ifdef ATTENTION_VARIANTS")
            .expect("the variants' section");
        for v in AttentionKernel::VARIANTS {
            let line = format!("ATTENTION(NAME, T, {}, {})", v.score_loads, v.value_keys);
            let (here, there) = if v.is_default() {
                (main, variants)
            } else {
                (variants, main)
            };
            assert!(here.contains(&line), "{v}: {line}");
            assert!(!there.contains(&line), "{v} in both modules");
            assert_eq!(v.kernel_name("bf16"), format!("paged_attention_bf16_{v}"));
        }
        let err = AttentionKernel::new(2, 8).check().unwrap_err().to_string();
        assert!(err.contains("s1_v8, s1_v16"), "{err}");
    }
}
