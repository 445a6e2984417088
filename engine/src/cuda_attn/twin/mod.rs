//! The CPU twin of kernels/paged_attention.cu: the same grid of blocks, the same chunks,
//! dot products, lanes, butterfly sums, online softmax and merge of splits, in the same order
//! of operations (`mul_add` where the kernel calls `fmaf`), run from the same [`KernelPlan`].
//! Its value pass sums each key group's share of a chunk apart, as the split variant's
//! threads do (one group, every key, for the others); the tensor-core variants' blocks are
//! [`mma`]'s. Tested against [`super::reference`], so a GPU run checks only the
//! translation to CUDA.

use candle_core::DType;

use super::{AttentionKernel, KernelPlan, CHUNK};

mod mma;

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
                    AttentionKernel::Mma { .. } => {
                        mma::block(plan, at, (q, caches), scale, &mut parts)
                    }
                    _ => block(plan, at, (q, caches, variant), scale, &mut parts),
                }
            }
        }
    }
    reduce(plan, &parts)
}

/// What one block (tile, KV head, split) reads: its pairs (a query row and head each), its
/// keys `start..end`, and where they lie in the pool. Both kinds of block start from it.
struct BlockView<'a> {
    plan: &'a KernelPlan,
    caches: &'a Caches<'a>,
    tile: super::Tile,
    kh: usize,
    split: usize,
    pairs: usize,
    start: usize,
    end: usize,
}

impl<'a> BlockView<'a> {
    fn new(
        plan: &'a KernelPlan,
        caches: &'a Caches<'a>,
        (tile, kh, split): (usize, usize, usize),
    ) -> Self {
        let tile = plan.tiles[tile];
        let keys = (tile.first_pos + tile.rows) as usize;
        let start = split * plan.split_len;
        Self {
            plan,
            caches,
            tile,
            kh,
            split,
            pairs: tile.rows as usize * plan.heads.group(),
            start,
            end: (start + plan.split_len).min(keys),
        }
    }

    /// Pair `p`'s (row, query head) index among the batch's (rows x heads).
    fn row_head(&self, p: usize) -> usize {
        let group = self.plan.heads.group();
        let row = self.tile.first_row as usize + p / group;
        row * self.plan.heads.num_heads + self.kh * group + p % group
    }

    /// Pair `p`'s query, (head_dim) of `q`.
    fn query<'q>(&self, q: &'q [f32], p: usize) -> &'q [f32] {
        let d = self.plan.heads.head_dim;
        &q[self.row_head(p) * d..][..d]
    }

    /// Whether pair `p` sees key `j` (the causal mask).
    fn visible(&self, j: usize, p: usize) -> bool {
        j <= self.tile.first_pos as usize + p / self.plan.heads.group()
    }

    /// Key `j`'s slot in the pool, through the sequence's block table.
    fn slot(&self, j: usize) -> usize {
        let (bs, width) = (self.plan.block_size, self.plan.table_width);
        let table = &self.caches.tables[self.tile.seq as usize * width..][..width];
        table[j / bs] as usize * bs + j % bs
    }

    /// The block's KV head's K (or V, from `cache`) row in `slot`.
    fn row(&self, cache: &'a [f32], slot: usize) -> &'a [f32] {
        let d = self.plan.heads.head_dim;
        &cache[slot * self.plan.heads.num_kv_heads * d + self.kh * d..][..d]
    }

    /// Pair `p`'s index among the partial outputs (rows x heads x splits).
    fn part(&self, p: usize) -> usize {
        self.row_head(p) * self.plan.splits + self.split
    }
}

/// One block of the attention kernel.
fn block(
    plan: &KernelPlan,
    at: (usize, usize, usize),
    (q, caches, variant): (&[f32], &Caches<'_>, AttentionKernel),
    scale: f32,
    parts: &mut Partials,
) {
    let b = BlockView::new(plan, caches, at);
    let (d, pairs) = (plan.heads.head_dim, b.pairs);
    let q_s: Vec<f32> = (0..pairs * d)
        .map(|i| b.query(q, i / d)[i % d] * scale)
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
    for c0 in (b.start..b.end).step_by(CHUNK) {
        let n = CHUNK.min(b.end - c0);
        // 1. Scores: each key's dot product with each pair's query, in dimension order.
        for jj in 0..n {
            let j = c0 + jj;
            let slot = b.slot(j);
            let k = b.row(caches.k, slot);
            for p in 0..pairs {
                let q = &q_s[p * d..][..d];
                let dot = q
                    .iter()
                    .zip(k)
                    .fold(0f32, |dot, (&q, &k)| q.mul_add(k, dot));
                s_s[p * CHUNK + jj] = if b.visible(j, p) {
                    dot
                } else {
                    f32::NEG_INFINITY
                };
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
                    let v = b.row(caches.v, slot_s[jj])[e];
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
        let at = b.part(p);
        parts.acc[at * d..][..d].copy_from_slice(&acc_s[p * d..][..d]);
        parts.max[at] = m_s[p];
        parts.sum[at] = l_s[p];
    }
}

/// A warp's butterfly sum (`__shfl_xor_sync` over offsets 16, 8, ..., 1): every lane ends
/// with the same value, lane 0's order of additions.
pub(in crate::cuda_attn) fn butterfly_sum(mut lanes: [f32; WARP]) -> f32 {
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
        worst_of(case, min_blocks, AttentionKernel::SCALAR)
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
                        AttentionKernel::SCALAR,
                        AttentionKernel::split(8, 4),
                        AttentionKernel::Mma { staged: false },
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

    /// A slot outside the pool (which the K/V writes would reach on a GPU unchecked) is
    /// refused with the plan.
    #[test]
    fn a_slot_outside_the_pool_is_refused() {
        let mut rng = StdRng::seed_from_u64(12);
        let mut case = Case::new(&mut rng, heads(3, 64), &[(40, 1), (3, 1)], false, |x| x);
        assert!(case.plan(1).is_ok());
        let pool_slots = case.shape.num_blocks * case.shape.block_size;
        case.slots[1] = pool_slots;
        let err = case.plan(1).unwrap_err().to_string();
        assert!(err.contains(&format!("slot {pool_slots} outside")), "{err}");
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
