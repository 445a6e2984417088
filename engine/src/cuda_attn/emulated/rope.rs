//! `qkv_rope` of kernels/qkv_rope.cu run on the CPU: held bit for bit to a twin of its
//! arithmetic in f32, bf16 and f16, and in f32 to the model's own bias add, split and
//! rotation (the ops it replaces with `engine.rope_kernel`); with the pools
//! (`engine.rope_writes_kv`), k and v in their slots as the segments hold them.

use candle_core::{DType, Device, Tensor};
use dppo_model::rope::Rope;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{qkv_rope, Norms, RopeExtras, Stored};
use crate::cuda_attn::twin::butterfly_sum;
use crate::cuda_attn::{Heads, KernelPlan, CHUNK};

/// A plan of `rows` decoding rows of `heads`, in slots 0, 1, ... (all `qkv_rope` reads of
/// one).
fn plan(heads: Heads, rows: usize) -> KernelPlan {
    KernelPlan {
        heads,
        block_size: 16,
        tiles: Vec::new(),
        table_width: 1,
        slots: (0..rows as u32).collect(),
        rows,
        splits: 1,
        split_len: CHUNK,
        max_pairs: heads.group(),
    }
}

/// The kernel's arithmetic: the bias added and rounded to `T`; with `norms` each q and k
/// head's RMSNorm (the squares summed by 32 lanes in order, then by a warp's butterfly), the
/// normed values rounded to `T`; the rotation in f32 from the rounded values, rounded once;
/// q, k and v as three segments.
fn twin<T: Stored>(
    heads: Heads,
    rows: usize,
    qkv: &[T],
    (bias, norms): (Option<&[T]>, Option<Norms<'_, T>>),
    (cos, sin): (&[T], &[T]),
) -> Vec<T> {
    let (d, half) = (heads.head_dim, heads.head_dim / 2);
    let (q_dim, kv_dim) = (heads.num_heads * d, heads.num_kv_heads * d);
    let width = q_dim + 2 * kv_dim;
    let biased = |t: usize, col: usize| {
        let x = qkv[t * width + col].value();
        bias.map_or(x, |b| T::of(x + b[col].value()).value())
    };
    let mut out = vec![T::of(f32::NAN); rows * width];
    for t in 0..rows {
        for h in 0..heads.num_heads + heads.num_kv_heads {
            let (dst, base) = match h < heads.num_heads {
                true => (t * q_dim + h * d, h * d),
                false => (rows * q_dim + t * kv_dim + (h - heads.num_heads) * d, h * d),
            };
            // The head's RMSNorm scale and weight, where it has a norm.
            let norm = norms.map(|([q, k], eps)| {
                let mut lanes = [0f32; 32];
                for (lane, sum) in lanes.iter_mut().enumerate() {
                    for j in (lane..half).step_by(32) {
                        let (x1, x2) = (biased(t, base + j), biased(t, base + j + half));
                        *sum += x1 * x1;
                        *sum += x2 * x2;
                    }
                }
                let scale = 1.0 / (butterfly_sum(lanes) / d as f32 + eps).sqrt();
                (scale, if h < heads.num_heads { q } else { k })
            });
            let normed = |x: f32, j: usize| {
                norm.map_or(x, |(scale, w)| T::of(x * scale * w[j].value()).value())
            };
            for j in 0..half {
                let x1 = normed(biased(t, base + j), j);
                let x2 = normed(biased(t, base + j + half), j + half);
                let (c, s) = (cos[t * half + j].value(), sin[t * half + j].value());
                out[dst + j] = T::of(x1 * c - x2 * s);
                out[dst + j + half] = T::of(x2 * c + x1 * s);
            }
        }
        for e in 0..kv_dim {
            let col = q_dim + kv_dim + e;
            let v = qkv[t * width + col].value();
            let v = bias.map_or(v, |b| v + b[col].value());
            out[rows * (q_dim + kv_dim) + t * kv_dim + e] = T::of(v);
        }
    }
    out
}

/// A projection of `rows` rows of `heads`, a bias and the angles of random positions.
struct Inputs {
    qkv: Vec<f32>,
    bias: Vec<f32>,
    positions: Vec<u32>,
}

impl Inputs {
    fn new(rng: &mut StdRng, heads: Heads, rows: usize) -> Self {
        let width = (heads.num_heads + 2 * heads.num_kv_heads) * heads.head_dim;
        let mut values = |n: usize| (0..n).map(|_| rng.random_range(-2.0..2.0)).collect();
        Self {
            qkv: values(rows * width),
            bias: values(width),
            positions: (0..rows).map(|_| rng.random_range(0..500)).collect(),
        }
    }

    /// cos and sin at the positions, in `dtype`, as the model's forward pass makes them.
    fn angles(&self, head_dim: usize, dtype: DType) -> (Vec<f32>, Vec<f32>) {
        let rope = Rope::new(head_dim, 1_000_000.0, 512, &Device::Cpu).unwrap();
        let positions = Tensor::new(self.positions.as_slice(), &Device::Cpu).unwrap();
        let (cos, sin) = rope.at(&positions).unwrap().tables(dtype).unwrap();
        let host = |t: Tensor| {
            t.to_dtype(DType::F32)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        (host(cos), host(sin))
    }
}

fn stored<T: Stored>(xs: &[f32]) -> Vec<T> {
    xs.iter().map(|&x| T::of(x)).collect()
}

/// Random [`Inputs`] stored in `T`: `group` query heads a KV head (2 KV heads) of
/// `head_dim`, `rows` rows; the projection, its bias and the angles.
struct StoredInputs<T> {
    heads: Heads,
    qkv: Vec<T>,
    bias: Vec<T>,
    cos: Vec<T>,
    sin: Vec<T>,
}

impl<T: Stored> StoredInputs<T> {
    fn new(rng: &mut StdRng, (group, head_dim, rows): (usize, usize, usize), dtype: DType) -> Self {
        let heads = Heads {
            num_heads: 2 * group,
            num_kv_heads: 2,
            head_dim,
        };
        let inputs = Inputs::new(rng, heads, rows);
        let (cos, sin) = inputs.angles(head_dim, dtype);
        Self {
            heads,
            qkv: stored(&inputs.qkv),
            bias: stored(&inputs.bias),
            cos: stored(&cos),
            sin: stored(&sin),
        }
    }
}

/// Norm weights (head_dim each, around 1) for q and k.
fn norm_weights(rng: &mut StdRng, head_dim: usize) -> [Vec<f32>; 2] {
    [(); 2].map(|_| (0..head_dim).map(|_| rng.random_range(0.5..1.5)).collect())
}

/// The kernel against its twin in `T`, with and without a bias and q/k norms, on GQA 1, 3
/// and 7 (head_dim 32, a warp's lanes half idle in the norms, 64 and 128).
fn check<T: Stored>(dtype: DType) {
    let mut rng = StdRng::seed_from_u64(31);
    for (group, head_dim, rows) in [(1, 64, 3), (3, 32, 5), (7, 128, 4)] {
        let StoredInputs::<T> {
            heads,
            qkv,
            bias,
            cos,
            sin,
        } = StoredInputs::new(&mut rng, (group, head_dim, rows), dtype);
        let [qn, kn] = norm_weights(&mut rng, head_dim).map(|w| stored::<T>(&w));
        let norms = ([qn.as_slice(), kn.as_slice()], 1e-6);
        for (bias, norms) in [
            (None, None),
            (Some(bias.as_slice()), None),
            (None, Some(norms)),
            (Some(bias.as_slice()), Some(norms)),
        ] {
            let plan = plan(heads, rows);
            let extras = RopeExtras {
                bias,
                norms,
                pools: None,
            };
            let got = qkv_rope(&plan, &qkv, (&cos, &sin), extras).unwrap();
            let want = twin(heads, rows, &qkv, (bias, norms), (&cos, &sin));
            let differ = got
                .iter()
                .zip(&want)
                .filter(|(g, w)| g.bits() != w.bits())
                .count();
            assert_eq!(
                differ,
                0,
                "{dtype:?}, group {group}, bias {}, norms {}",
                bias.is_some(),
                norms.is_some()
            );
        }
    }
}

/// With the pools, `qkv_rope` writes the segments' q out and their k and v rows into the
/// plan's slots of the K and V pools, bit for bit, and leaves every other slot as it was.
fn check_pools<T: Stored>(dtype: DType) {
    let mut rng = StdRng::seed_from_u64(33);
    for (group, head_dim, rows) in [(1, 64, 3), (7, 128, 5)] {
        let StoredInputs::<T> {
            heads,
            qkv,
            bias,
            cos,
            sin,
        } = StoredInputs::new(&mut rng, (group, head_dim, rows), dtype);
        let mut plan = plan(heads, rows);
        // Scattered over a pool of 16 slots, none at 0.
        plan.slots = (0..rows as u32).map(|r| 15 - 3 * r).collect();
        let extras = |pools| RopeExtras {
            bias: Some(&bias),
            norms: None,
            pools,
        };
        let segments = qkv_rope(&plan, &qkv, (&cos, &sin), extras(None)).unwrap();
        let kv_row = heads.num_kv_heads * head_dim;
        let sentinel = |i: usize| T::of(i as f32 * 0.5 - 7.0);
        let fresh = || (0..16 * kv_row).map(sentinel).collect::<Vec<T>>();
        let (mut k_pool, mut v_pool) = (fresh(), fresh());
        let pools = Some([k_pool.as_mut_slice(), v_pool.as_mut_slice()]);
        let q = qkv_rope(&plan, &qkv, (&cos, &sin), extras(pools)).unwrap();

        let bits = |xs: &[T]| xs.iter().map(|x| x.bits()).collect::<Vec<_>>();
        let q_len = rows * heads.num_heads * head_dim;
        assert_eq!(bits(&q), bits(&segments[..q_len]), "{dtype:?}: q");
        for (name, pool, start) in [("k", &k_pool, q_len), ("v", &v_pool, q_len + rows * kv_row)] {
            let mut want = fresh();
            for (r, &slot) in plan.slots.iter().enumerate() {
                let row = &segments[start + r * kv_row..start + (r + 1) * kv_row];
                want[slot as usize * kv_row..][..kv_row].copy_from_slice(row);
            }
            assert_eq!(bits(pool), bits(&want), "{dtype:?}, group {group}: {name}");
        }
    }
}

#[test]
fn qkv_rope_into_the_pools_writes_the_segments_rows_into_their_slots() {
    check_pools::<f32>(DType::F32);
    check_pools::<half::bf16>(DType::BF16);
    check_pools::<half::f16>(DType::F16);
}

#[test]
fn qkv_rope_computes_what_its_twin_computes_bit_for_bit() {
    check::<f32>(DType::F32);
    check::<half::bf16>(DType::BF16);
    check::<half::f16>(DType::F16);
}

/// In f32 the kernel gives exactly what the model's ops give: the bias added to the
/// projection, q, k and v split off, q and k rotated. With q/k norms it gives the model's
/// RMSNorm of each head before the rotation within 1e-5 (the norm's squares summed in
/// another order).
#[test]
fn qkv_rope_in_f32_is_the_models_bias_split_norms_and_rotation() {
    let mut rng = StdRng::seed_from_u64(32);
    let heads = Heads {
        num_heads: 6,
        num_kv_heads: 2,
        head_dim: 64,
    };
    let rows = 5;
    let inputs = Inputs::new(&mut rng, heads, rows);
    let (cos, sin) = inputs.angles(heads.head_dim, DType::F32);
    let weights = norm_weights(&mut rng, heads.head_dim);
    let eps = 1e-6;
    for with_norms in [false, true] {
        let norms = with_norms.then_some(([weights[0].as_slice(), weights[1].as_slice()], eps));
        let extras = RopeExtras {
            bias: Some(&inputs.bias),
            norms,
            pools: None,
        };
        let got = qkv_rope(&plan(heads, rows), &inputs.qkv, (&cos, &sin), extras).unwrap();
        let want = models_ops(heads, &inputs, (&cos, &sin), norms.map(|_| (&weights, eps)));
        let worst = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs())
            .fold(0f32, f32::max);
        let bound = if with_norms { 1e-5 } else { 0.0 };
        assert!(worst <= bound, "norms {with_norms}: {worst} apart");
    }
}

/// The model's ops on `inputs` in f32: bias, split, the q/k norms where given, rotation; q, k
/// and v as three segments.
fn models_ops(
    heads: Heads,
    inputs: &Inputs,
    (cos, sin): (&[f32], &[f32]),
    norms: Option<(&[Vec<f32>; 2], f32)>,
) -> Vec<f32> {
    let dev = &Device::Cpu;
    let rows = inputs.positions.len();
    let width = inputs.bias.len();
    let y = Tensor::from_slice(&inputs.qkv, (rows, width), dev).unwrap();
    let y = y
        .broadcast_add(&Tensor::new(inputs.bias.as_slice(), dev).unwrap())
        .unwrap();
    let angles = |x: &[f32]| Tensor::from_slice(x, (rows, heads.head_dim / 2), dev).unwrap();
    let (cos, sin) = (angles(cos), angles(sin));
    let d = heads.head_dim;
    let (q_dim, kv_dim) = (heads.num_heads * d, heads.num_kv_heads * d);
    let part = |start: usize, len: usize, n: usize| {
        y.narrow(1, start, len)
            .unwrap()
            .reshape((rows, n, d))
            .unwrap()
    };
    let q = part(0, q_dim, heads.num_heads);
    let k = part(q_dim, kv_dim, heads.num_kv_heads);
    let v = part(q_dim + kv_dim, kv_dim, heads.num_kv_heads);
    let (q, k) = match norms {
        Some(([qn, kn], eps)) => {
            let norm = |x: &Tensor, w: &[f32]| {
                let w = Tensor::new(w, dev).unwrap();
                dppo_model::fused::rms_norm(x, &w, eps as f64).unwrap()
            };
            (norm(&q, qn), norm(&k, kn))
        }
        None => (q, k),
    };
    let rotate = |x: &Tensor| dppo_model::fused::rope(x, &cos, &sin).unwrap();
    [rotate(&q), rotate(&k), v]
        .iter()
        .flat_map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect()
}
