//! The paged attention kernel's variants. The scalar ones (FMAs on the CUDA cores) differ in
//! how many loads a thread keeps in flight, in the scores (16-byte loads of a K row) and in
//! the value pass (V loads, one a key), and in how the value pass divides its work: more
//! loads in flight mean fewer round trips to memory a chunk of keys and more registers a
//! thread. Their arithmetic and its order are the same except for the split value pass's.
//! `mma` computes the scores and the values on tensor cores instead, with probabilities
//! rounded to the element type (bf16 and f16 only); `mma_staged` does the same arithmetic on
//! operands staged through shared memory. The twin follows every order.

use std::fmt;
use std::str::FromStr;

use candle_core::DType;

use super::{Heads, CHUNK, MAX_SHARED_BYTES, THREADS};
use crate::EngineError;

/// The split value pass's thread: its dimensions and pairs (the kernel's `SPLIT_DIMS`,
/// `SPLIT_PAIRS`), and the floats of the key groups' sums when they meet (`SPLIT_PARTIALS`).
pub const SPLIT_DIMS: usize = 4;
pub const SPLIT_PAIRS: usize = 8;
const SPLIT_PARTIALS: usize = THREADS * SPLIT_PAIRS * SPLIT_DIMS;
/// The tensor-core kernel's rows (pairs padded to an m16n8k16 product's 16) and its warps,
/// each with its own maxima, sums and outputs when they meet (the kernel's `MMA_ROWS`), an
/// output row padded by `MMA_PAD` floats in shared memory.
pub const MMA_ROWS: usize = 16;
const MMA_PAD: usize = 8;
const WARPS: usize = THREADS / 32;
/// The head dims the tensor-core kernel is instantiated for.
pub const MMA_HEAD_DIMS: [usize; 2] = [64, 128];

/// One variant of `paged_attention` (`bench rollout --attention-kernel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKernel {
    /// FMAs on the CUDA cores.
    Scalar {
        score_loads: u32,
        value_keys: u32,
        /// The value pass split by key groups, a thread's sums in registers across chunks,
        /// each V load feeding SPLIT_PAIRS x SPLIT_DIMS FMAs (the kernel's `SPLIT_VALUES`).
        split_values: bool,
    },
    /// Scores and values as m16n8k16 products on tensor cores, each warp a quarter of the
    /// keys (`paged_attention_mma`); `staged`: each run's K and V rows copied whole into
    /// shared memory and the operands read from there by ldmatrix (the same arithmetic).
    Mma { staged: bool },
}

impl AttentionKernel {
    /// The default where tensor cores do not serve (f32, other head dims, GPUs before sm_80).
    pub const SCALAR: Self = Self::new(1, 8);
    /// The default where it serves: the fastest on both target shapes on an H200.
    pub const TENSOR_CORE: Self = Self::Mma { staged: true };

    /// The variants the kernel source instantiates: the two defaults first, the only ones in
    /// the module loaded at start, then the others likeliest winner first (`gpu-check
    /// --profile` races them in this order, so a spent budget drops the last).
    pub const VARIANTS: [Self; 8] = [
        Self::SCALAR,
        Self::TENSOR_CORE,
        Self::Mma { staged: false },
        Self::split(8, 4),
        Self::new(1, 16),
        Self::new(1, 32),
        Self::new(8, 8),
        Self::new(8, 32),
    ];

    pub const fn new(score_loads: u32, value_keys: u32) -> Self {
        Self::Scalar {
            score_loads,
            value_keys,
            split_values: false,
        }
    }

    /// The variant with the split value pass.
    pub const fn split(score_loads: u32, value_keys: u32) -> Self {
        Self::Scalar {
            score_loads,
            value_keys,
            split_values: true,
        }
    }

    /// Whether this variant runs on tensor cores.
    pub fn is_mma(self) -> bool {
        matches!(self, Self::Mma { .. })
    }

    /// Whether this is a scalar variant with the split value pass.
    pub fn split_values(self) -> bool {
        matches!(
            self,
            Self::Scalar {
                split_values: true,
                ..
            }
        )
    }

    /// Dynamic shared memory of a block serving `pairs` pairs (the kernel's layout).
    pub fn shared_bytes(self, pairs: usize, head_dim: usize) -> usize {
        match self {
            // The staged rows (fewer bytes) use the same bytes before the warps meet.
            Self::Mma { .. } => 4 * (WARPS * MMA_ROWS * (2 + head_dim + MMA_PAD) + 2 * MMA_ROWS),
            _ if self.split_values() => {
                let padded = pairs.next_multiple_of(SPLIT_PAIRS);
                4 * (pairs * head_dim + SPLIT_PARTIALS + padded * CHUNK + CHUNK + 3 * padded)
            }
            _ => 4 * (2 * pairs * head_dim + pairs * CHUNK + CHUNK + 3 * pairs),
        }
    }

    /// Key groups of the split value pass for a block of `pairs` pairs (1 otherwise): the
    /// threads over the items (SPLIT_DIMS dimensions by SPLIT_PAIRS pairs) each serves.
    pub fn key_groups(self, pairs: usize, head_dim: usize) -> usize {
        match self.split_values() {
            true => THREADS / (head_dim / SPLIT_DIMS * pairs.div_ceil(SPLIT_PAIRS)),
            false => 1,
        }
    }

    /// An error naming what this variant cannot serve of `heads` (which `Heads::check` has
    /// passed for the default) in `dtype`: the split value pass needs a thread for each of a
    /// tile's items and its layout within 48 KiB; the tensor-core kernel takes bf16 and f16,
    /// 16 pairs a tile and the head dims it is instantiated for.
    pub fn check_serves(self, heads: Heads, dtype: DType) -> Result<(), EngineError> {
        let pairs = heads.max_tile_pairs();
        let refuse = |what: String| {
            Err(EngineError::InvalidConfig(format!(
                "the attention variant {self} does not serve {what}"
            )))
        };
        if !Self::VARIANTS.contains(&self) {
            return refuse("anything: the kernel source does not instantiate it".into());
        }
        match self {
            Self::Mma { .. } if !matches!(dtype, DType::BF16 | DType::F16) => {
                refuse(format!("{dtype:?} (tensor cores take bf16 and f16)"))
            }
            Self::Mma { .. } if pairs > MMA_ROWS || !MMA_HEAD_DIMS.contains(&heads.head_dim) => {
                refuse(format!(
                    "{pairs} query heads and rows a tile at head_dim {} (it takes up to \
                     {MMA_ROWS} at head_dim {MMA_HEAD_DIMS:?})",
                    heads.head_dim
                ))
            }
            _ if self.split_values() => {
                let items = heads.head_dim / SPLIT_DIMS * pairs.div_ceil(SPLIT_PAIRS);
                match items <= THREADS
                    && self.shared_bytes(pairs, heads.head_dim) <= MAX_SHARED_BYTES
                {
                    true => Ok(()),
                    false => refuse(format!(
                        "{pairs} query heads and rows a tile at head_dim {}",
                        heads.head_dim
                    )),
                }
            }
            _ => Ok(()),
        }
    }

    /// Whether this variant serves `heads` in `dtype`.
    pub fn serves(self, heads: Heads, dtype: DType) -> bool {
        self.check_serves(heads, dtype).is_ok()
    }

    /// The default for `heads` in `dtype`: [`Self::TENSOR_CORE`] where it serves them and the
    /// GPU has `tensor_cores` (sm_80 on), [`Self::SCALAR`] elsewhere.
    pub fn default_for(heads: Heads, dtype: DType, tensor_cores: bool) -> Self {
        match tensor_cores && Self::TENSOR_CORE.serves(heads, dtype) {
            true => Self::TENSOR_CORE,
            false => Self::SCALAR,
        }
    }

    /// Whether this is one of the defaults, compiled into the kernels' main module.
    pub fn is_default(self) -> bool {
        self == Self::SCALAR || self == Self::TENSOR_CORE
    }

    /// The kernel's name for elements of `dtype_suffix` (`f32`, `bf16`, `f16`) at
    /// `head_dim` (the tensor-core kernel has one for each of [`MMA_HEAD_DIMS`]).
    pub fn kernel_name(self, dtype_suffix: &str, head_dim: usize) -> String {
        match self {
            Self::Mma { .. } => format!("paged_attention_{dtype_suffix}_{self}_d{head_dim}"),
            _ => format!("paged_attention_{dtype_suffix}_{self}"),
        }
    }

    /// Every kernel of this variant the source instantiates.
    pub fn kernel_names(self) -> Vec<String> {
        match self {
            Self::Mma { .. } => ["bf16", "f16"]
                .iter()
                .flat_map(|t| MMA_HEAD_DIMS.map(|d| self.kernel_name(t, d)))
                .collect(),
            _ => ["f32", "bf16", "f16"]
                .iter()
                .map(|t| self.kernel_name(t, 0))
                .collect(),
        }
    }
}

/// `s<score loads>_v<value keys>[_split]`, `mma` or `mma_staged`, the kernels' suffix.
impl fmt::Display for AttentionKernel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Mma { staged: false } => write!(f, "mma"),
            Self::Mma { staged: true } => write!(f, "mma_staged"),
            Self::Scalar {
                score_loads,
                value_keys,
                split_values,
            } => {
                write!(f, "s{score_loads}_v{value_keys}")?;
                if split_values {
                    write!(f, "_split")?;
                }
                Ok(())
            }
        }
    }
}

/// A variant by its name; an error lists the names.
impl FromStr for AttentionKernel {
    type Err = EngineError;

    fn from_str(name: &str) -> Result<Self, EngineError> {
        Self::VARIANTS
            .into_iter()
            .find(|v| v.to_string() == name)
            .ok_or_else(|| {
                let known: Vec<String> = Self::VARIANTS.iter().map(|v| v.to_string()).collect();
                EngineError::InvalidConfig(format!(
                    "no paged attention kernel {name:?}; the variants are {} (s: 16-byte K \
                     loads in flight, v: V loads in flight, split: the split value pass, mma: \
                     tensor cores, staged: their operands through shared memory)",
                    known.join(", ")
                ))
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every variant the host can name is one the kernel source instantiates, under the names
    /// the launchers look up, and the two defaults are in the main module, the others only in the
    /// variants' module; a name that is none of them is refused with the list.
    #[test]
    fn every_variant_is_instantiated_under_its_name() {
        // The variants' module's own lines: those in `#ifdef ATTENTION_VARIANTS` sections.
        let (mut main, mut variants, mut in_variants) = (String::new(), String::new(), false);
        for line in super::super::SOURCE.lines() {
            match line.trim() {
                "#ifdef ATTENTION_VARIANTS" => in_variants = true,
                "#endif" if in_variants => in_variants = false,
                _ if in_variants => variants.extend([line, "\n"]),
                _ => main.extend([line, "\n"]),
            }
        }
        for v in AttentionKernel::VARIANTS {
            let lines: Vec<String> = match v {
                AttentionKernel::Mma { staged } => ["bf16, bf16", "f16, f16"]
                    .iter()
                    .flat_map(|t| {
                        MMA_HEAD_DIMS.map(|d| format!("ATTENTION_MMA({t}, {d}, {v}, {staged}, "))
                    })
                    .collect(),
                AttentionKernel::Scalar {
                    score_loads,
                    value_keys,
                    split_values,
                } => {
                    let macro_name = match split_values {
                        true => "ATTENTION_SPLIT",
                        false => "ATTENTION",
                    };
                    vec![format!(
                        "{macro_name}(NAME, T, {score_loads}, {value_keys})"
                    )]
                }
            };
            let (here, there) = match v.is_default() {
                true => (&main, &variants),
                false => (&variants, &main),
            };
            for line in lines {
                assert!(here.contains(&line), "{v}: {line}");
                assert!(!there.contains(&line), "{v} in both modules");
            }
            assert_eq!(v.to_string().parse::<AttentionKernel>().unwrap(), v);
        }
        assert_eq!(
            AttentionKernel::new(1, 8).kernel_name("bf16", 64),
            "paged_attention_bf16_s1_v8"
        );
        assert_eq!(
            AttentionKernel::Mma { staged: false }.kernel_names(),
            [
                "paged_attention_bf16_mma_d64",
                "paged_attention_bf16_mma_d128",
                "paged_attention_f16_mma_d64",
                "paged_attention_f16_mma_d128"
            ]
        );
        let err = "s2_v8".parse::<AttentionKernel>().unwrap_err().to_string();
        assert!(err.contains("s1_v8, mma_staged, mma, s8_v4_split"), "{err}");
        assert_eq!(
            AttentionKernel::Mma { staged: true }.kernel_name("f16", 128),
            "paged_attention_f16_mma_staged_d128"
        );
    }

    /// The tensor-core kernels serve bf16 and f16 at head_dim 64 and 128 with up to 16 query
    /// heads a KV head, and refuse the rest, naming it.
    #[test]
    fn the_tensor_core_variants_serve_their_dtypes_and_head_dims() {
        let heads = |group: usize, head_dim| Heads {
            num_heads: 2 * group,
            num_kv_heads: 2,
            head_dim,
        };
        for mma in AttentionKernel::VARIANTS.into_iter().filter(|v| v.is_mma()) {
            for (group, head_dim) in [(1, 64), (7, 64), (6, 128), (16, 128)] {
                for dtype in [DType::BF16, DType::F16] {
                    assert!(
                        mma.serves(heads(group, head_dim), dtype),
                        "{mma}: {group} x {head_dim}"
                    );
                }
            }
            let err = |h, dtype| mma.check_serves(h, dtype).unwrap_err().to_string();
            assert!(err(heads(7, 64), DType::F32).contains("F32"));
            assert!(err(heads(7, 256), DType::BF16).contains("head_dim 256"));
            assert!(err(heads(32, 64), DType::BF16).contains("32 query heads"));
        }
        assert!(AttentionKernel::SCALAR.serves(heads(7, 256), DType::F32));
    }

    /// The default is the tensor-core kernel where it serves the heads and dtype on a GPU
    /// with tensor cores, the scalar kernel elsewhere, and serves what it is the default for.
    #[test]
    fn the_default_is_the_tensor_core_kernel_where_it_serves() {
        let heads = |group: usize, head_dim| Heads {
            num_heads: 2 * group,
            num_kv_heads: 2,
            head_dim,
        };
        let pick = AttentionKernel::default_for;
        for dtype in [DType::BF16, DType::F16] {
            for h in [heads(7, 64), heads(6, 128), heads(16, 128)] {
                assert_eq!(pick(h, dtype, true), AttentionKernel::TENSOR_CORE);
                assert_eq!(pick(h, dtype, false), AttentionKernel::SCALAR);
            }
            for h in [heads(7, 256), heads(3, 96), heads(32, 64)] {
                assert_eq!(pick(h, dtype, true), AttentionKernel::SCALAR, "{h:?}");
            }
        }
        assert_eq!(
            pick(heads(7, 64), DType::F32, true),
            AttentionKernel::SCALAR
        );
        for (h, dtype) in [(heads(7, 256), DType::F32), (heads(6, 128), DType::BF16)] {
            assert!(pick(h, dtype, true).serves(h, dtype));
        }
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
                split.serves(heads(group, head_dim), DType::F32),
                "{group} x {head_dim}"
            );
            let pairs = heads(group, head_dim).max_tile_pairs();
            assert!(split.key_groups(pairs, head_dim) >= 1);
        }
        // 7 query heads a KV head at head_dim 64: 16 items (16 four-dimension slices of one
        // group of 8 pairs), so 8 key groups.
        assert_eq!(split.key_groups(7, 64), 8);
        assert_eq!(AttentionKernel::SCALAR.key_groups(7, 64), 1);
        let wide = heads(40, 128);
        let err = split
            .check_serves(wide, DType::BF16)
            .unwrap_err()
            .to_string();
        assert!(err.contains("s8_v4_split") && err.contains("40"), "{err}");
    }
}
