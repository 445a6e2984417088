//! The learner: trainable parameters, packed forward/backward of every buffer with the
//! gradients accumulated into one AdamW step.

use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::{DType, Tensor, Var};
use dppo_model::{CausalLm, ModelConfig, Weights};

use crate::loss::{buffer_loss, buffer_nll, LossConfig, TrainSeq};
use crate::optim::{clip_grad_norm, AdamW, AdamWConfig, LrSchedule};
use crate::pack::pack;
use crate::train_batch::TrainBatch;
use crate::TrainError;

/// Learner settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LearnerConfig {
    pub loss: LossConfig,
    pub adamw: AdamWConfig,
    pub schedule: LrSchedule,
    /// Global-norm clip (`grad_clip`); 0 disables.
    pub grad_clip: f64,
    /// Tokens per packed buffer (`pack_tokens`).
    pub pack_tokens: usize,
    /// Sequences per first-fit-decreasing window (`pack_window`).
    pub pack_window: usize,
    /// Dtype of the forward and backward passes (`train.compute_dtype`); the master
    /// weights, their gradients and the optimizer state stay f32 whatever it is.
    pub compute_dtype: DType,
}

impl LearnerConfig {
    /// The built-in default's objective (clip range 0.2 / 0.28, `token-mean`, token-level
    /// ratio, no KL term) with default AdamW at the constant learning rate `lr`: the learner
    /// of `dppo bench train`, the learner benchmark and the tests.
    pub fn token_mean(lr: f64, grad_clip: f64, pack_tokens: usize, pack_window: usize) -> Self {
        Self {
            loss: LossConfig {
                eps_low: 0.2,
                eps_high: 0.28,
                loss_agg: crate::loss::LossAgg::TokenMean,
                ratio_level: crate::loss::RatioLevel::Token,
                beta: 0.0,
            },
            adamw: AdamWConfig::default(),
            schedule: LrSchedule {
                lr,
                warmup_steps: 0,
                cosine_total_steps: None,
                min_lr: 0.0,
            },
            grad_clip,
            pack_tokens,
            pack_window,
            compute_dtype: DType::F32,
        }
    }
}

/// What one optimizer step reports (`actor/*`, `pack/*`, `perf/train_tokens_per_s`).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepMetrics {
    pub pg_loss: f64,
    pub grad_norm: f64,
    pub clipfrac: f64,
    pub entropy: f64,
    pub lr: f64,
    pub num_buffers: usize,
    pub pack_density: f64,
    pub train_tokens_per_s: f64,
    /// The loss or the gradient norm was NaN or infinite: the step changed nothing.
    pub is_nonfinite: bool,
}

/// A frozen policy for the KL term: its own copy of the weights and the model over them.
pub struct Reference {
    pub weights: Weights,
    pub model: CausalLm,
}

impl Reference {
    /// A frozen copy of `weights` (kept as given: checkpoints save it), its model reading
    /// a cast to `compute_dtype`.
    fn new(
        config: &ModelConfig,
        weights: &Weights,
        compute_dtype: DType,
    ) -> Result<Self, TrainError> {
        let weights = weights.deep_copy()?;
        let model = CausalLm::new(config, &weights.to_dtype(compute_dtype)?)?;
        Ok(Self { weights, model })
    }
}

/// Stack for the backward pass: candle's graph walk recurses once per op.
const BACKWARD_STACK: usize = 512 << 20;

/// Trainable f32 master weights, the model reading them, the optimizer, and (when the KL
/// term is on) a frozen copy of the initial policy as reference.
pub struct Learner {
    pub cfg: LearnerConfig,
    pub vars: BTreeMap<String, Var>,
    pub model: CausalLm,
    pub reference: Option<Reference>,
    pub optimizer: AdamW,
}

impl Learner {
    /// A learner over copies of `weights`.
    pub fn new(
        config: &ModelConfig,
        weights: &Weights,
        cfg: LearnerConfig,
    ) -> Result<Self, TrainError> {
        let (vars, trainable) = weights.to_vars()?;
        let model = CausalLm::new(config, &trainable)?;
        let reference = if cfg.loss.beta > 0.0 {
            Some(Reference::new(config, weights, cfg.compute_dtype)?)
        } else {
            None
        };
        Ok(Self {
            cfg,
            vars,
            model,
            reference,
            optimizer: AdamW::new(cfg.adamw),
        })
    }

    /// Makes `weights` the KL reference (e.g. the policy after supervised warm-up, or the
    /// reference saved in a checkpoint). No-op when the KL term is off.
    pub fn set_reference(&mut self, weights: &Weights) -> Result<(), TrainError> {
        if self.reference.is_some() {
            self.reference = Some(Reference::new(
                self.model.config(),
                weights,
                self.cfg.compute_dtype,
            )?);
        }
        Ok(())
    }

    /// The current weights (sharing the vars' storage: read them between steps only).
    pub fn weights(&self) -> Result<Weights, TrainError> {
        let tensors = self
            .vars
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().detach()))
            .collect();
        Ok(Weights::from_tensors(
            self.model.config(),
            tensors,
            "learner",
        )?)
    }

    /// The model the forward and backward passes run: over the f32 masters themselves, or
    /// over their cast to the compute dtype (a differentiable cast: the gradients reach the
    /// masters in f32). The embedding and the LM head stay f32, as under PyTorch's autocast:
    /// an embedding gradient summed in bf16 over repeated tokens loses most of its bits.
    fn compute_model(&self) -> Result<CausalLm, TrainError> {
        if self.cfg.compute_dtype == DType::F32 {
            return Ok(self.model.clone());
        }
        let tensors = self
            .vars
            .iter()
            .map(|(n, v)| {
                let t = v.as_tensor();
                let wide = n == "model.embed_tokens.weight" || n == "lm_head.weight";
                Ok((
                    n.clone(),
                    if wide {
                        t.clone()
                    } else {
                        t.to_dtype(self.cfg.compute_dtype)?
                    },
                ))
            })
            .collect::<candle_core::Result<_>>()?;
        let config = self.model.config();
        Ok(CausalLm::new(
            config,
            &Weights::from_tensors(config, tensors, "learner")?,
        )?)
    }

    /// Gradients of the batch loss, summed over packed buffers, plus metric sums.
    pub fn gradients(
        &self,
        batch: &TrainBatch,
    ) -> Result<(BTreeMap<String, Tensor>, StepMetrics), TrainError> {
        std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("dppo-backward".into())
                .stack_size(BACKWARD_STACK)
                .spawn_scoped(scope, || self.accumulate(batch))
                .map_err(|e| TrainError::Thread(e.to_string()))?
                .join()
                .map_err(|_| TrainError::Thread("the backward thread panicked".into()))?
        })
    }

    fn accumulate(
        &self,
        batch: &TrainBatch,
    ) -> Result<(BTreeMap<String, Tensor>, StepMetrics), TrainError> {
        let start = Instant::now();
        let lengths: Vec<usize> = batch.seqs.iter().map(|s| s.tokens.len()).collect();
        let buffers = pack(&lengths, self.cfg.pack_tokens, self.cfg.pack_window)?;
        let mut grads: BTreeMap<String, Tensor> = BTreeMap::new();
        let mut m = StepMetrics::default();
        let (mut tokens, mut clipped) = (0usize, 0usize);
        let model = self.compute_model()?;
        for buffer in &buffers {
            let seqs: Vec<&TrainSeq> = buffer.iter().map(|&i| &batch.seqs[i]).collect();
            let out = buffer_loss(
                &model,
                self.reference.as_ref().map(|r| &r.model),
                &seqs,
                &self.cfg.loss,
                &batch.norm,
            )?;
            m.pg_loss += out
                .loss
                .to_dtype(candle_core::DType::F64)?
                .to_scalar::<f64>()?;
            tokens += out.num_tokens;
            clipped += out.num_clipped;
            m.entropy += out.entropy_sum;
            accumulate(&mut grads, &self.vars, &out.loss.backward()?)?;
        }
        m.num_buffers = buffers.len();
        m.pack_density = crate::pack::density(&lengths, buffers.len(), self.cfg.pack_tokens);
        m.clipfrac = clipped as f64 / tokens.max(1) as f64;
        m.entropy /= tokens.max(1) as f64;
        m.train_tokens_per_s = lengths.iter().sum::<usize>() as f64 / start.elapsed().as_secs_f64();
        Ok((grads, m))
    }

    /// One supervised step on demonstrations (mean NLL of their completion tokens) at
    /// learning rate `lr`: `pg_loss` holds the NLL. Shares the optimizer with RL steps, and
    /// skips the update as [`Learner::step`] does when the loss or gradient is not finite.
    pub fn sft_step(&mut self, seqs: &[TrainSeq], lr: f64) -> Result<StepMetrics, TrainError> {
        let lengths: Vec<usize> = seqs.iter().map(|s| s.tokens.len()).collect();
        let buffers = pack(&lengths, self.cfg.pack_tokens, self.cfg.pack_window)?;
        let num_tokens: usize = seqs.iter().map(TrainSeq::num_completion_tokens).sum();
        let run = || -> Result<(BTreeMap<String, Tensor>, f64), TrainError> {
            let mut grads: BTreeMap<String, Tensor> = BTreeMap::new();
            let mut total = 0.0;
            let model = self.compute_model()?;
            for buffer in &buffers {
                let refs: Vec<&TrainSeq> = buffer.iter().map(|&i| &seqs[i]).collect();
                let loss = (buffer_nll(&model, &refs)? / num_tokens.max(1) as f64)?;
                total += loss.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
                accumulate(&mut grads, &self.vars, &loss.backward()?)?;
            }
            Ok((grads, total))
        };
        let (mut grads, loss) = std::thread::scope(|scope| {
            std::thread::Builder::new()
                .stack_size(BACKWARD_STACK)
                .spawn_scoped(scope, run)
                .map_err(|e| TrainError::Thread(e.to_string()))?
                .join()
                .map_err(|_| TrainError::Thread("the backward thread panicked".into()))?
        })?;
        let m = StepMetrics {
            pg_loss: loss,
            grad_norm: clip_grad_norm(&mut grads, self.cfg.grad_clip)?,
            lr,
            num_buffers: buffers.len(),
            ..StepMetrics::default()
        };
        self.apply(&grads, m)
    }

    /// One optimizer step on `batch`: packed forward/backward, clipping, AdamW. A NaN or
    /// infinite loss or gradient norm skips the update: weights, moments and the
    /// optimizer's step count stay as they were, and `is_nonfinite` says so.
    pub fn step(&mut self, batch: &TrainBatch) -> Result<StepMetrics, TrainError> {
        let (mut grads, mut m) = self.gradients(batch)?;
        m.grad_norm = clip_grad_norm(&mut grads, self.cfg.grad_clip)?;
        m.lr = self.cfg.schedule.lr_at(self.optimizer.step);
        self.apply(&grads, m)
    }

    /// The AdamW update with `grads` at `m.lr`, unless `m`'s loss or gradient norm is NaN
    /// or infinite: then nothing changes and `m.is_nonfinite` is set.
    fn apply(
        &mut self,
        grads: &BTreeMap<String, Tensor>,
        mut m: StepMetrics,
    ) -> Result<StepMetrics, TrainError> {
        m.is_nonfinite = !(m.pg_loss.is_finite() && m.grad_norm.is_finite());
        if m.is_nonfinite {
            tracing::warn!(
                loss = m.pg_loss,
                grad_norm = m.grad_norm,
                "non-finite step skipped: weights and optimizer unchanged"
            );
        } else {
            self.optimizer.step(&self.vars, grads, m.lr)?;
        }
        Ok(m)
    }
}

/// Adds the gradients in `store` of every var to `grads`.
fn accumulate(
    grads: &mut BTreeMap<String, Tensor>,
    vars: &BTreeMap<String, Var>,
    store: &candle_core::backprop::GradStore,
) -> Result<(), TrainError> {
    for (name, var) in vars {
        if let Some(g) = store.get(var) {
            let sum = match grads.remove(name) {
                Some(acc) => (acc + g)?,
                None => g.clone(),
            };
            grads.insert(name.clone(), sum);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::Normalisers;
    use candle_core::Device;

    /// Every bit of the weights, the optimizer moments and the optimizer's step count.
    fn state_bits(learner: &Learner) -> (Vec<Vec<u32>>, u64) {
        let bits = |t: &Tensor| -> Vec<u32> {
            let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
            v.iter().map(|x| x.to_bits()).collect()
        };
        let mut all: Vec<Vec<u32>> = learner.vars.values().map(|v| bits(v)).collect();
        for (m, v) in learner.optimizer.moments.values() {
            all.extend([bits(m), bits(v)]);
        }
        (all, learner.optimizer.step)
    }

    /// Two sequences of the tiny model with `advantage` (and its negation).
    fn batch(advantage: f64) -> TrainBatch {
        let seq = |tokens: Vec<u32>, advantage: f64| TrainSeq {
            rollout_logprobs: vec![-4.0; tokens.len() - 2],
            num_prompt_tokens: 2,
            tokens,
            advantage,
            weight: 1.0,
        };
        TrainBatch {
            seqs: vec![
                seq(vec![5, 6, 7, 8, 9], advantage),
                seq(vec![5, 6, 10, 11], -advantage),
            ],
            norm: Normalisers {
                num_seqs: 2.0,
                num_tokens: 5.0,
                max_len: 3.0,
            },
        }
    }

    #[test]
    fn a_non_finite_loss_changes_no_weight_moment_or_step_count() {
        let policy = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
        let cfg = LearnerConfig::token_mean(1e-2, 1.0, 64, 8);
        let mut learner = Learner::new(&policy.config, &policy.weights, cfg).unwrap();
        assert!(!learner.step(&batch(1.0)).unwrap().is_nonfinite);
        let good = state_bits(&learner);
        assert_eq!(good.1, 1);
        for bad in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            let m = learner.step(&batch(bad)).unwrap();
            assert!(m.is_nonfinite, "advantage {bad}: {m:?}");
            assert!(
                state_bits(&learner) == good,
                "advantage {bad} changed the state"
            );
        }
        let m = learner.step(&batch(1.0)).unwrap();
        assert!(!m.is_nonfinite && m.pg_loss.is_finite());
        let after = state_bits(&learner);
        assert_eq!(after.1, 2, "the skipped steps did not count");
        assert!(after.0 != good.0, "a finite step still trains");
    }

    /// bf16 compute: the gradients reach the f32 masters as f32 and point where the f32
    /// learner's do; after a step the masters and the AdamW moments are still f32.
    #[test]
    fn bf16_compute_keeps_f32_masters_and_moments_and_follows_f32_gradients() {
        let policy = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
        let learner = |compute_dtype| {
            let cfg = LearnerConfig {
                compute_dtype,
                ..LearnerConfig::token_mean(1e-2, 1.0, 64, 8)
            };
            Learner::new(&policy.config, &policy.weights, cfg).unwrap()
        };
        let (f32_learner, mut bf16_learner) = (learner(DType::F32), learner(DType::BF16));
        let (want, _) = f32_learner.gradients(&batch(1.0)).unwrap();
        let (got, _) = bf16_learner.gradients(&batch(1.0)).unwrap();
        let flat = |g: &BTreeMap<String, Tensor>| -> Vec<f32> {
            g.values()
                .flat_map(|t| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
                .collect()
        };
        assert!(got.values().all(|g| g.dtype() == DType::F32));
        let (a, b) = (flat(&want), flat(&got));
        let dot: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
        let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
        let cosine = dot / (norm(&a) * norm(&b));
        assert!(cosine > 0.99, "cosine of bf16 and f32 gradients: {cosine}");
        assert!(!bf16_learner.step(&batch(1.0)).unwrap().is_nonfinite);
        assert!(bf16_learner.vars.values().all(|v| v.dtype() == DType::F32));
        assert!(bf16_learner
            .optimizer
            .moments
            .values()
            .all(|(m, v)| m.dtype() == DType::F32 && v.dtype() == DType::F32));
    }
}
