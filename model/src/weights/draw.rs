//! Seeded random weights drawn on the host in parallel: a seed gives the same bits whatever
//! the device, the machine and the number of threads.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor, WithDType};
use rayon::prelude::*;

use super::{init_of, param_specs, Init, Weights};
use crate::config::ModelConfig;
use crate::{ModelError, Result};

/// Values per generator: each chunk of a tensor has a generator of its own, seeded from the
/// seed, the tensor's name and the chunk's index, so chunks can be drawn on any thread in
/// any order.
const CHUNK: usize = 1 << 16;

impl Weights {
    /// Normal(0, `std`) matrices, norms at 1, biases at 0, drawn straight into `dtype` on
    /// the host (rounded from f32 as a cast of the f32 draw would be) and moved to `device`
    /// a tensor at a time: off the CPU, the host holds one tensor at most.
    pub fn draw(
        cfg: &ModelConfig,
        std: f64,
        seed: u64,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let mut tensors = BTreeMap::new();
        for (name, shape) in param_specs(cfg) {
            let t = match dtype {
                DType::F32 => draw_tensor::<f32>(&name, &shape, std, seed, device)?,
                DType::BF16 => draw_tensor::<half::bf16>(&name, &shape, std, seed, device)?,
                DType::F16 => draw_tensor::<half::f16>(&name, &shape, std, seed, device)?,
                DType::F64 => draw_tensor::<f64>(&name, &shape, std, seed, device)?,
                other => {
                    return Err(ModelError::weights(
                        "random weights",
                        format!("cannot draw {other:?} weights (f32, bf16, f16 or f64)"),
                    ))
                }
            };
            tensors.insert(name, t);
        }
        Ok(Self {
            tensors,
            origin: format!("random(seed={seed})"),
            fused: BTreeMap::new(),
        })
    }
}

/// One tensor, filled on the host by rayon over chunks, then built on `device` by the
/// calling thread (device work stays on the caller's stream).
fn draw_tensor<T: Drawn>(
    name: &str,
    shape: &[usize],
    std: f64,
    seed: u64,
    device: &Device,
) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    let data: Vec<T> = match init_of(name) {
        Init::Ones => vec![T::from_f32(1.0); n],
        Init::Zeros => vec![T::from_f32(0.0); n],
        Init::Normal => {
            let mut data = vec![T::from_f32(0.0); n];
            let tensor_seed = mix(seed ^ mix(fnv1a(name.as_bytes())));
            data.par_chunks_mut(CHUNK)
                .enumerate()
                .for_each(|(i, chunk)| {
                    let mut rng = SplitMix64(mix(tensor_seed ^ mix(i as u64)));
                    fill_normal(chunk, std, &mut rng);
                });
            data
        }
    };
    Ok(Tensor::from_vec(data, shape, device)?)
}

/// A dtype weights are drawn in, reached from f32 the way a cast of f32 weights rounds
/// (half's `from_f64` rounds some values differently from its `from_f32`).
trait Drawn: WithDType {
    fn from_f32(x: f32) -> Self;
}

impl Drawn for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
}

impl Drawn for f64 {
    fn from_f32(x: f32) -> Self {
        x as f64
    }
}

impl Drawn for half::bf16 {
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
}

impl Drawn for half::f16 {
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
}

/// Fills `out` with normal(0, `std`) values (Marsaglia's polar method), each rounded to
/// f32 and then to `T`.
fn fill_normal<T: Drawn>(out: &mut [T], std: f64, rng: &mut SplitMix64) {
    let mut i = 0;
    while i < out.len() {
        let (z0, z1) = polar_pair(rng);
        for z in [z0, z1] {
            if let Some(slot) = out.get_mut(i) {
                *slot = T::from_f32((std * z) as f32);
                i += 1;
            }
        }
    }
}

/// Two independent standard normals. Only IEEE basic operations and [`ln`] are used, so
/// the result is the same on every machine (no libm whose last bits may differ).
fn polar_pair(rng: &mut SplitMix64) -> (f64, f64) {
    const SCALE: f64 = 1.0 / (1u64 << 31) as f64;
    loop {
        let bits = rng.next();
        let u = (bits >> 32) as f64 * SCALE - 1.0;
        let v = (bits & 0xffff_ffff) as f64 * SCALE - 1.0;
        let s = u * u + v * v;
        if s > 0.0 && s < 1.0 {
            let f = (-2.0 * ln(s) / s).sqrt();
            return (u * f, v * f);
        }
    }
}

/// Natural logarithm of a positive normal `x` to about 1e-16 relative: the exponent times
/// ln 2 plus an atanh series of the mantissa.
fn ln(x: f64) -> f64 {
    const MANTISSA: u64 = (1 << 52) - 1;
    let bits = x.to_bits();
    let mut exp = ((bits >> 52) & 0x7ff) as i64 - 1023;
    let mut m = f64::from_bits((bits & MANTISSA) | (1023 << 52));
    if m > std::f64::consts::SQRT_2 {
        m /= 2.0;
        exp += 1;
    }
    // ln m = 2 atanh(t), t = (m - 1) / (m + 1), |t| <= 0.172: terms up to t^21 suffice.
    let t = (m - 1.0) / (m + 1.0);
    let t2 = t * t;
    let series = (0..11)
        .rev()
        .fold(0.0, |acc, k| acc * t2 + 1.0 / (2 * k + 1) as f64);
    exp as f64 * std::f64::consts::LN_2 + 2.0 * t * series
}

/// SplitMix64: tiny, fast, and fixed here, so a seed means the same weights in every build
/// (rand's `StdRng` may change its stream between releases).
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix(self.0)
    }
}

/// SplitMix64's finaliser: a bijective scramble of 64 bits.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// FNV-1a of a tensor name (std's hasher is not stable between releases).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> ModelConfig {
        ModelConfig {
            arch: crate::Arch::Qwen2,
            vocab_size: 2100,
            hidden_size: 64,
            intermediate_size: 96,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            rope_theta: 10_000.0,
            rms_norm_eps: 1e-6,
            tie_word_embeddings: false,
            max_position_embeddings: 64,
            qkv_bias: true,
            o_bias: false,
            qk_norm: false,
            bos_token_id: None,
            eos_token_ids: vec![0],
        }
    }

    fn flat(w: &Weights) -> Vec<f32> {
        w.tensors()
            .values()
            .flat_map(|t| {
                t.to_dtype(DType::F32)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f32>()
                    .unwrap()
            })
            .collect()
    }

    #[test]
    fn ln_matches_std() {
        use std::f64::consts::{FRAC_1_SQRT_2, SQRT_2};
        for x in [
            1e-18,
            2.5e-7,
            0.1,
            0.5,
            FRAC_1_SQRT_2,
            0.99999,
            1.0,
            SQRT_2,
            7.0,
        ] {
            let (ours, std) = (ln(x), f64::ln(x));
            assert!((ours - std).abs() <= 1e-15 * std.abs().max(1.0), "{x}");
        }
    }

    #[test]
    fn normal_moments_and_fills() {
        let w = Weights::draw(&small(), 0.02, 3, DType::F32, &Device::Cpu).unwrap();
        let emb = flat(&Weights {
            tensors: BTreeMap::from([(
                "e".to_string(),
                w.get("model.embed_tokens.weight", &[2100, 64]).unwrap(),
            )]),
            origin: String::new(),
            fused: BTreeMap::new(),
        });
        let n = emb.len() as f64;
        let mean = emb.iter().map(|&x| x as f64).sum::<f64>() / n;
        let var = emb.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / n;
        assert!(
            mean.abs() < 1e-3 && (var.sqrt() - 0.02).abs() < 1e-3,
            "{mean} {var}"
        );
        let norm = w.get("model.norm.weight", &[64]).unwrap();
        assert_eq!(norm.to_vec1::<f32>().unwrap(), vec![1.0; 64]);
        let bias = w
            .get("model.layers.0.self_attn.q_proj.bias", &[64])
            .unwrap();
        assert_eq!(bias.to_vec1::<f32>().unwrap(), vec![0.0; 64]);
    }

    #[test]
    fn same_seed_same_bits_other_seed_differs() {
        let draw =
            |seed| flat(&Weights::draw(&small(), 0.02, seed, DType::F32, &Device::Cpu).unwrap());
        let a = draw(7);
        assert_eq!(
            a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            draw(7).iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        let b = draw(8);
        assert!(a.iter().zip(&b).filter(|(x, y)| x != y).count() > a.len() / 2);
    }

    #[test]
    fn half_precision_is_the_rounded_f32_draw() {
        let f32s = Weights::draw(&small(), 0.02, 1, DType::F32, &Device::Cpu).unwrap();
        for dtype in [DType::BF16, DType::F16] {
            let half = Weights::draw(&small(), 0.02, 1, dtype, &Device::Cpu).unwrap();
            let (ours, cast) = (flat(&half), flat(&f32s.to_dtype(dtype).unwrap()));
            let differ = ours
                .iter()
                .zip(&cast)
                .position(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(
                differ,
                None,
                "{dtype:?}: {:?}",
                differ.map(|i| (ours[i], cast[i]))
            );
        }
    }

    #[test]
    fn independent_of_thread_count() {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(1)
            .build()
            .unwrap();
        let one = pool.install(|| Weights::draw(&small(), 0.02, 5, DType::F32, &Device::Cpu));
        let many = Weights::draw(&small(), 0.02, 5, DType::F32, &Device::Cpu).unwrap();
        assert_eq!(flat(&one.unwrap()), flat(&many));
    }
}
