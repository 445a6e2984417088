//! The CPU twin of kernels/paged_attention.cu: the same grid of blocks, the same chunks,
//! dot products, lanes, butterfly sums, online softmax and merge of splits, in the same order
//! of operations (`mul_add` where the kernel calls `fmaf`), run from the same [`KernelPlan`].
//! Its value pass sums each key group's share of a chunk apart, as the split variant's
//! threads do (one group, every key, for the others); the tensor-core variant's blocks are
//! [`mma_block`]'s. Tested against [`super::reference`], so a GPU run checks only the
//! translation to CUDA.

use candle_core::DType;

use super::case::round_to;
use super::{AttentionKernel, KernelPlan, CHUNK, THREADS};

const WARP: usize = 32;
/// Keys of a tensor-core warp's run (the kernel's `MMA_KEYS`).
const MMA_KEYS: usize = 16;

/// The caches as the kernels see them, (slots, kv_heads * head_dim) each, and the block
/// tables, (rows, plan.table_width); `dtype` is their elements' (the tensor-core variant
/// rounds its probabilities to it).
pub struct Caches<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub tables: &'a [u32],
    pub dtype: DType,
}

/// The partial outputs of every (row, head, split), as the attention kernel writes them.
struct Partials {
    acc: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f32>,
}

/// `write_slots`: each batch row's K (or V) into its slot.
pub fn write_slots(src: &[f32], cache: &mut [f32], slots: &[u32], row: usize) {
    for (t, &slot) in slots.iter().enumerate() {
        cache[slot as usize * row..][..row].copy_from_slice(&src[t * row..][..row]);
    }
}

/// `paged_attention` (`variant`) then `paged_reduce`: (rows, heads, head_dim) of `q`.
pub fn attention(
    plan: &KernelPlan,
    q: &[f32],
    caches: &Caches<'_>,
    variant: AttentionKernel,
) -> Vec<f32> {
    let scale = 1.0 / (plan.heads.head_dim as f32).sqrt();
    let mut parts = Partials {
        acc: vec![f32::NAN; plan.partial_len()],
        max: vec![f32::NAN; plan.partial_len() / plan.heads.head_dim],
        sum: vec![f32::NAN; plan.partial_len() / plan.heads.head_dim],
    };
    for tile in 0..plan.tiles.len() {
        for kh in 0..plan.heads.num_kv_heads {
            for split in 0..plan.splits {
                let at = (tile, kh, split);
                match variant {
                    AttentionKernel::Mma => mma_block(plan, at, (q, caches), scale, &mut parts),
                    _ => block(plan, at, (q, caches, variant), scale, &mut parts),
                }
            }
        }
    }
    reduce(plan, &parts)
}

/// One block of the attention kernel.
fn block(
    plan: &KernelPlan,
    (tile, kh, split): (usize, usize, usize),
    (q, caches, variant): (&[f32], &Caches<'_>, AttentionKernel),
    scale: f32,
    parts: &mut Partials,
) {
    let t = plan.tiles[tile];
    let (heads, d) = (plan.heads.num_heads, plan.heads.head_dim);
    let group = plan.heads.group();
    let pairs = t.rows as usize * group;
    let row_len = plan.heads.num_kv_heads * d;
    let row_of = |p: usize| t.first_row as usize + p / group;
    let head_of = |p: usize| kh * group + p % group;
    let q_s: Vec<f32> = (0..pairs * d)
        .map(|i| q[(row_of(i / d) * heads + head_of(i / d)) * d + i % d] * scale)
        .collect();
    // Each key group's sums (keys g, g + groups, ... of every chunk).
    let groups = variant.key_groups(pairs, d);
    let mut acc_s = vec![vec![0f32; pairs * d]; groups];
    let (mut m_s, mut l_s, mut a_s) = (
        vec![f32::NEG_INFINITY; pairs],
        vec![0f32; pairs],
        vec![0f32; pairs],
    );
    let mut s_s = vec![0f32; pairs * CHUNK];
    let mut slot_s = [0usize; CHUNK];
    let keys = (t.first_pos + t.rows) as usize;
    let start = split * plan.split_len;
    let end = (start + plan.split_len).min(keys);
    let table = &caches.tables[t.seq as usize * plan.table_width..][..plan.table_width];
    let bs = plan.block_size;
    for c0 in (start..end).step_by(CHUNK) {
        let n = CHUNK.min(end - c0);
        // 1. Scores: each key's dot product with each pair's query, in dimension order.
        for jj in 0..n {
            let j = c0 + jj;
            let slot = table[j / bs] as usize * bs + j % bs;
            let k = &caches.k[slot * row_len + kh * d..][..d];
            for p in 0..pairs {
                let q = &q_s[p * d..][..d];
                let dot = q
                    .iter()
                    .zip(k)
                    .fold(0f32, |dot, (&q, &k)| q.mul_add(k, dot));
                let visible = j <= t.first_pos as usize + p / group;
                s_s[p * CHUNK + jj] = if visible { dot } else { f32::NEG_INFINITY };
            }
            slot_s[jj] = slot;
        }
        // 2. Online softmax per pair: lane i sums keys i, i + 32, ..., then the butterfly.
        for p in 0..pairs {
            let s = &mut s_s[p * CHUNK..][..n];
            let mc = s.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
            let m_new = m_s[p].max(mc);
            let (mut l, mut alpha) = (l_s[p], 0.0);
            if m_new == f32::NEG_INFINITY {
                s.fill(0.0);
            } else {
                alpha = (m_s[p] - m_new).exp();
                let mut lanes = [0f32; WARP];
                for (jj, x) in s.iter_mut().enumerate() {
                    *x = (*x - m_new).exp();
                    lanes[jj % WARP] += *x;
                }
                l = l.mul_add(alpha, butterfly_sum(lanes));
            }
            (m_s[p], l_s[p], a_s[p]) = (m_new, l, alpha);
        }
        // 3. Values per key group, pair and dimension: rescaled, then the group's keys.
        for (g, acc_g) in acc_s.iter_mut().enumerate() {
            for (i, acc) in acc_g.iter_mut().enumerate() {
                let (p, e) = (i / d, i % d);
                let mut a = *acc * a_s[p];
                for jj in (g..n).step_by(groups) {
                    let v = caches.v[slot_s[jj] * row_len + kh * d + e];
                    a = s_s[p * CHUNK + jj].mul_add(v, a);
                }
                *acc = a;
            }
        }
    }
    // The groups' sums added in group order.
    let acc_s: Vec<f32> = (0..pairs * d)
        .map(|i| acc_s[1..].iter().fold(acc_s[0][i], |x, g| x + g[i]))
        .collect();
    for p in 0..pairs {
        let at = (row_of(p) * heads + head_of(p)) * plan.splits + split;
        parts.acc[at * d..][..d].copy_from_slice(&acc_s[p * d..][..d]);
        parts.max[at] = m_s[p];
        parts.sum[at] = l_s[p];
    }
}

/// One warp's online softmax in the tensor-core kernel, over its pairs.
struct WarpState {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

/// One block of the tensor-core kernel: warp `w` takes runs `w`, `w + 4`, ... of 16 keys,
/// scores each pair's query (unscaled) in dimension order and then scales, rounds the
/// probabilities to the caches' dtype, sums a row's four lanes' probabilities (each lane's
/// two pairs of keys, then the quad's butterfly) and adds the run's values in key order
/// after the rescale; the warps meet in warp order.
fn mma_block(
    plan: &KernelPlan,
    (tile, kh, split): (usize, usize, usize),
    (q, caches): (&[f32], &Caches<'_>),
    scale: f32,
    parts: &mut Partials,
) {
    let t = plan.tiles[tile];
    let (heads, d) = (plan.heads.num_heads, plan.heads.head_dim);
    let group = plan.heads.group();
    let pairs = t.rows as usize * group;
    let row_len = plan.heads.num_kv_heads * d;
    let row_of = |p: usize| t.first_row as usize + p / group;
    let head_of = |p: usize| kh * group + p % group;
    let keys = (t.first_pos + t.rows) as usize;
    let start = split * plan.split_len;
    let end = (start + plan.split_len).min(keys);
    let table = &caches.tables[t.seq as usize * plan.table_width..][..plan.table_width];
    let bs = plan.block_size;
    let slot = |j: usize| table[j / bs] as usize * bs + j % bs;
    let warps = THREADS / WARP;
    let states: Vec<WarpState> = (0..warps)
        .map(|w| {
            let mut st = WarpState {
                max: vec![f32::NEG_INFINITY; pairs],
                sum: vec![0.0; pairs],
                acc: vec![0.0; pairs * d],
            };
            for j0 in (start + w * MMA_KEYS..end).step_by(warps * MMA_KEYS) {
                let live = |kk: usize| j0 + kk < end;
                for p in 0..pairs {
                    let qp = &q[(row_of(p) * heads + head_of(p)) * d..][..d];
                    let s: Vec<f32> = (0..MMA_KEYS)
                        .map(|kk| {
                            let j = j0 + kk;
                            if !live(kk) || j > t.first_pos as usize + p / group {
                                return f32::NEG_INFINITY;
                            }
                            let k = &caches.k[slot(j) * row_len + kh * d..][..d];
                            qp.iter().zip(k).fold(0f32, |a, (&q, &k)| q.mul_add(k, a)) * scale
                        })
                        .collect();
                    let m_old = st.max[p];
                    let m_new = s.iter().fold(m_old, |m, &x| m.max(x));
                    // All masked so far: exp(-inf - 0) makes the probabilities and rescale 0.
                    let m_use = if m_new == f32::NEG_INFINITY {
                        0.0
                    } else {
                        m_new
                    };
                    let alpha = (m_old - m_use).exp();
                    let e: Vec<f32> = s
                        .iter()
                        .map(|&x| round_to((x - m_use).exp(), caches.dtype))
                        .collect();
                    // Lane `pos` of the row's quad holds keys 2 pos, 2 pos + 1, 8 + 2 pos and
                    // 9 + 2 pos; the quad's butterfly adds lanes 0 + 1 and 2 + 3.
                    let lane =
                        |pos: usize| e[2 * pos] + e[2 * pos + 1] + e[8 + 2 * pos] + e[9 + 2 * pos];
                    let sum = (lane(0) + lane(1)) + (lane(2) + lane(3));
                    st.sum[p] = st.sum[p].mul_add(alpha, sum);
                    st.max[p] = m_new;
                    for (i, acc) in st.acc[p * d..][..d].iter_mut().enumerate() {
                        *acc = (0..MMA_KEYS).fold(*acc * alpha, |a, kk| {
                            let v = match live(kk) {
                                true => caches.v[slot(j0 + kk) * row_len + kh * d + i],
                                false => 0.0,
                            };
                            e[kk].mul_add(v, a)
                        });
                    }
                }
            }
            st
        })
        .collect();
    for p in 0..pairs {
        let mx = states
            .iter()
            .fold(f32::NEG_INFINITY, |m, s| m.max(s.max[p]));
        let weight = |s: &WarpState| match s.max[p] == f32::NEG_INFINITY {
            true => 0.0,
            false => (s.max[p] - mx).exp(),
        };
        let at = (row_of(p) * heads + head_of(p)) * plan.splits + split;
        parts.max[at] = mx;
        parts.sum[at] = states
            .iter()
            .fold(0f32, |l, s| s.sum[p].mul_add(weight(s), l));
        for e in 0..d {
            parts.acc[at * d + e] = states
                .iter()
                .fold(0f32, |a, s| s.acc[p * d + e].mul_add(weight(s), a));
        }
    }
}

/// A warp's butterfly sum (`__shfl_xor_sync` over offsets 16, 8, ..., 1): every lane ends
/// with the same value, lane 0's order of additions.
fn butterfly_sum(mut lanes: [f32; WARP]) -> f32 {
    let mut off = WARP / 2;
    while off > 0 {
        let before = lanes;
        for (lane, x) in lanes.iter_mut().enumerate() {
            *x += before[lane ^ off];
        }
        off /= 2;
    }
    lanes[0]
}

/// The reduce kernel: each (row, head) merges its splits.
fn reduce(plan: &KernelPlan, parts: &Partials) -> Vec<f32> {
    let (heads, d, splits) = (plan.heads.num_heads, plan.heads.head_dim, plan.splits);
    let mut out = vec![0f32; plan.rows * heads * d];
    for rh in 0..plan.rows * heads {
        let base = rh * splits;
        let m = (0..splits).fold(f32::NEG_INFINITY, |m, s| m.max(parts.max[base + s]));
        let weight = |s: usize| {
            let ms = parts.max[base + s];
            if ms == f32::NEG_INFINITY {
                0.0
            } else {
                (ms - m).exp()
            }
        };
        let l = (0..splits).fold(0f32, |l, s| parts.sum[base + s].mul_add(weight(s), l));
        for e in 0..d {
            let a = (0..splits).fold(0f32, |a, s| {
                parts.acc[(base + s) * d + e].mul_add(weight(s), a)
            });
            out[rh * d + e] = if l > 0.0 { a / l } else { 0.0 };
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    use super::*;
    use crate::cuda_attn::case::Case;
    use crate::cuda_attn::Heads;

    /// The twin's worst difference from the reference under a plan of `min_blocks`.
    fn worst(case: &Case, min_blocks: usize) -> (f64, KernelPlan) {
        worst_of(case, min_blocks, AttentionKernel::default())
    }

    /// The same for the value pass of `variant`.
    fn worst_of(case: &Case, min_blocks: usize, variant: AttentionKernel) -> (f64, KernelPlan) {
        let (plan, tables) = case.plan(min_blocks).unwrap();
        let (mut k, mut v) = case.cached_pool();
        let (new_k, new_v) = case.new_kv();
        let row = case.heads.num_kv_heads * case.heads.head_dim;
        write_slots(&new_k, &mut k, &plan.slots, row);
        write_slots(&new_v, &mut v, &plan.slots, row);
        let caches = Caches {
            k: &k,
            v: &v,
            tables: &tables,
            dtype: DType::F32,
        };
        let got = attention(&plan, &case.q, &caches, variant);
        (case.worst_error(&got), plan)
    }

    fn heads(group: usize, head_dim: usize) -> Heads {
        Heads {
            num_heads: 2 * group,
            num_kv_heads: 2,
            head_dim,
        }
    }

    #[test]
    fn decode_prefill_and_chunked_prefill_match_the_reference() {
        let mut rng = StdRng::seed_from_u64(7);
        // Decoding rows over long and short contexts, a fresh prefill, a chunked prefill
        // (cached tokens plus a chunk), and a one-token context.
        let lens = [(300, 1), (0, 37), (150, 21), (0, 1), (17, 1), (129, 1)];
        for group in [1, 3, 4, 8] {
            for head_dim in [64, 128] {
                let case = Case::new(&mut rng, heads(group, head_dim), &lens, false, |x| x);
                for min_blocks in [1, 64, 10_000] {
                    let variants = [
                        AttentionKernel::default(),
                        AttentionKernel::split(8, 4),
                        AttentionKernel::Mma,
                    ];
                    for variant in variants {
                        let (worst, plan) = worst_of(&case, min_blocks, variant);
                        assert!(
                            worst < 2e-5,
                            "{variant}, group {group}, head_dim {head_dim}, {} splits of {}: \
                             {worst:e}",
                            plan.splits,
                            plan.split_len
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn splitting_the_context_changes_the_plan_not_the_result() {
        let mut rng = StdRng::seed_from_u64(8);
        let case = Case::new(&mut rng, heads(3, 64), &[(700, 1), (40, 1)], false, |x| x);
        let (one, plan_one) = worst(&case, 1);
        let (many, plan_many) = worst(&case, 10_000);
        assert_eq!(plan_one.splits, 1);
        assert_eq!(plan_many.splits, 6, "701 keys in chunks of {CHUNK}");
        assert!(one < 2e-5 && many < 2e-5, "{one:e} {many:e}");
    }

    #[test]
    fn forked_sequences_read_their_shared_blocks() {
        let mut rng = StdRng::seed_from_u64(9);
        let case = Case::new(
            &mut rng,
            heads(4, 64),
            &[(64, 1), (80, 1), (5, 1)],
            true,
            |x| x,
        );
        let (a, b) = (&case.metas[0].block_table, &case.metas[1].block_table);
        assert_eq!(a[..4], b[..4], "the fork shares four full blocks");
        let (worst, _) = worst(&case, 64);
        assert!(worst < 2e-5, "{worst:e}");
    }

    #[test]
    fn prefill_tiles_hold_sixteen_pairs_and_cover_every_row_once() {
        let mut rng = StdRng::seed_from_u64(10);
        for group in [1, 3, 4, 8, 16] {
            let case = Case::new(
                &mut rng,
                heads(group, 64),
                &[(10, 45), (0, 1)],
                false,
                |x| x,
            );
            let (plan, _) = case.plan(1).unwrap();
            let mut seen = vec![0; plan.rows];
            for t in &plan.tiles {
                assert!(t.rows as usize * group <= 16.max(group));
                for r in t.first_row..t.first_row + t.rows {
                    seen[r as usize] += 1;
                }
            }
            assert!(seen.iter().all(|&n| n == 1), "group {group}: {seen:?}");
            assert_eq!(plan.max_pairs, (16 / group).max(1) * group);
        }
    }

    #[test]
    fn a_decode_step_uploads_its_tiles_and_slots() {
        let mut rng = StdRng::seed_from_u64(11);
        let lens = [(40, 1), (100, 1), (3, 1)];
        let case = Case::new(&mut rng, heads(3, 64), &lens, false, |x| x);
        let (plan, _) = case.plan(1).unwrap();
        // One tile of one row per sequence and one slot per row; the tables are 8 wide (7
        // blocks of 16 for 101 keys, doubled), sent apart.
        assert_eq!(plan.tiles.len(), 3);
        assert_eq!(plan.table_width, 8);
        assert_eq!(plan.upload_bytes(), 4 * (4 * 3 + 3));
        assert_eq!(plan.tile_words().len(), 4 * plan.tiles.len());
    }

    #[test]
    fn a_head_dim_the_kernels_lack_is_refused_with_its_reason() {
        let err = Heads {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 80,
        }
        .check()
        .unwrap_err();
        assert!(err.to_string().contains("head_dim 80"), "{err}");
    }
}
