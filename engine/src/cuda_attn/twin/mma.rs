//! The twin's blocks of the tensor-core variant (`paged_attention_mma`): the kernel's work
//! split over warps and its order of operations, as the emulation computes its products.

use super::{BlockView, Caches, Partials, MMA_KEYS, WARP};
use crate::cuda_attn::case::round_to;
use crate::cuda_attn::{KernelPlan, THREADS};

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
pub(super) fn block(
    plan: &KernelPlan,
    at: (usize, usize, usize),
    (q, caches): (&[f32], &Caches<'_>),
    scale: f32,
    parts: &mut Partials,
) {
    let b = BlockView::new(plan, caches, at);
    let (d, pairs, end) = (plan.heads.head_dim, b.pairs, b.end);
    let warps = THREADS / WARP;
    let states: Vec<WarpState> = (0..warps)
        .map(|w| {
            let mut st = WarpState {
                max: vec![f32::NEG_INFINITY; pairs],
                sum: vec![0.0; pairs],
                acc: vec![0.0; pairs * d],
            };
            for j0 in (b.start + w * MMA_KEYS..end).step_by(warps * MMA_KEYS) {
                let live = |kk: usize| j0 + kk < end;
                for p in 0..pairs {
                    let qp = b.query(q, p);
                    let s: Vec<f32> = (0..MMA_KEYS)
                        .map(|kk| {
                            let j = j0 + kk;
                            if !live(kk) || !b.visible(j, p) {
                                return f32::NEG_INFINITY;
                            }
                            let k = b.row(caches.k, b.slot(j));
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
                                true => b.row(caches.v, b.slot(j0 + kk))[i],
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
        let at = b.part(p);
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
