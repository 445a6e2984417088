//! kernels/paged_attention.cu itself, run on the CPU ([`crate::kernel_emu`]) over the GPU
//! check's batches and geometry: the block tables written entry by entry, the new K/V written
//! into their slots, the attention and the merge of its splits. Held bit for bit to the CPU
//! twin (its output rounded to the dtype) and within the GPU check's tolerance to the f64
//! reference.

use std::sync::LazyLock;

use candle_core::DType;

use super::case::{checked_cases, tolerance, Case};
use super::twin::{self, Caches};
use super::{table_write_geometry, Geometry, KernelPlan, SOURCE};
use crate::kernel_emu::{Args, Emulator};

static KERNELS: LazyLock<Emulator> = LazyLock::new(|| {
    let names: Vec<String> = ["write_slots", "paged_attention", "paged_reduce"]
        .iter()
        .flat_map(|k| ["f32", "bf16", "f16"].map(|t| format!("{k}_{t}")))
        .chain(["write_table_entries".to_string()])
        .collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    Emulator::build("kernels/paged_attention.cu", SOURCE, &names).unwrap()
});

/// Twice the multiprocessors of an H100 SXM: the engine's split target on one.
const MIN_BLOCKS: usize = 2 * 132;

/// An element type of the kernels' buffers.
trait Stored: Copy {
    const DTYPE: DType;
    const SUFFIX: &'static str;
    fn of(x: f32) -> Self;
    fn bits(self) -> u32;
    fn value(self) -> f32;
}

impl Stored for f32 {
    const DTYPE: DType = DType::F32;
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

impl Stored for half::bf16 {
    const DTYPE: DType = DType::BF16;
    const SUFFIX: &'static str = "bf16";
    fn of(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
    fn bits(self) -> u32 {
        self.to_bits().into()
    }
    fn value(self) -> f32 {
        self.to_f32()
    }
}

impl Stored for half::f16 {
    const DTYPE: DType = DType::F16;
    const SUFFIX: &'static str = "f16";
    fn of(x: f32) -> Self {
        half::f16::from_f32(x)
    }
    fn bits(self) -> u32 {
        self.to_bits().into()
    }
    fn value(self) -> f32 {
        self.to_f32()
    }
}

fn stored<T: Stored>(xs: &[f32]) -> Vec<T> {
    xs.iter().map(|&x| T::of(x)).collect()
}

fn bits<T: Stored>(xs: &[T]) -> Vec<u32> {
    xs.iter().map(|x| x.bits()).collect()
}

fn launch(kernel: &str, g: Geometry, args: &Args) {
    let shared = g.shared_bytes as usize;
    KERNELS
        .launch(kernel, g.grid, g.block, shared, args)
        .unwrap();
}

/// What the emulated kernels leave: the output, both pools and the block tables.
struct Emulated<T> {
    out: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    tables: Vec<u32>,
}

/// One batch through the kernels in `T`, launched as `launch.rs` launches them.
fn emulate<T: Stored>(case: &Case, plan: &KernelPlan, host_tables: &[u32]) -> Emulated<T> {
    let pairs: Vec<u32> = (0..)
        .zip(host_tables)
        .filter(|(_, &b)| b != 0)
        .flat_map(|(i, &b)| [i, b])
        .collect();
    let mut tables = vec![0u32; host_tables.len()];
    let n = (pairs.len() / 2) as u32;
    let args = Args::default()
        .arg(tables.as_mut_ptr())
        .arg(pairs.as_ptr())
        .arg(n);
    launch(
        "write_table_entries",
        table_write_geometry(n as usize),
        &args,
    );

    let (pool_k, pool_v) = case.cached_pool();
    let (mut k, mut v) = (stored::<T>(&pool_k), stored::<T>(&pool_v));
    let (new_k, new_v) = case.new_kv();
    let heads = plan.heads;
    let row = (heads.num_kv_heads * heads.head_dim) as u32;
    let write = format!("write_slots_{}", T::SUFFIX);
    for (src, cache) in [(stored::<T>(&new_k), &mut k), (stored::<T>(&new_v), &mut v)] {
        let args = Args::default()
            .arg(src.as_ptr())
            .arg(cache.as_mut_ptr())
            .arg(plan.slots.as_ptr())
            .arg(row);
        launch(&write, plan.write_geometry(), &args);
    }

    let q = stored::<T>(&case.q);
    let tiles = plan.tile_words();
    let pair_rows = plan.rows * heads.num_heads;
    let mut acc = vec![f32::NAN; plan.partial_len()];
    let mut max = vec![f32::NAN; pair_rows * plan.splits];
    let mut sum = vec![f32::NAN; pair_rows * plan.splits];
    let scale = 1.0f32 / (heads.head_dim as f32).sqrt();
    let args = Args::default()
        .arg(q.as_ptr())
        .arg(k.as_ptr())
        .arg(v.as_ptr())
        .arg(tiles.as_ptr())
        .arg(tables.as_ptr())
        .arg(heads.num_heads as u32)
        .arg(heads.num_kv_heads as u32)
        .arg(heads.head_dim as u32)
        .arg(plan.block_size as u32)
        .arg(plan.table_width as u32)
        .arg(plan.split_len as u32)
        .arg(scale)
        .arg(acc.as_mut_ptr())
        .arg(max.as_mut_ptr())
        .arg(sum.as_mut_ptr());
    let attention = format!("paged_attention_{}", T::SUFFIX);
    launch(&attention, plan.attention_geometry(), &args);

    let mut out = vec![T::of(f32::NAN); pair_rows * heads.head_dim];
    let args = Args::default()
        .arg(acc.as_ptr())
        .arg(max.as_ptr())
        .arg(sum.as_ptr())
        .arg(heads.num_heads as u32)
        .arg(heads.head_dim as u32)
        .arg(plan.splits as u32)
        .arg(out.as_mut_ptr());
    launch(
        &format!("paged_reduce_{}", T::SUFFIX),
        plan.reduce_geometry(),
        &args,
    );
    Emulated { out, k, v, tables }
}

/// Every checked batch in `T`, split as the engine would on an H100 and into one chunk per
/// split: the emulated kernels against the twin and the reference.
fn check<T: Stored>() {
    for (c, case) in checked_cases(T::DTYPE).iter().enumerate() {
        for min_blocks in [MIN_BLOCKS, usize::MAX / 2] {
            let (plan, host_tables) = case.plan(min_blocks).unwrap();
            let got = emulate::<T>(case, &plan, &host_tables);
            let what = format!(
                "{:?} case {c} ({:?}, {} splits of {})",
                T::DTYPE,
                case.heads,
                plan.splits,
                plan.split_len
            );
            assert_eq!(got.tables, host_tables, "{what}: block tables");

            let (mut k, mut v) = case.cached_pool();
            let (new_k, new_v) = case.new_kv();
            let row = case.heads.num_kv_heads * case.heads.head_dim;
            twin::write_slots(&new_k, &mut k, &plan.slots, row);
            twin::write_slots(&new_v, &mut v, &plan.slots, row);
            assert!(bits(&got.k) == bits(&stored::<T>(&k)), "{what}: K pool");
            assert!(bits(&got.v) == bits(&stored::<T>(&v)), "{what}: V pool");
            let caches = Caches {
                k: &k,
                v: &v,
                tables: &host_tables,
            };
            let want = stored::<T>(&twin::attention(&plan, &case.q, &caches));
            let differ = bits(&got.out)
                .iter()
                .zip(bits(&want))
                .filter(|(a, b)| **a != *b)
                .count();
            assert_eq!(differ, 0, "{what}: outputs that differ from the twin's");
            let values: Vec<f32> = got.out.iter().map(|x| x.value()).collect();
            let worst = case.worst_error(&values);
            assert!(
                worst <= tolerance(T::DTYPE),
                "{what}: {worst:e} from the reference"
            );
        }
    }
}

#[test]
fn f32_kernels_compute_what_their_twin_computes_bit_for_bit() {
    check::<f32>();
}

#[test]
fn bf16_kernels_compute_what_their_twin_computes_bit_for_bit() {
    check::<half::bf16>();
}

#[test]
fn f16_kernels_compute_what_their_twin_computes_bit_for_bit() {
    check::<half::f16>();
}
