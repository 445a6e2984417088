//! kernels/paged_attention.cu itself, run on the CPU ([`crate::kernel_emu`]), launched with
//! the geometry and the argument lists `launch.rs` gives them on a GPU (both shared), host
//! vectors standing for device buffers. The tests hold the kernels to their CPU twin over the
//! GPU check's batches, and run the engine with the emulated kernels as its attention
//! backend: on the CPU, the engine's unit tests resolve `engine.attention = "cuda"` to this
//! module.

use std::sync::LazyLock;

use candle_core::{bail, Device, Result, WithDType};

use super::copies::SlotCopies;
use super::params::{Attention, CopySlots, QkvRope, Reduce, Scalars, TableEntries, WriteSlots};
use super::tables::TableCopy;
use super::{table_write_geometry, AttentionKernel, Geometry, KernelPlan, SOURCE};
use crate::kernel_emu::{Args, Emulator};

#[cfg(not(feature = "cuda"))]
mod backend;
#[cfg(not(feature = "cuda"))]
mod engine;
pub(super) mod layer;
mod rope;
mod tests;

#[cfg(not(feature = "cuda"))]
pub(super) use backend::{copy_blocks, Backend};

/// The multiprocessors the emulation's plans split contexts for: an H100 SXM's.
pub(super) const MULTIPROCESSORS: usize = 132;

/// The kernel source with every variant of the attention (`-DATTENTION_VARIANTS`).
static KERNELS: LazyLock<Emulator> = LazyLock::new(|| {
    let kernels = [
        "add_rms_norm",
        "silu_mul",
        "qkv_rope",
        "write_slots",
        "copy_slots",
        "paged_reduce",
    ];
    let dtypes = ["f32", "bf16", "f16"];
    let names: Vec<String> = kernels
        .iter()
        .flat_map(|k| dtypes.map(|t| format!("{k}_{t}")))
        .chain(
            AttentionKernel::VARIANTS
                .iter()
                .flat_map(|v| v.kernel_names()),
        )
        .chain(["write_table_entries".to_string()])
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let source = format!("#define ATTENTION_VARIANTS\n#line 1\n{SOURCE}");
    Emulator::build("kernels/paged_attention.cu", &source, &names).unwrap()
});

/// An element type of the kernels' buffers.
pub(super) trait Stored: WithDType {
    const SUFFIX: &'static str;
    /// `x` rounded to the type, as the kernels' `from_f32`.
    fn of(x: f32) -> Self;
    fn bits(self) -> u32;
    fn value(self) -> f32;
}

impl Stored for f32 {
    const SUFFIX: &'static str = "f32";
    fn of(x: f32) -> Self {
        x
    }
    fn bits(self) -> u32 {
        self.to_bits()
    }
    fn value(self) -> f32 {
        self
    }
}

/// `Stored` for a half-precision type of the `half` crate.
macro_rules! stored_half {
    ($t:ty, $suffix:literal) => {
        impl Stored for $t {
            const SUFFIX: &'static str = $suffix;
            fn of(x: f32) -> Self {
                <$t>::from_f32(x)
            }
            fn bits(self) -> u32 {
                self.to_bits().into()
            }
            fn value(self) -> f32 {
                self.to_f32()
            }
        }
    };
}

stored_half!(half::bf16, "bf16");
stored_half!(half::f16, "f16");

fn launch(kernel: &str, g: Geometry, args: &Args) -> Result<()> {
    KERNELS
        .launch(kernel, g.grid, g.block, g.shared_bytes as usize, args)
        .map_err(candle_core::Error::msg)
}

/// The emulated kernels' block tables: a host vector that `write_table_entries` writes.
impl TableCopy for Vec<u32> {
    fn copy_of(host: &[u32], _: &Device) -> Result<Self> {
        Ok(host.to_vec())
    }

    fn write_entries(&mut self, pairs: &[u32]) -> Result<()> {
        let n = (pairs.len() / 2) as u32;
        if n == 0 {
            return Ok(());
        }
        let entries = TableEntries {
            table: self.as_mut_ptr(),
            pairs: pairs.as_ptr(),
            n: &n,
        };
        let args = Args::filled(|list| entries.push_to(list));
        launch(
            "write_table_entries",
            table_write_geometry(n as usize),
            &args,
        )
    }
}

/// An error where one of `slots` (rows of `row` values) lies outside a pool of `pool_len`
/// values: the emulated `kernel` would touch the process's memory there.
fn in_pool(kernel: &str, slots: &[u32], row: usize, pool_len: usize) -> Result<()> {
    match slots.iter().find(|&&s| (s as usize + 1) * row > pool_len) {
        Some(slot) => bail!("{kernel}: slot {slot} outside a pool of {}", pool_len / row),
        None => Ok(()),
    }
}

/// `write_slots`: each batch row of `src` into its slot of `cache`.
pub(super) fn write_slots<T: Stored>(plan: &KernelPlan, src: &[T], cache: &mut [T]) -> Result<()> {
    let row = plan.heads.num_kv_heads * plan.heads.head_dim;
    if src.len() != plan.rows * row {
        bail!(
            "write_slots: {} new values for {} rows",
            src.len(),
            plan.rows
        );
    }
    in_pool("write_slots", &plan.slots, row, cache.len())?;
    let scalars = Scalars::of(plan);
    let write = WriteSlots {
        src: src.as_ptr(),
        cache: cache.as_mut_ptr(),
        slots: plan.slots.as_ptr(),
        scalars: &scalars,
    };
    let args = Args::filled(|list| write.push_to(list));
    launch(
        &format!("write_slots_{}", T::SUFFIX),
        plan.write_geometry(),
        &args,
    )
}

/// `copy_slots`: each copied slot's row of `cache` into its destination slot.
pub(super) fn copy_slots<T: Stored>(
    plan: &KernelPlan,
    copies: &SlotCopies,
    cache: &mut [T],
) -> Result<()> {
    let row = plan.heads.num_kv_heads * plan.heads.head_dim;
    in_pool("copy_slots", &copies.pairs, row, cache.len())?;
    let scalars = Scalars::of(plan);
    let copy = CopySlots {
        cache: cache.as_mut_ptr(),
        pairs: copies.pairs.as_ptr(),
        scalars: &scalars,
    };
    let args = Args::filled(|list| copy.push_to(list));
    launch(
        &format!("copy_slots_{}", T::SUFFIX),
        copies.geometry(),
        &args,
    )
}

/// `paged_attention` (its `variant`), then `paged_reduce` where the context is split: the
/// batch's (rows, heads, head_dim) output, the partial buffers and the output poisoned with
/// NaN first.
pub(super) fn attend<T: Stored>(
    plan: &KernelPlan,
    q: &[T],
    (k, v): (&[T], &[T]),
    tables: &[u32],
    variant: AttentionKernel,
) -> Result<Vec<T>> {
    let heads = plan.heads;
    let pair_rows = plan.rows * heads.num_heads;
    if q.len() != pair_rows * heads.head_dim {
        bail!(
            "paged_attention: {} query values for {pair_rows} pairs",
            q.len()
        );
    }
    // Outside the pool the emulation would read the process's memory.
    let block = plan.block_size * heads.num_kv_heads * heads.head_dim;
    if let Some(b) = tables
        .iter()
        .find(|&&b| (b as usize + 1) * block > k.len().min(v.len()))
    {
        bail!("paged_attention: block {b} outside the pool");
    }
    let tiles = plan.tile_words();
    let mut acc = vec![f32::NAN; plan.partial_len()];
    let mut max = vec![f32::NAN; pair_rows * plan.splits];
    let mut sum = vec![f32::NAN; pair_rows * plan.splits];
    let mut out = vec![T::of(f32::NAN); pair_rows * heads.head_dim];
    let scalars = Scalars::of(plan);
    let attend = Attention {
        q: q.as_ptr(),
        k: k.as_ptr(),
        v: v.as_ptr(),
        tiles: tiles.as_ptr(),
        tables: tables.as_ptr(),
        scalars: &scalars,
        acc: acc.as_mut_ptr(),
        max: max.as_mut_ptr(),
        sum: sum.as_mut_ptr(),
        out: out.as_mut_ptr(),
    };
    let args = Args::filled(|list| attend.push_to(list));
    launch(
        &variant.kernel_name(T::SUFFIX, heads.head_dim),
        plan.attention_geometry(variant),
        &args,
    )?;
    if plan.splits == 1 {
        return Ok(out);
    }
    let reduce = Reduce {
        acc: acc.as_ptr(),
        max: max.as_ptr(),
        sum: sum.as_ptr(),
        scalars: &scalars,
        out: out.as_mut_ptr(),
    };
    let args = Args::filled(|list| reduce.push_to(list));
    let reduce = format!("paged_reduce_{}", T::SUFFIX);
    launch(&reduce, plan.reduce_geometry(), &args)?;
    Ok(out)
}

/// The q and k norms' weights (head_dim each) and their epsilon.
pub(super) type Norms<'a, T> = ([&'a [T]; 2], f32);

/// `qkv_rope`'s inputs besides the projection and the angles.
#[derive(Default)]
pub(super) struct RopeExtras<'a, T> {
    pub bias: Option<&'a [T]>,
    pub norms: Option<Norms<'a, T>>,
    /// The layer's K and V pools, which k and v go into.
    pub pools: Option<[&'a mut [T]; 2]>,
}

/// `qkv_rope`: the batch's projection `qkv` (rows, (heads + 2 kv_heads) * head_dim) biased,
/// its q and k heads normed where `extras` has norms, and rotated by `cos`, `sin` (rows,
/// head_dim / 2): q, k and v out as segments, or with the layer's K and V pools q out and k
/// and v into the plan's slots of the pools.
pub(super) fn qkv_rope<T: Stored>(
    plan: &KernelPlan,
    qkv: &[T],
    (cos, sin): (&[T], &[T]),
    extras: RopeExtras<'_, T>,
) -> Result<Vec<T>> {
    let RopeExtras { bias, norms, pools } = extras;
    let heads = plan.heads;
    let kv_row = heads.num_kv_heads * heads.head_dim;
    let width = heads.num_heads * heads.head_dim + 2 * kv_row;
    let half = plan.rows * heads.head_dim / 2;
    if qkv.len() != plan.rows * width || cos.len() != half || sin.len() != half {
        bail!(
            "qkv_rope: {} projected values and {} angles for {} rows of {width}",
            qkv.len(),
            cos.len(),
            plan.rows
        );
    }
    if bias.is_some_and(|b| b.len() != width) {
        bail!(
            "qkv_rope: a bias of {} for rows of {width}",
            bias.map_or(0, <[T]>::len)
        );
    }
    if norms.is_some_and(|([q, k], _)| q.len() != heads.head_dim || k.len() != heads.head_dim) {
        bail!(
            "qkv_rope: norms' weights that are not head_dim {} long",
            heads.head_dim
        );
    }
    let (out_len, pools) = match pools {
        Some([k, v]) => {
            in_pool("qkv_rope", &plan.slots, kv_row, k.len().min(v.len()))?;
            (
                qkv.len() - 2 * plan.rows * kv_row,
                [k.as_mut_ptr(), v.as_mut_ptr()],
            )
        }
        None => (qkv.len(), [std::ptr::null_mut(); 2]),
    };
    let mut out = vec![T::of(f32::NAN); out_len];
    let scalars = Scalars::of(plan);
    let has_bias = u32::from(bias.is_some());
    let (has_norm, eps) = (
        u32::from(norms.is_some()),
        norms.map_or(0.0, |(_, eps)| eps),
    );
    let rope = QkvRope {
        qkv: qkv.as_ptr(),
        bias: bias.unwrap_or(qkv).as_ptr(),
        cos: cos.as_ptr(),
        sin: sin.as_ptr(),
        out: out.as_mut_ptr(),
        pools,
        slots: plan.slots.as_ptr(),
        norms: norms.map_or([qkv.as_ptr(); 2], |([q, k], _)| [q.as_ptr(), k.as_ptr()]),
        scalars: &scalars,
        has_bias: &has_bias,
        has_norm: &has_norm,
        eps: &eps,
    };
    let args = Args::filled(|list| rope.push_to(list));
    launch(
        &format!("qkv_rope_{}", T::SUFFIX),
        plan.rope_geometry(),
        &args,
    )?;
    Ok(out)
}
