//! Paged attention on a GPU (`engine.attention = "cuda"`): kernels/paged_attention.cu reads
//! K and V in place from the same pool the generic path uses, through the block tables,
//! instead of gathering, padding and expanding them. This module holds what the host decides
//! for an iteration (the [`KernelPlan`]: tiles of query rows and splits of the context),
//! built once and shared by every layer, and the block tables kept on the device between
//! iterations ([`tables`]); `launch` (CUDA builds) queues the kernels, `layer_ops` the same
//! source's kernels for the layer's other steps (`engine.layer_kernels`). Without a GPU, a
//! CPU twin of the kernels (tests) checks the plan and the algorithm against [`reference`],
//! and `emulated` (tests) runs the kernel source itself on the CPU against the twin.

pub mod bench;
pub mod case;
mod copies;
#[cfg(feature = "cuda")]
mod device_buffers;
#[cfg(feature = "cuda")]
pub mod device_check;
#[cfg(all(test, target_os = "linux"))]
mod emulated;
#[cfg(feature = "cuda")]
mod gpu;
#[cfg(feature = "cuda")]
mod graphs;
#[cfg(feature = "cuda")]
mod launch;
#[cfg(any(all(test, target_os = "linux"), feature = "cuda"))]
mod layer_ops;
pub mod padding;
#[cfg(any(all(test, target_os = "linux"), feature = "cuda"))]
mod params;
#[cfg(any(all(test, target_os = "linux"), feature = "cuda"))]
mod pools;
pub mod reference;
#[cfg(feature = "cuda")]
mod rotate;
mod state;
pub mod tables;
#[cfg(test)]
mod twin;
mod variant;

#[cfg(feature = "cuda")]
pub use device_buffers::{multiprocessors, tensor_cores, CudaIndex, DeviceTables};
#[cfg(feature = "cuda")]
pub use launch::CudaPagedAttention;
pub use state::{Batch, CudaAttention, Output, Switches};
pub use variant::AttentionKernel;

use candle_core::{CustomOp3, Tensor};
use dppo_model::{ModelConfig, RopeAt};

use crate::paged_attn::{CacheShape, SeqAttnMeta};
use crate::EngineError;

/// The kernels' CUDA source, compiled by NVRTC at run time (and in CI by
/// `scripts/check-kernels`): kernels/paged_attention.cu, then the rope kernel's
/// kernels/qkv_rope.cu, the layer kernels' kernels/layer_ops.cu and the tensor-core
/// attention's kernels/paged_attention_mma.cu, which use its definitions.
pub const SOURCE: &str = concat!(
    include_str!("../../kernels/paged_attention.cu"),
    include_str!("../../kernels/qkv_rope.cu"),
    include_str!("../../kernels/layer_ops.cu"),
    include_str!("../../kernels/paged_attention_mma.cu")
);

/// Threads of an attention block (the kernel's `THREADS`).
pub const THREADS: usize = 128;
/// Keys scored together in shared memory (the kernel's `CHUNK`).
pub const CHUNK: usize = 128;
/// head_dim is a multiple of 32 up to this (the widest heads' shared memory fits 48 KiB).
pub const MAX_HEAD_DIM: usize = 256;
/// Query rows and heads (pairs) a prefill tile aims at: enough to reuse each key read.
const TARGET_PAIRS: usize = 16;
/// Shared memory a block may use without opting in (48 KiB on every CUDA GPU).
const MAX_SHARED_BYTES: usize = 48 * 1024;
/// Threads of a block that writes or copies K/V rows, or writes block-table entries.
const WRITE_THREADS: u32 = 128;
/// Threads of a `qkv_rope` block (a token's rotations and its V row).
const ROPE_THREADS: u32 = 256;
/// Threads of an `add_rms_norm` block (one row; the kernel's `NORM_THREADS`).
const NORM_THREADS: u32 = 256;
/// Threads of a `silu_mul` block, and the most blocks it launches across a row's columns and
/// down its rows (they stride over the rest).
const SILU_THREADS: u32 = 256;
const SILU_MAX_COLUMN_BLOCKS: u32 = 16;
const SILU_MAX_ROW_BLOCKS: u32 = 1024;

/// What a launcher's backend runs besides the attention, as [`Switches`] say: `qkv_rope`
/// (`engine.rope_kernel`, writing K and V into the pools with `engine.rope_writes_kv`, taking
/// the q/k norms of the models that have them with `engine.rope_qk_norm`) and the layer
/// kernels (`engine.layer_kernels`), launches counted.
#[cfg(any(all(test, target_os = "linux"), feature = "cuda"))]
#[derive(Debug, Default)]
pub(crate) struct Extras {
    /// `engine.rope_kernel`.
    pub rope_kernel: bool,
    /// `engine.rope_writes_kv`.
    pub rope_writes_kv: bool,
    /// `engine.rope_qk_norm`.
    pub rope_qk_norm: bool,
    /// `qkv_rope` launches so far.
    pub rotations: u64,
    /// `write_slots` launches so far (the K and V writes where `qkv_rope` does not make them).
    pub slot_writes: u64,
    /// `engine.layer_kernels`: the kernels, where on.
    pub layer_ops: Option<layer_ops::LayerOps>,
}

#[cfg(any(all(test, target_os = "linux"), feature = "cuda"))]
impl Extras {
    pub(crate) fn of(switches: Switches) -> Self {
        Self {
            rope_kernel: switches.rope_kernel,
            rope_writes_kv: switches.rope_writes_kv,
            rope_qk_norm: switches.rope_qk_norm,
            rotations: 0,
            slot_writes: 0,
            layer_ops: switches.layer_kernels.then(layer_ops::LayerOps::default),
        }
    }

    /// The backend's [`AttentionBackend::takes_projection`]: with the rope kernel, and for a
    /// layer with q/k norms with `engine.rope_qk_norm` too.
    pub(crate) fn takes_projection(&self, qk_norms: bool) -> bool {
        self.rope_kernel && (!qk_norms || self.rope_qk_norm)
    }

    /// The backend's [`AttentionBackend::layer_kernels`].
    pub(crate) fn layer_kernels(&self) -> Option<&dyn dppo_model::LayerKernels> {
        self.layer_ops
            .as_ref()
            .map(|k| k as &dyn dppo_model::LayerKernels)
    }

    /// Adds the launches to `cost`, `qkv_rope`'s and the K/V writes' to the attention's ops.
    pub(crate) fn count(self, cost: &mut crate::cost::IterationCost) {
        cost.attention_ops += self.rotations + self.slot_writes;
        cost.layer_ops += self.layer_ops.map_or(0, |k| k.launches.get());
    }
}

/// The layer's q (tokens, heads, head_dim) and, unless the pools took them, its k and v
/// (tokens, kv_heads, head_dim) from the fused q/k/v projection `qkv`: `rotate` (a launcher's
/// `qkv_rope` op) turns it and the angles of `rope` into q, k and v as three contiguous
/// segments of one flat tensor, or into q alone where it writes k and v into the pools.
pub fn rotated(
    rotate: &impl CustomOp3,
    heads: Heads,
    (qkv, rope): (&Tensor, &RopeAt),
    into_pools: bool,
) -> candle_core::Result<(Tensor, Option<(Tensor, Tensor)>)> {
    let (cos, sin) = rope.tables(qkv.dtype())?;
    let out = qkv.contiguous()?.apply_op3_no_bwd(&cos, &sin, rotate)?;
    let (q_dim, kv_dim) = (
        heads.num_heads * heads.head_dim,
        heads.num_kv_heads * heads.head_dim,
    );
    let tokens = qkv.elem_count() / (q_dim + 2 * kv_dim);
    let d = heads.head_dim;
    let q = out.narrow(0, 0, tokens * q_dim)?;
    let q = q.reshape((tokens, heads.num_heads, d))?;
    if into_pools {
        return Ok((q, None));
    }
    let k = out.narrow(0, tokens * q_dim, tokens * kv_dim)?;
    let v = out.narrow(0, tokens * (q_dim + kv_dim), tokens * kv_dim)?;
    Ok((
        q,
        Some((
            k.reshape((tokens, heads.num_kv_heads, d))?,
            v.reshape((tokens, heads.num_kv_heads, d))?,
        )),
    ))
}

/// Grid, block and dynamic shared memory of one launch, as CUDA's launch configuration
/// takes them (on a GPU and in the kernels' emulation in tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub grid: (u32, u32, u32),
    pub block: (u32, u32, u32),
    pub shared_bytes: u32,
}

/// `write_table_entries` over `entries` (index, block) pairs: a thread each.
pub fn table_write_geometry(entries: usize) -> Geometry {
    Geometry {
        grid: ((entries as u32).div_ceil(WRITE_THREADS), 1, 1),
        block: (WRITE_THREADS, 1, 1),
        shared_bytes: 0,
    }
}

/// `add_rms_norm` over `rows` rows: a block each.
pub fn norm_geometry(rows: usize) -> Geometry {
    Geometry {
        grid: (rows as u32, 1, 1),
        block: (NORM_THREADS, 1, 1),
        shared_bytes: 0,
    }
}

/// `silu_mul` over `rows` rows of `width` outputs of `elem_bytes` each: a thread 16 bytes of
/// outputs where a row is whole 16-byte vectors (the kernel takes them so when they are also
/// aligned, and strides over whatever the grid leaves), else one output, up to
/// [`SILU_MAX_COLUMN_BLOCKS`] blocks across a row and [`SILU_MAX_ROW_BLOCKS`] down the rows.
pub fn silu_geometry(rows: usize, width: usize, elem_bytes: usize) -> Geometry {
    debug_assert!(matches!(elem_bytes, 2 | 4), "f32, bf16 or f16 elements");
    let per_thread = match width % (16 / elem_bytes) {
        0 => 16 / elem_bytes,
        _ => 1,
    };
    Geometry {
        grid: (
            (width.div_ceil(per_thread) as u32)
                .div_ceil(SILU_THREADS)
                .clamp(1, SILU_MAX_COLUMN_BLOCKS),
            (rows as u32).clamp(1, SILU_MAX_ROW_BLOCKS),
            1,
        ),
        block: (SILU_THREADS, 1, 1),
        shared_bytes: 0,
    }
}

/// The heads of the model the kernels serve.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heads {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl Heads {
    /// The heads of a model of `cfg`, as the kernels see them.
    pub fn of(cfg: &ModelConfig) -> Self {
        Self {
            num_heads: cfg.num_attention_heads,
            num_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
        }
    }

    /// Query heads per KV head.
    pub fn group(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    /// An error naming what the kernels cannot serve, if anything.
    pub fn check(&self) -> Result<(), EngineError> {
        let refuse = |why: String| {
            Err(EngineError::InvalidConfig(format!(
                "engine.attention = \"cuda\": {why}; use \"generic\""
            )))
        };
        if !self.head_dim.is_multiple_of(32) || self.head_dim > MAX_HEAD_DIM {
            return refuse(format!(
                "head_dim {} is not a multiple of 32 up to {MAX_HEAD_DIM}",
                self.head_dim
            ));
        }
        if self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return refuse(format!(
                "{} query heads do not group over {} KV heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if AttentionKernel::SCALAR.shared_bytes(self.group(), self.head_dim) > MAX_SHARED_BYTES {
            return refuse(format!(
                "{} query heads per KV head at head_dim {} need more than 48 KiB of shared \
                 memory a block",
                self.group(),
                self.head_dim
            ));
        }
        Ok(())
    }

    /// Query rows per prefill tile: at least one, `TARGET_PAIRS` pairs where the group allows.
    fn rows_per_tile(&self) -> usize {
        (TARGET_PAIRS / self.group()).max(1)
    }

    /// The most pairs (query rows x query heads) a tile holds.
    pub fn max_tile_pairs(&self) -> usize {
        self.rows_per_tile() * self.group()
    }
}

/// One tile: consecutive query rows of one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tile {
    /// The sequence's row in the device's block tables.
    pub seq: u32,
    pub first_row: u32,
    pub rows: u32,
    /// Position of the first row; row `i` sees keys `0..=first_pos + i`.
    pub first_pos: u32,
}

/// What the kernels of one iteration read, the same for every layer.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelPlan {
    pub heads: Heads,
    pub block_size: usize,
    pub tiles: Vec<Tile>,
    /// Columns of the device's block tables (a tile reads only the blocks its keys fill).
    pub table_width: usize,
    /// The cache slot of each batch row's new K/V.
    pub slots: Vec<u32>,
    /// Query rows in the batch.
    pub rows: usize,
    /// Splits of the context (the grid's third dimension) and keys per split (a multiple
    /// of [`CHUNK`]).
    pub splits: usize,
    pub split_len: usize,
    /// Most pairs of any tile: sizes the blocks' shared memory.
    pub max_pairs: usize,
}

/// Splits of the context and keys per split (a multiple of [`CHUNK`]) for `tiles` tiles of
/// `heads` over at most `max_keys` keys: the context split until the grid has at least
/// `min_blocks` blocks, never below one chunk of keys per split.
fn split_context(tiles: usize, heads: Heads, max_keys: usize, min_blocks: usize) -> (usize, usize) {
    let base = (tiles * heads.num_kv_heads).max(1);
    let chunks = max_keys.div_ceil(CHUNK);
    let wanted = min_blocks.div_ceil(base).clamp(1, chunks);
    let split_len = chunks.div_ceil(wanted) * CHUNK;
    (max_keys.div_ceil(split_len), split_len)
}

impl KernelPlan {
    /// The plan for `seqs` (their new tokens are the batch's rows, `slot_mapping` their
    /// slots, `table_rows` their rows of the device's block tables, `table_width` wide).
    /// Splits the context until the grid has at least `min_blocks` blocks (about two per
    /// multiprocessor), never below one chunk of keys per split.
    pub fn new(
        seqs: &[SeqAttnMeta],
        (table_rows, table_width): (&[u32], usize),
        slot_mapping: &[usize],
        shape: CacheShape,
        heads: Heads,
        min_blocks: usize,
    ) -> Result<Self, EngineError> {
        heads.check()?;
        assert_eq!(seqs.len(), table_rows.len(), "one table row per sequence");
        // The kernels write the new rows' K and V at their slots unchecked on a GPU.
        let pool_slots = shape.num_blocks * shape.block_size;
        if let Some(slot) = slot_mapping.iter().find(|&&s| s >= pool_slots) {
            return Err(EngineError::InvalidConfig(format!(
                "cuda attention: slot {slot} outside a pool of {pool_slots}"
            )));
        }
        let per_tile = heads.rows_per_tile();
        let mut tiles = Vec::new();
        let mut max_keys = 1;
        for (m, &row) in seqs.iter().zip(table_rows) {
            let keys = m.num_computed_tokens + m.num_new_tokens;
            let blocks = keys.div_ceil(shape.block_size);
            if blocks > m.block_table.len() || blocks > table_width {
                return Err(EngineError::InvalidConfig(format!(
                    "cuda attention: a sequence of {keys} tokens has {} blocks of {} (tables \
                     {table_width} wide)",
                    m.block_table.len(),
                    shape.block_size
                )));
            }
            max_keys = max_keys.max(keys);
            for first in (0..m.num_new_tokens).step_by(per_tile) {
                tiles.push(Tile {
                    seq: row,
                    first_row: (m.first_row + first) as u32,
                    rows: per_tile.min(m.num_new_tokens - first) as u32,
                    first_pos: (m.num_computed_tokens + first) as u32,
                });
            }
        }
        let max_pairs = tiles.iter().map(|t| t.rows as usize).max().unwrap_or(1) * heads.group();
        let (splits, split_len) = split_context(tiles.len(), heads, max_keys, min_blocks);
        Ok(Self {
            heads,
            block_size: shape.block_size,
            tiles,
            table_width,
            slots: slot_mapping.iter().map(|&s| s as u32).collect(),
            rows: slot_mapping.len(),
            splits,
            split_len,
            max_pairs,
        })
    }

    /// The plan split as for contexts up to the next power of two of its longest (at least
    /// one chunk): the splits of a captured step (`engine.cuda_graphs`) then stay the same
    /// while its contexts grow within that power, and a split past a context is empty.
    pub fn round_context(&mut self, min_blocks: usize) {
        let max_keys = self
            .tiles
            .iter()
            .map(|t| (t.first_pos + t.rows) as usize)
            .max()
            .unwrap_or(1);
        let rounded = max_keys.next_power_of_two().max(CHUNK);
        (self.splits, self.split_len) =
            split_context(self.tiles.len(), self.heads, rounded, min_blocks);
    }

    /// The tiles as the kernel reads them: four words each.
    pub fn tile_words(&self) -> Vec<u32> {
        self.tiles
            .iter()
            .flat_map(|t| [t.seq, t.first_row, t.rows, t.first_pos])
            .collect()
    }

    /// Bytes uploaded per iteration besides the block tables' changes: tiles and slots.
    pub fn upload_bytes(&self) -> u64 {
        4 * (4 * self.tiles.len() + self.slots.len()) as u64
    }

    /// Launches per layer of the attention and, where the context is split, the merge of its
    /// splits (the K and V writes and `qkv_rope` are counted as they launch).
    pub fn launches_per_layer(&self) -> u64 {
        1 + u64::from(self.splits > 1)
    }

    /// Floats of the partial outputs (rows x heads x splits x head_dim).
    pub fn partial_len(&self) -> usize {
        self.rows * self.heads.num_heads * self.splits * self.heads.head_dim
    }

    /// The attention kernel's (`variant`'s) shared memory per block.
    pub fn shared_bytes(&self, variant: AttentionKernel) -> usize {
        variant.shared_bytes(self.max_pairs, self.heads.head_dim)
    }

    /// `write_slots`: a block per batch row.
    pub fn write_geometry(&self) -> Geometry {
        Geometry {
            grid: (self.rows as u32, 1, 1),
            block: (WRITE_THREADS, 1, 1),
            shared_bytes: 0,
        }
    }

    /// `qkv_rope`: a block per batch row.
    pub fn rope_geometry(&self) -> Geometry {
        Geometry {
            block: (ROPE_THREADS, 1, 1),
            ..self.write_geometry()
        }
    }

    /// `paged_attention` (`variant`): a block per (tile, KV head, split).
    pub fn attention_geometry(&self, variant: AttentionKernel) -> Geometry {
        Geometry {
            grid: (
                self.tiles.len() as u32,
                self.heads.num_kv_heads as u32,
                self.splits as u32,
            ),
            block: (THREADS as u32, 1, 1),
            shared_bytes: self.shared_bytes(variant) as u32,
        }
    }

    /// `paged_reduce`: a block per (row, query head), a thread per dimension.
    pub fn reduce_geometry(&self) -> Geometry {
        Geometry {
            grid: (self.rows as u32, self.heads.num_heads as u32, 1),
            block: (self.heads.head_dim as u32, 1, 1),
            shared_bytes: 0,
        }
    }
}
