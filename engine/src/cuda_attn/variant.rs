//! The paged attention kernel's variants: how many loads a thread keeps in flight, in the
//! scores (16-byte loads of a K row) and in the value pass (V loads, one a key), and how the
//! value pass divides its work. More loads in flight mean fewer round trips to memory a chunk
//! of keys and more registers a thread (fewer blocks a multiprocessor). The arithmetic is the
//! same in every variant, and so is its order except for the split value pass's (the twin
//! follows both).

use std::fmt;

use super::{Heads, CHUNK, MAX_SHARED_BYTES, THREADS};
use crate::EngineError;

/// The split value pass's thread: its dimensions and pairs (the kernel's `SPLIT_DIMS`,
/// `SPLIT_PAIRS`), and the floats of the key groups' sums when they meet (`SPLIT_PARTIALS`).
pub const SPLIT_DIMS: usize = 4;
pub const SPLIT_PAIRS: usize = 8;
const SPLIT_PARTIALS: usize = THREADS * SPLIT_PAIRS * SPLIT_DIMS;

/// One variant of `paged_attention` (`bench rollout --score-loads --value-keys
/// --split-values`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionKernel {
    pub score_loads: u32,
    pub value_keys: u32,
    /// The value pass split by key groups, a thread's sums in registers across chunks, each
    /// V load feeding SPLIT_PAIRS x SPLIT_DIMS FMAs (the kernel's `SPLIT_VALUES`).
    pub split_values: bool,
}

impl AttentionKernel {
    /// The variants kernels/paged_attention.cu instantiates; the first is the default, the
    /// only one measured on a GPU so far, and the only one in the module loaded at start.
    pub const VARIANTS: [Self; 6] = [
        Self::new(1, 8),
        Self::new(1, 16),
        Self::new(1, 32),
        Self::new(8, 8),
        Self::new(8, 32),
        Self::split(8, 4),
    ];

    pub const fn new(score_loads: u32, value_keys: u32) -> Self {
        Self {
            score_loads,
            value_keys,
            split_values: false,
        }
    }

    /// The variant with the split value pass.
    pub const fn split(score_loads: u32, value_keys: u32) -> Self {
        Self {
            split_values: true,
            ..Self::new(score_loads, value_keys)
        }
    }

    /// Dynamic shared memory of a block serving `pairs` pairs (the kernel's layout).
    pub fn shared_bytes(self, pairs: usize, head_dim: usize) -> usize {
        if self.split_values {
            let padded = pairs.next_multiple_of(SPLIT_PAIRS);
            4 * (pairs * head_dim + SPLIT_PARTIALS + padded * CHUNK + CHUNK + 3 * padded)
        } else {
            4 * (2 * pairs * head_dim + pairs * CHUNK + CHUNK + 3 * pairs)
        }
    }

    /// Key groups of the split value pass for a block of `pairs` pairs (1 otherwise): the
    /// threads over the items (SPLIT_DIMS dimensions by SPLIT_PAIRS pairs) each serves.
    pub fn key_groups(self, pairs: usize, head_dim: usize) -> usize {
        match self.split_values {
            true => THREADS / (head_dim / SPLIT_DIMS * pairs.div_ceil(SPLIT_PAIRS)),
            false => 1,
        }
    }

    /// An error naming what this variant cannot serve of `heads` (which `Heads::check` has
    /// passed for the default): the split value pass needs a thread for each of a tile's
    /// items and its layout within 48 KiB.
    pub fn check_heads(self, heads: Heads) -> Result<(), EngineError> {
        let pairs = heads.max_tile_pairs();
        let items = heads.head_dim / SPLIT_DIMS * pairs.div_ceil(SPLIT_PAIRS);
        if !self.split_values
            || (items <= THREADS && self.shared_bytes(pairs, heads.head_dim) <= MAX_SHARED_BYTES)
        {
            return Ok(());
        }
        Err(EngineError::InvalidConfig(format!(
            "the attention variant {self} does not serve {pairs} query heads and rows a tile at \
             head_dim {}",
            heads.head_dim
        )))
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
            "no paged attention kernel with {} score loads and {} value keys in flight{}; the \
             variants are {} (s: score loads, v: value keys, split: the split value pass)",
            self.score_loads,
            self.value_keys,
            if self.split_values { ", split" } else { "" },
            known.join(", ")
        )))
    }
}

impl Default for AttentionKernel {
    fn default() -> Self {
        Self::VARIANTS[0]
    }
}

/// `s<score loads>_v<value keys>[_split]`, the kernels' suffix.
impl fmt::Display for AttentionKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "s{}_v{}", self.score_loads, self.value_keys)?;
        if self.split_values {
            write!(f, "_split")?;
        }
        Ok(())
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
            let macro_name = match v.split_values {
                true => "ATTENTION_SPLIT",
                false => "ATTENTION",
            };
            let line = format!("{macro_name}(NAME, T, {}, {})", v.score_loads, v.value_keys);
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

    /// The split value pass serves every head layout the default does up to 16 pairs a tile
    /// at head_dim 256 (a thread an item), and refuses one whose tile has more items than
    /// threads, saying which.
    #[test]
    fn the_split_variant_serves_the_heads_it_has_threads_for() {
        let split = AttentionKernel::split(8, 4);
        let heads = |group: usize, head_dim| Heads {
            num_heads: 2 * group,
            num_kv_heads: 2,
            head_dim,
        };
        for (group, head_dim) in [(1, 64), (7, 64), (6, 128), (8, 256), (16, 256), (32, 64)] {
            assert!(heads(group, head_dim).check().is_ok());
            assert!(
                split.check_heads(heads(group, head_dim)).is_ok(),
                "{group} x {head_dim}"
            );
            let pairs = heads(group, head_dim).max_tile_pairs();
            assert!(split.key_groups(pairs, head_dim) >= 1);
        }
        // 7 query heads a KV head at head_dim 64: 16 items (16 four-dimension slices of one
        // group of 8 pairs), so 8 key groups.
        assert_eq!(split.key_groups(7, 64), 8);
        assert_eq!(AttentionKernel::default().key_groups(7, 64), 1);
        let wide = heads(40, 128);
        let err = split.check_heads(wide).unwrap_err().to_string();
        assert!(err.contains("s8_v4_split") && err.contains("40"), "{err}");
    }
}
