//! AdamW with decoupled weight decay (not on norms and biases), global-norm gradient
//! clipping, and the learning-rate schedule.

use std::collections::BTreeMap;

use candle_core::{Result, Tensor, Var};
use serde::{Deserialize, Serialize};

mod in_place;

/// AdamW hyper-parameters (PyTorch names and defaults, `lr` aside).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct AdamWConfig {
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        Self {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

/// Whether weight decay applies to the parameter `name` (not to norms and biases).
pub fn decays(name: &str) -> bool {
    !(name.contains("norm") || name.ends_with(".bias"))
}

/// AdamW state: first and second moments per parameter, and the step count.
#[derive(Debug, Default)]
pub struct AdamW {
    pub cfg: AdamWConfig,
    pub step: u64,
    pub moments: BTreeMap<String, (Tensor, Tensor)>,
}

impl AdamW {
    /// Fresh state.
    pub fn new(cfg: AdamWConfig) -> Self {
        Self {
            cfg,
            step: 0,
            moments: BTreeMap::new(),
        }
    }

    /// One update of every var that has a gradient, at learning rate `lr`:
    /// `theta *= 1 - lr * wd` (decoupled, decaying params only), then
    /// `theta -= lr * m_hat / (sqrt(v_hat) + eps)`. f32 CPU tensors are updated in place;
    /// the moments must not share storage with other tensors (they never leave the state
    /// but as copies written to checkpoints).
    pub fn step(
        &mut self,
        vars: &BTreeMap<String, Var>,
        grads: &BTreeMap<String, Tensor>,
        lr: f64,
    ) -> Result<()> {
        self.step += 1;
        let c = self.cfg;
        let bias1 = 1.0 - c.beta1.powi(self.step as i32);
        let bias2 = 1.0 - c.beta2.powi(self.step as i32);
        for (name, var) in vars {
            let Some(g) = grads.get(name) else { continue };
            let (m, v) = match self.moments.remove(name) {
                Some(mv) => mv,
                None => (g.zeros_like()?, g.zeros_like()?),
            };
            let decay = if decays(name) {
                1.0 - lr * c.weight_decay
            } else {
                1.0
            };
            let theta = var.as_tensor();
            let update = in_place::Update {
                beta1: c.beta1,
                beta2: c.beta2,
                eps: c.eps,
                lr,
                decay,
                bias1,
                bias2,
            };
            let (m, v) = if in_place::applies(&[theta, &m, &v, g]) {
                in_place::step(theta, &m, &v, g, update)?;
                (m, v)
            } else {
                tensor_op_step(var, m, v, g, update)?
            };
            self.moments.insert(name.clone(), (m, v));
        }
        Ok(())
    }
}

/// One AdamW update from tensor ops, on any device and dtype: the generic path beside the
/// in-place f32 CPU one; returns the new moments and writes the parameter through
/// `Var::set` (its storage stays where it is).
fn tensor_op_step(
    var: &Var,
    m: Tensor,
    v: Tensor,
    g: &Tensor,
    u: in_place::Update,
) -> Result<(Tensor, Tensor)> {
    let m = ((m * u.beta1)? + (g * (1.0 - u.beta1))?)?;
    let v = ((v * u.beta2)? + (g.sqr()? * (1.0 - u.beta2))?)?;
    let update = ((&m / u.bias1)? / ((&v / u.bias2)?.sqrt()? + u.eps)?)?;
    var.set(&((var.as_tensor() * u.decay)? - (update * u.lr)?)?)?;
    Ok((m, v))
}

/// The squared global L2 norm of `grads`, accumulated in f64.
pub fn squared_norm(grads: &BTreeMap<String, Tensor>) -> Result<f64> {
    let mut sq = 0f64;
    for g in grads.values() {
        sq += g
            .sqr()?
            .sum_all()?
            .to_dtype(candle_core::DType::F64)?
            .to_scalar::<f64>()?;
    }
    Ok(sq)
}

/// Scales `grads` so their global L2 norm is at most `max_norm`; returns the norm before.
pub fn clip_grad_norm(grads: &mut BTreeMap<String, Tensor>, max_norm: f64) -> Result<f64> {
    let norm = squared_norm(grads)?.sqrt();
    if norm > max_norm && max_norm > 0.0 {
        let scale = max_norm / (norm + 1e-6);
        for g in grads.values_mut() {
            *g = (&*g * scale)?;
        }
    }
    Ok(norm)
}

/// Learning-rate schedule: linear warm-up, then constant or cosine decay to `min_lr`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LrSchedule {
    pub lr: f64,
    pub warmup_steps: u64,
    /// Cosine decay over `total_steps` when set; constant otherwise.
    pub cosine_total_steps: Option<u64>,
    pub min_lr: f64,
}

impl LrSchedule {
    /// The learning rate of optimizer step `step` (0-based).
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        match self.cosine_total_steps {
            Some(total) if total > self.warmup_steps => {
                let t = (step - self.warmup_steps) as f64 / (total - self.warmup_steps) as f64;
                let cos = 0.5 * (1.0 + (std::f64::consts::PI * t.min(1.0)).cos());
                self.min_lr + (self.lr - self.min_lr) * cos
            }
            _ => self.lr,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn one_clipped_adamw_step_matches_a_hand_computation() {
        let dev = Device::Cpu;
        let w = Var::new(&[1.0f64, -2.0, 0.5], &dev).unwrap();
        let b = Var::new(&[0.3f64], &dev).unwrap();
        let vars = BTreeMap::from([
            ("w".to_string(), w.clone()),
            ("x.bias".to_string(), b.clone()),
        ]);
        let mut grads = BTreeMap::from([
            (
                "w".to_string(),
                Tensor::new(&[3.0f64, 0.0, -4.0], &dev).unwrap(),
            ),
            ("x.bias".to_string(), Tensor::new(&[12.0f64], &dev).unwrap()),
        ]);
        // Global norm sqrt(9 + 16 + 144) = 13, clipped to 1.3: every gradient scaled by ~0.1.
        let norm = clip_grad_norm(&mut grads, 1.3).unwrap();
        assert!((norm - 13.0).abs() < 1e-12);
        let cfg = AdamWConfig {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.1,
        };
        let mut opt = AdamW::new(cfg);
        let lr = 0.01;
        opt.step(&vars, &grads, lr).unwrap();
        // Step 1: m_hat = g, v_hat = g^2, so the update is g / (|g| + eps) = sign(g) (0 for g = 0).
        let scale = 1.3 / (13.0 + 1e-6);
        let expect = |theta: f64, g: f64, decay: bool| {
            let g = g * scale;
            let theta = if decay {
                theta * (1.0 - lr * 0.1)
            } else {
                theta
            };
            theta - lr * g / ((g * g).sqrt() + 1e-8)
        };
        let got = w.as_tensor().to_vec1::<f64>().unwrap();
        let want = [
            expect(1.0, 3.0, true),
            expect(-2.0, 0.0, true),
            expect(0.5, -4.0, true),
        ];
        for (g, w) in got.iter().zip(want) {
            assert!((g - w).abs() < 1e-12, "{g} vs {w}");
        }
        let got_b = b.as_tensor().to_vec1::<f64>().unwrap()[0];
        assert!(
            (got_b - expect(0.3, 12.0, false)).abs() < 1e-12,
            "biases are not decayed"
        );
    }

    #[test]
    fn the_in_place_f32_update_follows_the_f64_tensor_op_update() {
        use rand::{Rng, SeedableRng};
        let dev = Device::Cpu;
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        // Longer than one parallel chunk, so several chunks run.
        let n = 70_001;
        let theta: Vec<f64> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
        let grads: Vec<Vec<f64>> = (0..3)
            .map(|_| (0..n).map(|_| rng.random_range(-1.0..1.0)).collect())
            .collect();
        let run = |dtype: candle_core::DType| {
            let init = Tensor::new(theta.as_slice(), &dev).unwrap();
            let w = Var::from_tensor(&init.to_dtype(dtype).unwrap()).unwrap();
            let vars = BTreeMap::from([("w".to_string(), w.clone())]);
            let mut opt = AdamW::new(AdamWConfig::default());
            for g in &grads {
                let g = Tensor::new(g.as_slice(), &dev).unwrap();
                let grads = BTreeMap::from([("w".to_string(), g.to_dtype(dtype).unwrap())]);
                opt.step(&vars, &grads, 0.01).unwrap();
            }
            let f64s = |t: &Tensor| {
                t.to_dtype(candle_core::DType::F64)
                    .unwrap()
                    .to_vec1::<f64>()
            };
            let (m, v) = &opt.moments["w"];
            [w.as_tensor(), m, v].map(|t| f64s(t).unwrap())
        };
        let (fast, reference) = (run(candle_core::DType::F32), run(candle_core::DType::F64));
        for (what, (a, b)) in ["theta", "m", "v"].iter().zip(fast.iter().zip(&reference)) {
            for (i, (a, b)) in a.iter().zip(b).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                    "{what}[{i}]: {a} vs {b}"
                );
            }
        }
        // The updates moved the parameters by far more than the tolerance above.
        let moved: f64 = fast[0].iter().zip(&theta).map(|(a, b)| (a - b).abs()).sum();
        assert!(moved / n as f64 > 1e-3, "mean move {}", moved / n as f64);
    }

    /// The generic tensor-op update, run on f32 CPU tensors, follows the in-place f32 CPU
    /// update through three steps within 1e-6 (parameters and both moments).
    #[test]
    fn the_tensor_op_update_follows_the_in_place_one_for_three_steps() {
        use rand::{Rng, SeedableRng};
        let dev = Device::Cpu;
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let n = 40_000;
        let mut random = || -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
        let theta = random();
        let grads: Vec<Vec<f32>> = (0..3).map(|_| random()).collect();
        let cfg = AdamWConfig::default();
        let var = |t: &[f32]| Var::from_vec(t.to_vec(), n, &dev).unwrap();
        let (fast, generic) = (var(&theta), var(&theta));
        let zeros = || Tensor::zeros(n, candle_core::DType::F32, &dev).unwrap();
        let (fm, fv) = (zeros(), zeros());
        let (mut gm, mut gv) = (zeros(), zeros());
        for (t, g) in grads.iter().enumerate() {
            let step = t as i32 + 1;
            let u = in_place::Update {
                beta1: cfg.beta1,
                beta2: cfg.beta2,
                eps: cfg.eps,
                lr: 0.01,
                decay: 1.0 - 0.01 * cfg.weight_decay,
                bias1: 1.0 - cfg.beta1.powi(step),
                bias2: 1.0 - cfg.beta2.powi(step),
            };
            let g = Tensor::from_vec(g.clone(), n, &dev).unwrap();
            in_place::step(fast.as_tensor(), &fm, &fv, &g, u).unwrap();
            (gm, gv) = tensor_op_step(&generic, gm, gv, &g, u).unwrap();
        }
        let vec = |t: &Tensor| t.to_vec1::<f32>().unwrap();
        for (what, a, b) in [
            ("theta", fast.as_tensor(), generic.as_tensor()),
            ("m", &fm, &gm),
            ("v", &fv, &gv),
        ] {
            for (i, (a, b)) in vec(a).iter().zip(vec(b)).enumerate() {
                assert!((a - b).abs() <= 1e-6, "{what}[{i}]: {a} vs {b}");
            }
        }
        let moved: f32 = vec(fast.as_tensor())
            .iter()
            .zip(&theta)
            .map(|(a, b)| (a - b).abs())
            .sum();
        assert!(moved / n as f32 > 1e-3, "the updates moved the parameters");
    }

    #[test]
    fn schedules() {
        let constant = LrSchedule {
            lr: 1.0,
            warmup_steps: 4,
            cosine_total_steps: None,
            min_lr: 0.0,
        };
        assert_eq!(constant.lr_at(0), 0.25);
        assert_eq!(constant.lr_at(3), 1.0);
        assert_eq!(constant.lr_at(100), 1.0);
        let cosine = LrSchedule {
            cosine_total_steps: Some(14),
            min_lr: 0.1,
            ..constant
        };
        assert!((cosine.lr_at(4) - 1.0).abs() < 1e-12);
        assert!((cosine.lr_at(9) - 0.55).abs() < 1e-12);
        assert!((cosine.lr_at(14) - 0.1).abs() < 1e-12);
    }
}
