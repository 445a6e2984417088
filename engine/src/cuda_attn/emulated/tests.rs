//! kernels/paged_attention.cu itself, run on the CPU ([`crate::kernel_emu`]) over the GPU
//! check's batches and geometry: the block tables written entry by entry, the new K/V written
//! into their slots, the attention and the merge of its splits. Held bit for bit to the CPU
//! twin (its output rounded to the dtype) and within the GPU check's tolerance to the f64
//! reference.

use candle_core::DType;
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::{attend, copy_slots, write_slots, Stored, MULTIPROCESSORS};
use crate::cuda_attn::case::{checked_cases, round_to, table_entries, tolerance, Case};
use crate::cuda_attn::copies::SlotCopies;
use crate::cuda_attn::padding::Padding;
use crate::cuda_attn::tables::TableCopy;
use crate::cuda_attn::twin::{self, Caches};
use crate::cuda_attn::{AttentionKernel, Heads, KernelPlan};
use crate::kv_pool::BlockCopy;

/// The engine's split target on the emulation's GPU.
const MIN_BLOCKS: usize = 2 * MULTIPROCESSORS;

fn stored<T: Stored>(xs: &[f32]) -> Vec<T> {
    xs.iter().map(|&x| T::of(x)).collect()
}

fn bits<T: Stored>(xs: &[T]) -> Vec<u32> {
    xs.iter().map(|x| x.bits()).collect()
}

/// What the emulated kernels leave: the output, both pools and the block tables.
struct Emulated<T> {
    out: Vec<T>,
    k: Vec<T>,
    v: Vec<T>,
    tables: Vec<u32>,
}

/// One batch through the kernels in `T`: the block tables written entry by entry from
/// zero, the new K/V into their slots, the attention (`variant`) and its merge.
fn emulate<T: Stored>(
    case: &Case,
    plan: &KernelPlan,
    host_tables: &[u32],
    variant: AttentionKernel,
) -> Emulated<T> {
    let mut tables = vec![0u32; host_tables.len()];
    tables.write_entries(&table_entries(host_tables)).unwrap();
    let (pool_k, pool_v) = case.cached_pool();
    let (mut k, mut v) = (stored::<T>(&pool_k), stored::<T>(&pool_v));
    let (new_k, new_v) = case.new_kv();
    write_slots(plan, &stored::<T>(&new_k), &mut k).unwrap();
    write_slots(plan, &stored::<T>(&new_v), &mut v).unwrap();
    let out = attend(plan, &stored::<T>(&case.q), (&k, &v), &tables, variant).unwrap();
    Emulated { out, k, v, tables }
}

/// Every checked batch in `T`, through the default attention.
fn check<T: Stored>() {
    check_cases::<T>(&checked_cases(T::DTYPE), AttentionKernel::SCALAR);
}

/// `cases` in `T` through `variant`, unsplit (many chunks a block), split as the engine would
/// on an H100, and into one chunk per split: the emulated kernels against the twin and the
/// reference. Cases whose heads or dtype the variant does not serve are left out; at least
/// one must remain.
fn check_cases<T: Stored>(cases: &[Case], variant: AttentionKernel) {
    let served: Vec<(usize, &Case)> = (cases.iter().enumerate())
        .filter(|(_, case)| variant.serves(case.heads, T::DTYPE))
        .collect();
    assert!(
        !served.is_empty(),
        "{variant} serves none of the cases in {:?}",
        T::DTYPE
    );
    for (c, case) in served {
        for min_blocks in [1, MIN_BLOCKS, usize::MAX / 2] {
            let (plan, host_tables) = case.plan(min_blocks).unwrap();
            let got = emulate::<T>(case, &plan, &host_tables, variant);
            let what = format!(
                "{:?} {variant} case {c} ({}), {} splits of {}",
                T::DTYPE,
                case.describe(),
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
                dtype: T::DTYPE,
            };
            let want = stored::<T>(&twin::attention(&plan, &case.q, &caches, variant));
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
                "{what}: {worst:e} from the reference, furthest in (sequence, distance) {:?}",
                case.worst_sequence(&values, &case.reference())
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

/// A case for each (query heads a KV head, head_dim) of `layouts`, two KV heads, sequences of
/// `lens`, values rounded to `dtype`, drawn from `seed`.
fn cases_of(
    seed: u64,
    layouts: &[(usize, usize)],
    lens: &[(usize, usize)],
    dtype: DType,
) -> Vec<Case> {
    let mut rng = StdRng::seed_from_u64(seed);
    layouts
        .iter()
        .map(|&(group, head_dim)| {
            let heads = Heads {
                num_heads: 2 * group,
                num_kv_heads: 2,
                head_dim,
            };
            Case::new(&mut rng, heads, lens, false, |x| round_to(x, dtype))
        })
        .collect()
}

/// The widest heads the kernels take: head_dim 256 (sixteen 16-byte loads a bf16 K row) and 16 query
/// heads a KV head, whose prefill tiles use the most shared memory a block may have without
/// opting in to more (41 of 48 KiB; the emulation faults a word past a launch's share).
#[test]
fn the_widest_heads_fit_their_shared_memory() {
    let lens = [(200, 1), (0, 20), (30, 9)];
    let cases = |dtype| cases_of(29, &[(1, 256), (16, 256), (16, 64)], &lens, dtype);
    let f32_cases = cases(DType::F32);
    let widest = f32_cases[1]
        .plan(1)
        .unwrap()
        .0
        .shared_bytes(AttentionKernel::SCALAR);
    assert!(widest > 40 * 1024 && widest <= 48 * 1024, "{widest} bytes");
    for variant in AttentionKernel::VARIANTS {
        if !variant.is_mma() {
            check_cases::<f32>(&f32_cases, variant);
        }
        check_cases::<half::bf16>(&cases(DType::BF16), variant);
    }
}

/// The head dims the scalar kernels take besides the checked cases' 64, 128 and 256: 32 (a
/// bf16 K row of four 16-byte loads) and 96 (an odd multiple of 32). The tensor-core kernel
/// takes 64 and 128 only.
#[test]
fn head_dims_of_32_and_96_are_attended_whole() {
    let lens = [(150, 1), (0, 12), (40, 3)];
    let cases = |dtype| cases_of(31, &[(3, 32), (4, 96)], &lens, dtype);
    for variant in AttentionKernel::VARIANTS {
        if !variant.is_mma() {
            check_cases::<f32>(&cases(DType::F32), variant);
            check_cases::<half::bf16>(&cases(DType::BF16), variant);
        }
    }
}

/// Every variant of the attention computes what its twin computes, bit for bit, over the
/// checked batches in bf16 and f16: the scalar ones what the default computes (their twin
/// is the same but for the split pass's order), `mma` and `mma_staged` their own blocks'
/// order (the same for both: only where their operands come from differs).
#[test]
fn every_attention_variant_computes_what_its_twin_computes_bit_for_bit() {
    for variant in AttentionKernel::VARIANTS.into_iter().skip(1) {
        check_cases::<half::bf16>(&checked_cases(DType::BF16), variant);
        check_cases::<half::f16>(&checked_cases(DType::F16), variant);
    }
}

/// Each checked batch padded as a captured decode step is (`Padding::extend`: pad rows that
/// attend key 0 of the first sequence and write into a scratch block past the pool's blocks,
/// more of them than a block holds; the context rounded up to a power of two), through the
/// scalar kernel in f32 and the tensor-core default in bf16. The kernels compute what their
/// twin computes on the padded plan, bit for bit, every row; the real rows stay within
/// tolerance of the unpadded batch's reference (the scratch block holds NaN until the pad
/// rows write it, so a real row reading it would show); and the pool changes only at the
/// real rows' slots and in the scratch block. The rounding changes some batch's splits.
#[test]
fn padded_batches_leave_the_real_rows_and_the_pool_as_they_were() {
    let mut resplit = padded_cases::<f32>(AttentionKernel::SCALAR);
    resplit += padded_cases::<half::bf16>(AttentionKernel::TENSOR_CORE);
    assert!(
        resplit > 0,
        "no batch's splits changed with its rounded context"
    );
}

/// [`padded_batches_leave_the_real_rows_and_the_pool_as_they_were`] in `T` on `variant`:
/// the number of padded plans whose splits the rounding changed.
fn padded_cases<T: Stored>(variant: AttentionKernel) -> usize {
    let mut resplit = 0;
    let cases = checked_cases(T::DTYPE);
    let served = cases.iter().filter(|c| variant.serves(c.heads, T::DTYPE));
    for (c, case) in served.enumerate() {
        for min_blocks in [1, MIN_BLOCKS] {
            let (plan, tables) = case.plan(min_blocks).unwrap();
            let (bs, blocks) = (case.shape.block_size, case.shape.num_blocks);
            let padding = Padding {
                bucket: plan.rows + 2 * bs + 1,
                scratch_slot: blocks * bs,
                block_size: bs,
            };
            let mut padded = plan.clone();
            padding
                .extend(&mut padded, min_blocks, (blocks + 1) * bs)
                .unwrap();
            resplit +=
                usize::from((padded.splits, padded.split_len) != (plan.splits, plan.split_len));
            let what = format!(
                "{:?} {variant} case {c} ({}), {} splits of {} padded to {} of {}",
                T::DTYPE,
                case.describe(),
                plan.splits,
                plan.split_len,
                padded.splits,
                padded.split_len
            );
            // The pool and the inputs with the scratch block and the pad rows' junk.
            let row = case.heads.num_kv_heads * case.heads.head_dim;
            let pads = padded.rows - plan.rows;
            let (mut k, mut v) = case.cached_pool();
            k.resize(k.len() + bs * row, f32::NAN);
            v.resize(v.len() + bs * row, f32::NAN);
            let (mut new_k, mut new_v) = case.new_kv();
            new_k.extend((0..pads * row).map(|i| round_to(0.5 - (i % 7) as f32 * 0.25, T::DTYPE)));
            new_v.extend((0..pads * row).map(|i| round_to((i % 5) as f32 * 0.5 - 1.0, T::DTYPE)));
            let mut q = case.q.clone();
            let pair = case.heads.num_heads * case.heads.head_dim;
            q.extend((0..pads * pair).map(|i| round_to((i % 9) as f32 * 0.25 - 1.0, T::DTYPE)));

            let (mut got_k, mut got_v) = (stored::<T>(&k), stored::<T>(&v));
            write_slots(&padded, &stored::<T>(&new_k), &mut got_k).unwrap();
            write_slots(&padded, &stored::<T>(&new_v), &mut got_v).unwrap();
            let got = attend(
                &padded,
                &stored::<T>(&q),
                (&got_k, &got_v),
                &tables,
                variant,
            )
            .unwrap();

            twin::write_slots(&new_k, &mut k, &padded.slots, row);
            twin::write_slots(&new_v, &mut v, &padded.slots, row);
            // The scratch block's slots are written by several pad rows in no set order.
            let pool = blocks * bs * row;
            assert!(
                bits(&got_k[..pool]) == bits(&stored::<T>(&k[..pool])),
                "{what}: K pool"
            );
            assert!(
                bits(&got_v[..pool]) == bits(&stored::<T>(&v[..pool])),
                "{what}: V pool"
            );
            let (mut unpadded_k, _) = case.cached_pool();
            twin::write_slots(&case.new_kv().0, &mut unpadded_k, &plan.slots, row);
            assert!(
                bits(&stored::<T>(&k[..pool])) == bits(&stored::<T>(&unpadded_k)),
                "{what}: pads wrote the pool"
            );
            let caches = Caches {
                k: &k,
                v: &v,
                tables: &tables,
                dtype: T::DTYPE,
            };
            let want = stored::<T>(&twin::attention(&padded, &q, &caches, variant));
            assert!(
                bits(&got) == bits(&want),
                "{what}: outputs that differ from the twin's"
            );
            let real: Vec<f32> = got[..plan.rows * pair].iter().map(|x| x.value()).collect();
            let worst = case.worst_error(&real);
            assert!(
                worst <= tolerance(T::DTYPE),
                "{what}: {worst:e} from the reference"
            );
        }
    }
    resplit
}

/// `copy_slots` copies each order's tokens of its source block into its fresh block, row by
/// row, and touches no other slot: copy-on-write of a shared prompt block.
fn copies_rows_exactly<T: Stored>() {
    let case = &checked_cases(T::DTYPE)[0];
    let (plan, _) = case.plan(1).unwrap();
    let row = case.heads.num_kv_heads * case.heads.head_dim;
    let bs = plan.block_size;
    // Every slot distinct, unlike a case's pool (zero past its cached tokens).
    let slots = case.cached_pool().0.len() / row;
    let pool: Vec<f32> = (0..slots * row)
        .map(|i| (i * 7919 % 1000) as f32 / 64.0)
        .collect();
    let mut got = stored::<T>(&pool);
    let orders = [
        BlockCopy {
            src: 2,
            dst: 5,
            num_tokens: bs - 1,
        },
        BlockCopy {
            src: 0,
            dst: 7,
            num_tokens: 1,
        },
    ];
    let copies = SlotCopies::of(&orders, bs);
    assert_eq!(copies.len(), bs, "one pair a copied token");
    let mut want = got.clone();
    for o in &orders {
        for i in 0..o.num_tokens {
            let (from, to) = (o.src as usize * bs + i, o.dst as usize * bs + i);
            want.copy_within(from * row..(from + 1) * row, to * row);
        }
    }
    copy_slots(&plan, &copies, &mut got).unwrap();
    assert!(bits(&got) == bits(&want), "{:?}", T::DTYPE);
    assert!(
        bits(&got) != bits(&stored::<T>(&pool)),
        "the copies changed the pool"
    );
}

#[test]
fn copy_on_write_copies_each_token_of_its_block() {
    copies_rows_exactly::<f32>();
    copies_rows_exactly::<half::bf16>();
}
