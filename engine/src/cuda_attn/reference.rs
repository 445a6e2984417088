//! Contiguous causal attention in f64, the reference the paged kernels (on a GPU, by
//! `dppo doctor`) and their CPU twin (tests) are held to.

use super::Heads;

/// One sequence of a batch: its new rows' place and its keys and values, contiguous,
/// (keys, kv_heads, head_dim) each, every cached token first.
#[derive(Debug, Clone, Copy)]
pub struct RefSeq<'a> {
    pub first_row: usize,
    pub num_new_tokens: usize,
    pub num_computed_tokens: usize,
    pub k: &'a [f32],
    pub v: &'a [f32],
}

/// Attention output (rows, heads, head_dim) of queries `q` (rows, heads, head_dim): new row
/// `i` of a sequence sees its keys `0..=num_computed_tokens + i`, scaled by 1/sqrt(head_dim).
pub fn attention(q: &[f32], seqs: &[RefSeq<'_>], heads: Heads) -> Vec<f64> {
    let Heads {
        num_heads,
        num_kv_heads,
        head_dim: d,
    } = heads;
    let scale = 1.0 / (d as f64).sqrt();
    let mut out = vec![0.0; q.len()];
    for s in seqs {
        for i in 0..s.num_new_tokens {
            let row = s.first_row + i;
            let keys = s.num_computed_tokens + i + 1;
            for h in 0..num_heads {
                let kh = h / heads.group();
                let qv = &q[(row * num_heads + h) * d..][..d];
                let at = |j: usize| (j * num_kv_heads + kh) * d;
                let scores: Vec<f64> = (0..keys)
                    .map(|j| {
                        let kv = &s.k[at(j)..][..d];
                        qv.iter()
                            .zip(kv)
                            .map(|(&a, &b)| a as f64 * b as f64)
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|x| (x - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                let o = &mut out[(row * num_heads + h) * d..][..d];
                for (j, w) in weights.iter().enumerate() {
                    let vv = &s.v[at(j)..][..d];
                    for (o, &x) in o.iter_mut().zip(vv) {
                        *o += w / total * x as f64;
                    }
                }
            }
        }
    }
    out
}
