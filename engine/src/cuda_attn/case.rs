//! Random batches for checking paged attention: sequences with cached and new tokens
//! scattered over a pool with holes, forked sequences sharing blocks, and their contiguous
//! K/V for [`super::reference`]. The CPU twin's tests and `dppo doctor`'s GPU check use them.

use candle_core::DType;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::reference::{self, RefSeq};
use super::tables::{TableMirror, TableUpload};
use super::{Heads, KernelPlan};
use crate::diff::worst;
use crate::paged_attn::{CacheShape, SeqAttnMeta};
use crate::EngineError;

/// Tokens per block of the cases' pools.
const BLOCK_SIZE: usize = 16;
/// (cached, new) tokens of each sequence of a checked batch: long and short decodes, a fresh
/// prefill, a chunk of a prefill, a one-token context.
const LENS: [(usize, usize); 6] = [(600, 1), (0, 37), (150, 21), (0, 1), (17, 1), (129, 1)];
/// A forking group: three samples, two sharing their prompt's blocks.
const FORK_LENS: [(usize, usize); 3] = [(64, 1), (80, 1), (5, 1)];

/// The batches the kernels are checked on, on a GPU (`dppo doctor`) and in their emulation
/// on the CPU (tests): GQA ratios 1, 3, 4 and 8, head_dim 64 and 128, a plain and a forking
/// batch each, their values exact in `dtype`.
pub fn checked_cases(dtype: DType) -> Vec<Case> {
    let mut rng = StdRng::seed_from_u64(17);
    let mut cases = Vec::new();
    for group in [1, 3, 4, 8] {
        for head_dim in [64, 128] {
            let heads = Heads {
                num_heads: 2 * group,
                num_kv_heads: 2,
                head_dim,
            };
            for (lens, fork) in [(&LENS[..], false), (&FORK_LENS[..], true)] {
                let round = |x: f32| round_to(x, dtype);
                cases.push(Case::new(&mut rng, heads, lens, fork, round));
            }
        }
    }
    cases
}

/// The largest |kernel - f64 reference| a checked case may show in `dtype`.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 2e-2,
        DType::F16 => 4e-3,
        _ => 1e-4,
    }
}

/// `x` as stored in `dtype` and read back.
pub fn round_to(x: f32, dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => half::bf16::from_f32(x).to_f32(),
        DType::F16 => half::f16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// One random batch.
#[derive(Debug, Clone)]
pub struct Case {
    pub heads: Heads,
    pub shape: CacheShape,
    pub metas: Vec<SeqAttnMeta>,
    /// Cache slot of each new row.
    pub slots: Vec<usize>,
    /// Contiguous K/V of every sequence, (keys, kv_heads, head_dim), cached tokens first.
    pub kv: Vec<(Vec<f32>, Vec<f32>)>,
    /// (rows, heads, head_dim) queries of the new rows.
    pub q: Vec<f32>,
}

impl Case {
    /// `lens[i]` = (cached, new) tokens of sequence `i`. Blocks are drawn from a shuffled
    /// pool twice the size needed, leaving holes, and never block 0: the tensor-core kernels
    /// point a key past a split's end at slot 0 and must not read it, and its NaN rows
    /// (see [`Case::cached_pool`]) poison the output if they do. With `fork`, sequence 1
    /// shares sequence
    /// 0's full cached blocks and their contents (a forked sample). Values are rounded by
    /// `round` (to the dtype the check runs in).
    pub fn new(
        rng: &mut StdRng,
        heads: Heads,
        lens: &[(usize, usize)],
        fork: bool,
        round: impl Fn(f32) -> f32,
    ) -> Self {
        let bs = BLOCK_SIZE;
        let need: usize = lens.iter().map(|(c, n)| (c + n).div_ceil(bs)).sum();
        let num_blocks = 2 * need + 3;
        let mut free: Vec<u32> = (1..num_blocks as u32).collect();
        for i in (1..free.len()).rev() {
            free.swap(i, rng.random_range(0..=i));
        }
        free.truncate(need);
        let row_len = heads.num_kv_heads * heads.head_dim;
        let mut kv: Vec<(Vec<f32>, Vec<f32>)> = Vec::new();
        let mut metas: Vec<SeqAttnMeta> = Vec::new();
        let (mut slots, mut first_row) = (Vec::new(), 0);
        for (s, &(cached, new)) in lens.iter().enumerate() {
            let keys = cached + new;
            let mut table: Vec<u32> = (0..keys.div_ceil(bs))
                .map(|_| free.pop().unwrap())
                .collect();
            let mut draw = |n| -> Vec<f32> {
                (0..n)
                    .map(|_| round(rng.random_range(-1.0f32..1.0)))
                    .collect()
            };
            let (mut k, mut v) = (draw(keys * row_len), draw(keys * row_len));
            if fork && s == 1 {
                let shared = (cached / bs).min(metas[0].num_computed_tokens / bs);
                table[..shared].copy_from_slice(&metas[0].block_table[..shared]);
                let n = shared * bs * row_len;
                k[..n].copy_from_slice(&kv[0].0[..n]);
                v[..n].copy_from_slice(&kv[0].1[..n]);
            }
            for p in cached..keys {
                slots.push(table[p / bs] as usize * bs + p % bs);
            }
            metas.push(SeqAttnMeta {
                first_row,
                num_new_tokens: new,
                num_computed_tokens: cached,
                block_table: table,
            });
            first_row += new;
            kv.push((k, v));
        }
        let q = (0..first_row * heads.num_heads * heads.head_dim)
            .map(|_| round(rng.random_range(-2.0f32..2.0)))
            .collect();
        let shape = CacheShape {
            num_layers: 1,
            num_blocks,
            block_size: bs,
            num_kv_heads: heads.num_kv_heads,
            head_dim: heads.head_dim,
        };
        Self {
            heads,
            shape,
            metas,
            slots,
            kv,
            q,
        }
    }

    /// The kernels' plan for the batch, its sequences numbered from 0, and the block
    /// tables the device holds for it.
    pub fn plan(&self, min_blocks: usize) -> Result<(KernelPlan, Vec<u32>), EngineError> {
        let mut mirror = TableMirror::default();
        let seqs: Vec<(u64, &[u32])> = (0..)
            .zip(&self.metas)
            .map(|(s, m)| (s, m.block_table.as_slice()))
            .collect();
        let (rows, upload) = mirror.update(&seqs, |_| true);
        debug_assert_eq!(upload, TableUpload::Whole);
        let plan = KernelPlan::new(
            &self.metas,
            (&rows, mirror.width()),
            &self.slots,
            self.shape,
            self.heads,
            min_blocks,
        )?;
        Ok((plan, mirror.host().to_vec()))
    }

    /// The new rows' K and V, (rows, kv_heads, head_dim) each, in batch order.
    pub fn new_kv(&self) -> (Vec<f32>, Vec<f32>) {
        let row = self.heads.num_kv_heads * self.heads.head_dim;
        let (mut k, mut v) = (Vec::new(), Vec::new());
        for (m, (sk, sv)) in self.metas.iter().zip(&self.kv) {
            let new = m.num_computed_tokens..m.num_computed_tokens + m.num_new_tokens;
            k.extend_from_slice(&sk[new.start * row..new.end * row]);
            v.extend_from_slice(&sv[new.start * row..new.end * row]);
        }
        (k, v)
    }

    /// The pool, (slots, kv_heads * head_dim) per K and V, with every sequence's cached
    /// tokens in their slots and NaN everywhere else (a read outside the block tables
    /// poisons the output); the new rows are not written yet.
    pub fn cached_pool(&self) -> (Vec<f32>, Vec<f32>) {
        let row = self.heads.num_kv_heads * self.heads.head_dim;
        let size = self.shape.num_blocks * self.shape.block_size * row;
        let (mut k, mut v) = (vec![f32::NAN; size], vec![f32::NAN; size]);
        let bs = self.shape.block_size;
        for (m, (sk, sv)) in self.metas.iter().zip(&self.kv) {
            for p in 0..m.num_computed_tokens {
                let slot = m.block_table[p / bs] as usize * bs + p % bs;
                k[slot * row..][..row].copy_from_slice(&sk[p * row..][..row]);
                v[slot * row..][..row].copy_from_slice(&sv[p * row..][..row]);
            }
        }
        (k, v)
    }

    /// Contiguous attention of the new rows in f64.
    pub fn reference(&self) -> Vec<f64> {
        let seqs: Vec<RefSeq<'_>> = self
            .metas
            .iter()
            .zip(&self.kv)
            .map(|(m, (k, v))| RefSeq {
                first_row: m.first_row,
                num_new_tokens: m.num_new_tokens,
                num_computed_tokens: m.num_computed_tokens,
                k,
                v,
            })
            .collect();
        reference::attention(&self.q, &seqs, self.heads)
    }

    /// The largest |got - reference|, infinite where `got` holds a NaN.
    pub fn worst_error(&self, got: &[f32]) -> f64 {
        worst(got, &self.reference())
    }

    /// The case for reports: its heads and each sequence's cached + new tokens.
    pub fn describe(&self) -> String {
        let seqs: Vec<String> = self
            .metas
            .iter()
            .map(|m| format!("{}+{}", m.num_computed_tokens, m.num_new_tokens))
            .collect();
        let h = self.heads;
        format!(
            "{} query heads on {} KV heads of {}, sequences of cached+new tokens {}",
            h.num_heads,
            h.num_kv_heads,
            h.head_dim,
            seqs.join(" ")
        )
    }

    /// The sequence whose new rows of `got` are furthest from `want` (both (rows, heads,
    /// head_dim) in batch order), and that distance: where a wrong output comes from.
    pub fn worst_sequence(&self, got: &[f32], want: &[f64]) -> (usize, f64) {
        let row = self.heads.num_heads * self.heads.head_dim;
        let of = |m: &SeqAttnMeta| {
            let rows = m.first_row * row..(m.first_row + m.num_new_tokens) * row;
            match (got.get(rows.clone()), want.get(rows)) {
                (Some(g), Some(w)) => worst(g, w),
                _ => f64::INFINITY,
            }
        };
        (0..)
            .zip(&self.metas)
            .map(|(s, m)| (s, of(m)))
            .fold((0, -1.0), |a, b| if b.1 > a.1 { b } else { a })
    }
}

/// The (index, block) pairs that write `host` block tables into zeroed ones, as the engine
/// sends an iteration's changed entries.
pub fn table_entries(host: &[u32]) -> Vec<u32> {
    (0..)
        .zip(host)
        .filter(|(_, &b)| b != 0)
        .flat_map(|(i, &b)| [i, b])
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wrong_output_is_traced_to_its_sequence() {
        let case = &checked_cases(DType::F32)[0];
        let want = case.reference();
        let mut got: Vec<f32> = want.iter().map(|&x| x as f32).collect();
        let row = case.heads.num_heads * case.heads.head_dim;
        let at = |s: usize, r: usize| (case.metas[s].first_row + r) * row;
        // Off by 0.5 in a row of sequence 2 (a chunk of a prefill), by 0.1 in sequence 0.
        got[at(2, 5) + 3] += 0.5;
        got[at(0, 0)] += 0.1;
        let (seq, err) = case.worst_sequence(&got, &want);
        assert_eq!(seq, 2);
        assert!((err - 0.5).abs() < 1e-3, "{err}");
        got[at(4, 0)] = f32::NAN;
        assert_eq!(case.worst_sequence(&got, &want), (4, f64::INFINITY));
        assert!(case.describe().contains("150+21"), "{}", case.describe());
    }
}
