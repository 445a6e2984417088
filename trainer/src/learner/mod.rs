//! The learner: trainable parameters, packed forward/backward of every buffer with the
//! gradients accumulated into one AdamW step.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Tensor, Var};
use dppo_model::train_layer::LayerGrads;
use dppo_model::{CausalLm, ModelConfig, Weights};

use crate::dist::{shard_range, sum_f64, Collective, Single};

use crate::config::RunConfig;
use crate::loss::{buffer_loss, buffer_nll, LossConfig, TrainSeq};
use crate::optim::{clip_grad_norm, AdamW, AdamWConfig, LrSchedule};
use crate::pack::pack;
use crate::train_batch::TrainBatch;
use crate::TrainError;

mod grads;
mod reference;
mod sums;

use grads::{accumulate, reduce_bucket, take_layer_grads};
pub use reference::Reference;
use sums::Sums;

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
    /// The built-in default's objective (`configs/default.toml`'s `[actor]`: its clip range,
    /// `token-mean`, token-level ratio, no KL term) with default AdamW at the constant
    /// learning rate `lr`: the learner of `dppo bench train`, the learner benchmark and the
    /// tests.
    pub fn token_mean(lr: f64, grad_clip: f64, pack_tokens: usize, pack_window: usize) -> Self {
        let actor = RunConfig::default_with(&[])
            .expect("the built-in default is valid")
            .actor;
        Self {
            loss: actor.loss(),
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
    /// The learner's logprobs of the sampled tokens against the rollout's (`mismatch/*`).
    pub mismatch: crate::mismatch::Mismatch,
    /// Tensors in the autograd graphs of the step's buffers, summed: the ops the forward
    /// pass records, each with one or more ops in the backward pass. On a GPU each op is a
    /// launch and an allocation, so this is what the host's share of a step grows with.
    pub graph_nodes: usize,
}

/// Stack for the backward pass: candle's graph walk recurses once per op.
const BACKWARD_STACK: usize = 512 << 20;

/// Gradient elements per all-reduce between ranks (16 MiB of f32, as PyTorch DDP's 25 MB
/// buckets): large enough to amortise a collective's latency, small enough not to double
/// the gradients' memory at once.
const BUCKET_ELEMS: usize = 1 << 22;

/// Trainable f32 master weights, the model reading them, the optimizer, and (when the KL
/// term is on) a frozen copy of the initial policy as reference. With several ranks, each
/// holds a replica: gradients are all-reduced before clipping, so every replica takes the
/// same AdamW step.
pub struct Learner {
    pub cfg: LearnerConfig,
    pub vars: BTreeMap<String, Var>,
    pub model: CausalLm,
    pub reference: Option<Reference>,
    pub optimizer: AdamW,
    /// The weights `model` reads: the vars' own tensors, cast for a compute dtype.
    trainable: Weights,
    /// The ranks this learner's replicas span ([`Single`] unless set).
    collective: Arc<dyn Collective>,
}

/// The tensors bf16 compute keeps in f32 ([`Learner::compute_model`]).
const KEPT_F32: [&str; 2] = ["model.embed_tokens.weight", "lm_head.weight"];

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
            trainable,
            collective: Arc::new(Single),
        })
    }

    /// Makes this learner one replica of a data-parallel group: its steps all-reduce
    /// gradients and metrics over `collective`'s ranks.
    pub fn set_collective(&mut self, collective: Arc<dyn Collective>) {
        self.collective = collective;
    }

    /// The ranks this learner's replicas span.
    pub fn collective(&self) -> &Arc<dyn Collective> {
        &self.collective
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

    /// The optimizer's moments by their checkpoint names (`m/<param>`, `v/<param>`).
    pub fn optimizer_tensors(&self) -> BTreeMap<String, Tensor> {
        let mut tensors = BTreeMap::new();
        for (name, (m, v)) in &self.optimizer.moments {
            tensors.insert(format!("m/{name}"), m.clone());
            tensors.insert(format!("v/{name}"), v.clone());
        }
        tensors
    }

    /// Continues the optimizer from a checkpoint: the moments of [`Self::optimizer_tensors`]
    /// (parameters without both are fresh) after `step` updates.
    pub fn restore_optimizer(&mut self, tensors: &HashMap<String, Tensor>, step: u64) {
        let mut moments = BTreeMap::new();
        for name in self.vars.keys() {
            if let (Some(m), Some(v)) = (
                tensors.get(&format!("m/{name}")),
                tensors.get(&format!("v/{name}")),
            ) {
                moments.insert(name.clone(), (m.clone(), v.clone()));
            }
        }
        self.optimizer.moments = moments;
        self.optimizer.step = step;
    }

    /// The KL reference's weights, when the KL term is on.
    pub fn reference_weights(&self) -> Option<&Weights> {
        self.reference.as_ref().map(|r| &r.weights)
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
    ///
    /// Over the masters themselves, the decoder layers run as single ops where they can
    /// ([`dppo_model::train_layer`]) and put their weights' gradients in the store returned;
    /// over a cast, the gradients must flow back through it, so candle's autograd runs.
    fn compute_model(&self) -> Result<(CausalLm, LayerGrads), TrainError> {
        if self.cfg.compute_dtype == DType::F32 {
            let grads = LayerGrads::new();
            return Ok((self.model.with_layer_grads(grads.clone()), grads));
        }
        let weights = self
            .trainable
            .to_dtype_except(self.cfg.compute_dtype, &KEPT_F32)?;
        let model = CausalLm::new(self.model.config(), &weights)?;
        Ok((model, LayerGrads::new()))
    }

    /// Gradients of the batch loss, summed over packed buffers, plus metric sums: this
    /// rank's sequences only.
    pub fn gradients(
        &self,
        batch: &TrainBatch,
    ) -> Result<(BTreeMap<String, Tensor>, StepMetrics), TrainError> {
        let (grads, sums) = self.local_gradients(batch)?;
        Ok((grads, sums.metrics(self.cfg.pack_tokens)))
    }

    /// The gradients of the global batch: every rank's [`Learner::gradients`] of its share,
    /// all-reduced, with the metrics of the whole batch. The same bits on every rank.
    pub fn reduced_gradients(
        &self,
        batch: &TrainBatch,
    ) -> Result<(BTreeMap<String, Tensor>, StepMetrics), TrainError> {
        let (mut grads, sums) = self.local_gradients(batch)?;
        let sums = sums.over_ranks(self.collective.as_ref())?;
        self.all_reduce(&mut grads)?;
        Ok((grads, sums.metrics(self.cfg.pack_tokens)))
    }

    fn local_gradients(
        &self,
        batch: &TrainBatch,
    ) -> Result<(BTreeMap<String, Tensor>, Sums), TrainError> {
        self.on_backward_thread(|| self.accumulate(batch))
    }

    /// Runs `f` on a thread with a stack deep enough for candle's recursive backward pass,
    /// the learner's device entered there (see `dppo_model::streams`).
    fn on_backward_thread<T: Send>(
        &self,
        f: impl FnOnce() -> Result<T, TrainError> + Send,
    ) -> Result<T, TrainError> {
        let device = self.model.device().clone();
        std::thread::scope(|scope| {
            std::thread::Builder::new()
                .name("dppo-backward".into())
                .stack_size(BACKWARD_STACK)
                .spawn_scoped(scope, move || {
                    dppo_model::streams::enter(&device)?;
                    f()
                })
                .map_err(|e| TrainError::Thread(e.to_string()))?
                .join()
                .map_err(|_| TrainError::Thread("the backward thread panicked".into()))?
        })
    }

    fn accumulate(
        &self,
        batch: &TrainBatch,
    ) -> Result<(BTreeMap<String, Tensor>, Sums), TrainError> {
        let start = Instant::now();
        let lengths: Vec<usize> = batch.seqs.iter().map(|s| s.tokens.len()).collect();
        let buffers = pack(&lengths, self.cfg.pack_tokens, self.cfg.pack_window)?;
        let mut grads: BTreeMap<String, Tensor> = BTreeMap::new();
        let mut m = Sums::default();
        let (model, layer_grads) = self.compute_model()?;
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
            m.tokens += out.num_tokens;
            m.clipped += out.num_clipped;
            m.entropy += out.entropy_sum;
            m.mismatch.add(&out.mismatch);
            m.graph_nodes += out.loss.sorted_nodes().len();
            accumulate(&mut grads, &self.vars, &out.loss.backward()?)?;
        }
        take_layer_grads(&mut grads, &self.vars, &layer_grads)?;
        m.num_buffers = buffers.len();
        m.seq_tokens = lengths.iter().sum();
        m.seconds = start.elapsed().as_secs_f64();
        Ok((grads, m))
    }

    /// Sums `grads` over the ranks in place, flattened into buckets of [`BUCKET_ELEMS`]:
    /// one all-reduce per bucket. A parameter some rank has a gradient for gets one on
    /// every rank (zeros where a rank had none); one no rank reached stays without, as on
    /// a single rank (the optimizer then leaves it and its moments alone).
    fn all_reduce(&self, grads: &mut BTreeMap<String, Tensor>) -> Result<(), TrainError> {
        let coll = self.collective.as_ref();
        if coll.world_size() == 1 {
            return Ok(());
        }
        let mut reached: Vec<f32> = self
            .vars
            .keys()
            .map(|name| f32::from(u8::from(grads.contains_key(name))))
            .collect();
        coll.all_reduce_sum(&mut reached)?;
        let mut bucket: Vec<(String, Tensor)> = Vec::new();
        let mut elems = 0;
        for ((name, var), reached) in self.vars.iter().zip(reached) {
            if reached == 0.0 {
                continue;
            }
            let g = match grads.remove(name) {
                Some(g) => g,
                None => var.as_tensor().zeros_like()?,
            };
            elems += g.elem_count();
            bucket.push((name.clone(), g));
            if elems >= BUCKET_ELEMS {
                reduce_bucket(coll, std::mem::take(&mut bucket), grads)?;
                elems = 0;
            }
        }
        if !bucket.is_empty() {
            reduce_bucket(coll, bucket, grads)?;
        }
        Ok(())
    }

    /// One supervised step on demonstrations (mean NLL of their completion tokens) at
    /// learning rate `lr`: `pg_loss` holds the NLL. Shares the optimizer with RL steps, and
    /// skips the update as [`Learner::step`] does when the loss or gradient is not finite.
    ///
    /// With several ranks every rank passes the whole batch: each trains on its contiguous
    /// share, normalised by the whole batch's token count, and the gradients are summed.
    pub fn sft_step(&mut self, seqs: &[TrainSeq], lr: f64) -> Result<StepMetrics, TrainError> {
        let num_tokens: usize = seqs.iter().map(TrainSeq::num_completion_tokens).sum();
        let coll = self.collective.clone();
        let seqs = &seqs[shard_range(seqs.len(), coll.rank(), coll.world_size())];
        let lengths: Vec<usize> = seqs.iter().map(|s| s.tokens.len()).collect();
        let buffers = pack(&lengths, self.cfg.pack_tokens, self.cfg.pack_window)?;
        let run = || -> Result<(BTreeMap<String, Tensor>, f64), TrainError> {
            let mut grads: BTreeMap<String, Tensor> = BTreeMap::new();
            let mut total = 0.0;
            let (model, layer_grads) = self.compute_model()?;
            for buffer in &buffers {
                let refs: Vec<&TrainSeq> = buffer.iter().map(|&i| &seqs[i]).collect();
                let loss = (buffer_nll(&model, &refs)? / num_tokens.max(1) as f64)?;
                total += loss.to_dtype(candle_core::DType::F64)?.to_scalar::<f64>()?;
                accumulate(&mut grads, &self.vars, &loss.backward()?)?;
            }
            take_layer_grads(&mut grads, &self.vars, &layer_grads)?;
            Ok((grads, total))
        };
        let (mut grads, loss) = self.on_backward_thread(run)?;
        self.all_reduce(&mut grads)?;
        let [loss, num_buffers] = sum_f64(coll.as_ref(), &[loss, buffers.len() as f64])?[..] else {
            unreachable!("two sums")
        };
        let m = StepMetrics {
            pg_loss: loss,
            grad_norm: clip_grad_norm(&mut grads, self.cfg.grad_clip)?,
            lr,
            num_buffers: num_buffers as usize,
            ..StepMetrics::default()
        };
        self.apply(&grads, m)
    }

    /// One optimizer step on `batch`: packed forward/backward, clipping, AdamW. A NaN or
    /// infinite loss or gradient norm skips the update: weights, moments and the
    /// optimizer's step count stay as they were, and `is_nonfinite` says so.
    ///
    /// With several ranks, `batch` is this rank's share of the step's sequences (with the
    /// normalisers of the whole batch): the gradients and metrics are those of the whole.
    pub fn step(&mut self, batch: &TrainBatch) -> Result<StepMetrics, TrainError> {
        let (mut grads, mut m) = self.reduced_gradients(batch)?;
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

#[cfg(test)]
mod tests;
