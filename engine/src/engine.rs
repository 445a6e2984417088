//! The [`Engine`] handle: a worker thread owns the scheduler and the runner; callers on
//! any thread submit requests over a channel and receive streamed [`Event`]s. Published
//! weights take effect between two iterations, never inside one, and never while a request
//! pinned to one policy version runs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use candle_core::{DType, Device};
use dppo_model::fused::inference::FusedKernels;
use dppo_model::{CausalLm, Policy, Weights};
use parking_lot::Mutex;

use crate::cuda_attn::AttentionKernel;
use crate::cuda_attn::Switches;
use crate::device_sample::{Noise, SampleKernel, SamplingPlace};
use crate::kv_pool::KvPool;
use crate::paged_attn::CacheShape;
use crate::publish::Publication;
use crate::request::{Completion, Event, GenerateRequest};
use crate::runner::{AttentionMode, Runner};
use crate::scheduler::{Capacity, Scheduler, SchedulerConfig};
use crate::sequence::RequestId;
use crate::worker::{Command, EngineStats, Submission, Worker};
use crate::EngineError;

/// Engine sizing; defaults suit a CPU box.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Token slots per KV block.
    pub block_size: usize,
    /// KV cache capacity in token slots (all layers); takes precedence over bytes.
    pub kv_cache_tokens: Option<usize>,
    /// KV cache capacity in bytes, used when `kv_cache_tokens` is not set.
    pub kv_cache_bytes: usize,
    pub max_num_seqs: usize,
    pub max_batched_tokens: usize,
    /// Run high-priority batches (rollouts) alone, so other traffic cannot change them.
    pub isolate_high_priority: bool,
    /// The attention backend (`engine.attention`).
    pub attention: AttentionMode,
    /// Dtype of the engine's weights and KV cache; `None`: [`default_dtype`] of the device.
    pub dtype: Option<DType>,
    /// Where tokens are drawn (`engine.sampling`).
    pub sampling: SamplingPlace,
    /// With sampling on the device, each score's exact Gumbel noise only where it could win
    /// (`engine.lazy_noise`: the same draws; on by default, passed by `dppo doctor` and
    /// faster on an H200; host sampling ignores it).
    pub lazy_noise: bool,
    /// With sampling on the device, each untruncated draw's row split over several blocks,
    /// so that a decode batch of a few hundred draws fills the GPU (`engine.split_draws`: the
    /// same draws; off by default until `dppo doctor` has passed it on a GPU).
    pub split_draws: bool,
    /// candle-nn's fused kernels for RMSNorm, rotary embedding, SiLU and the attention
    /// softmax, where the CPU's own fused ops do not apply, and q/k/v and gate/up as one
    /// GEMM each where the engine keeps its own weight buffers (`engine.fused_kernels`;
    /// `Auto`: on a GPU).
    pub fused_kernels: FusedKernels,
    /// With the paged CUDA kernels, add the q/k/v projection's bias and rotate q and k by one
    /// kernel of their own instead of candle's ops (`engine.rope_kernel`; on by default: it
    /// passed `dppo doctor` on an H200; the other backends ignore it).
    pub rope_kernel: bool,
    /// With `rope_kernel`, that kernel also writes k and v straight into their slots of the KV
    /// pool, in place of two slot-writing launches a layer (`engine.rope_writes_kv`; off by
    /// default until `dppo doctor` has passed it on a GPU).
    pub rope_writes_kv: bool,
    /// With `rope_kernel`, models with q/k norms (Qwen3) take that kernel too, which applies
    /// each q and k head's RMSNorm itself (`engine.rope_qk_norm`; on by default: it passed
    /// `dppo doctor` on an H200 and was faster there).
    pub rope_qk_norm: bool,
    /// With the paged CUDA kernels, the residual add with the RMSNorm after it, and the gated
    /// MLP's SiLU product, by kernels of their own (`engine.layer_kernels`; on by default: they
    /// passed `dppo doctor` on an H200; the other backends ignore it).
    pub layer_kernels: bool,
    /// With the paged CUDA kernels, the attention kernel's variant (`bench rollout
    /// --attention-kernel`, an experiment); `None`, what a run uses, picks
    /// [`AttentionKernel::default_for`] the model and GPU.
    pub attention_kernel: Option<AttentionKernel>,
    /// With the paged CUDA kernels, decode steps padded to a bucket of batch sizes and
    /// replayed from a CUDA graph captured at the first step of each shape, so that the host
    /// queues a step in a handful of calls (`engine.cuda_graphs`; off by default until
    /// `dppo doctor` has passed it on a GPU; the CPU's emulation pads the steps and runs
    /// them, which the tests check; other backends ignore it).
    pub cuda_graphs: bool,
    /// Synchronise the device around each layer's attention and after the forward pass, so
    /// that the iteration costs split the device's time between attention, the rest of the
    /// forward pass and sampling (`bench rollout --time-device`); slows the step.
    pub time_device: bool,
}

/// The engine's dtype when none is configured: f32 on the CPU, bf16 on a GPU.
pub fn default_dtype(device: &Device) -> DType {
    if device.is_cpu() {
        DType::F32
    } else {
        DType::BF16
    }
}

impl EngineConfig {
    /// How the worker draws on `device`: on the device by that kernel, or on the host
    /// (`None`).
    pub(crate) fn device_sampling(&self, device: &Device) -> Option<SampleKernel> {
        self.sampling.on_device(device).then_some(SampleKernel {
            noise: Noise::lazy(self.lazy_noise),
            split: self.split_draws,
        })
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            kv_cache_tokens: None,
            kv_cache_bytes: 2 << 30,
            max_num_seqs: 256,
            max_batched_tokens: 2048,
            isolate_high_priority: false,
            attention: AttentionMode::Auto,
            dtype: None,
            sampling: SamplingPlace::Auto,
            lazy_noise: true,
            split_draws: false,
            fused_kernels: FusedKernels::Auto,
            rope_kernel: true,
            rope_writes_kv: false,
            rope_qk_norm: true,
            layer_kernels: true,
            attention_kernel: None,
            cuda_graphs: false,
            time_device: false,
        }
    }
}

/// A submitted request: its id, its event stream (read from threads or async tasks), and
/// a way to cancel it. Dropping the handle before every sample finished cancels it, so a
/// caller that goes away (a disconnected client) frees its blocks at once.
pub struct RequestHandle {
    pub request_id: RequestId,
    pub n: usize,
    events: UnboundedReceiver<Event>,
    num_finished: usize,
    commands: Sender<Command>,
}

impl RequestHandle {
    /// Cancels the request; its blocks are freed before the next iteration.
    pub fn cancel(&self) {
        let _ = self.commands.send(Command::Cancel(self.request_id));
    }

    /// The next event; `None` once every sample has finished.
    pub async fn recv(&mut self) -> Option<Event> {
        if self.num_finished == self.n {
            return None;
        }
        let event = self.events.recv().await;
        self.count(event)
    }

    /// The next event, blocking the thread (not for async tasks); `None` when done.
    pub fn blocking_recv(&mut self) -> Option<Event> {
        if self.num_finished == self.n {
            return None;
        }
        let event = self.events.blocking_recv();
        self.count(event)
    }

    fn count(&mut self, event: Option<Event>) -> Option<Event> {
        match &event {
            Some(Event::Finished { .. }) => self.num_finished += 1,
            Some(Event::Token { .. }) => {}
            // The worker is gone: nothing more will come.
            None => self.num_finished = self.n,
        }
        event
    }

    /// Waits for every sample to finish and returns them, ordered by sample index.
    pub fn wait(mut self) -> Vec<Completion> {
        let n = self.n;
        Completion::from_events(n, std::iter::from_fn(|| self.blocking_recv()))
    }
}

impl Drop for RequestHandle {
    fn drop(&mut self) {
        if self.num_finished < self.n {
            self.cancel();
        }
    }
}

/// Handle to a running engine; cheap to share behind an `Arc`.
pub struct Engine {
    commands: Mutex<Sender<Command>>,
    worker: Option<JoinHandle<()>>,
    next_request_id: AtomicU64,
    limits: Limits,
    stats: Arc<Mutex<EngineStats>>,
    config: dppo_model::ModelConfig,
    /// Published weights and the policy version counter.
    publication: Publication,
}

/// What a request is checked against before it is queued.
#[derive(Debug, Clone, Copy)]
struct Limits {
    max_model_len: usize,
    vocab_size: usize,
    capacity: Capacity,
}

impl Engine {
    /// Starts the worker thread for `policy` on `device`.
    pub fn new(policy: &Policy, cfg: EngineConfig, device: Device) -> Result<Self, EngineError> {
        let dtype = cfg.dtype.unwrap_or_else(|| default_dtype(&device));
        let fused_kernels = cfg.fused_kernels.on(&device);
        let (publication, weights) =
            Publication::new(&policy.weights, device.clone(), dtype, fused_kernels)?;
        let model = CausalLm::new(&policy.config, &weights)?;
        let mc = &policy.config;
        let shape = CacheShape {
            num_layers: mc.num_hidden_layers,
            num_blocks: 0,
            block_size: cfg.block_size,
            num_kv_heads: mc.num_key_value_heads,
            head_dim: mc.head_dim,
        };
        let num_blocks = num_blocks(&cfg, &shape, dtype)?;
        let sched_cfg = SchedulerConfig {
            max_num_seqs: cfg.max_num_seqs,
            max_batched_tokens: cfg.max_batched_tokens,
            isolate_high_priority: cfg.isolate_high_priority,
        };
        let scheduler = Scheduler::new(sched_cfg, KvPool::new(num_blocks, cfg.block_size));
        let capacity = scheduler.capacity();
        let runner = Runner::new(
            model,
            (num_blocks, cfg.block_size),
            cfg.attention,
            Switches {
                time_device: cfg.time_device,
                rope_kernel: cfg.rope_kernel,
                rope_writes_kv: cfg.rope_writes_kv,
                rope_qk_norm: cfg.rope_qk_norm,
                layer_kernels: cfg.layer_kernels,
                attention_kernel: cfg.attention_kernel,
                cuda_graphs: cfg.cuda_graphs,
            },
            device.clone(),
        )?;
        let stats = Arc::new(Mutex::new(EngineStats {
            num_blocks,
            block_size: cfg.block_size,
            block_bytes: shape.bytes_per_token(dtype) * cfg.block_size,
            attention_kernel: runner.attention_kernel(),
            ..EngineStats::default()
        }));
        let (tx, rx) = mpsc::channel();
        let device_sampling = cfg.device_sampling(&device);
        let worker = Worker::new(scheduler, runner, policy, stats.clone(), device_sampling);
        let handle = std::thread::Builder::new()
            .name("dppo-engine".into())
            .spawn(move || match dppo_model::streams::enter(&device) {
                Ok(()) => {
                    dppo_model::fused::inference::use_on_this_thread(fused_kernels);
                    worker.run(rx)
                }
                Err(e) => tracing::error!("the engine thread cannot use {device:?}: {e}"),
            })
            .map_err(|e| {
                EngineError::InvalidConfig(format!("cannot start the engine thread: {e}"))
            })?;
        Ok(Self {
            commands: Mutex::new(tx),
            worker: Some(handle),
            next_request_id: AtomicU64::new(0),
            limits: Limits {
                max_model_len: mc.max_position_embeddings,
                vocab_size: mc.vocab_size,
                capacity,
            },
            stats,
            config: mc.clone(),
            publication,
        })
    }

    /// Validates and queues a request; tokens stream back on the handle.
    pub fn submit(&self, req: GenerateRequest) -> Result<RequestHandle, EngineError> {
        Ok(self.submit_all(vec![req])?.remove(0))
    }

    /// Validates every request, then queues them as one batch.
    pub fn submit_all(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> Result<Vec<RequestHandle>, EngineError> {
        for req in &reqs {
            self.check(req)?;
        }
        let commands = self.commands.lock().clone();
        let mut batch = Vec::with_capacity(reqs.len());
        let mut handles = Vec::with_capacity(reqs.len());
        for req in reqs {
            let request_id = self.next_request_id.fetch_add(1, Ordering::Relaxed);
            let (tx, rx) = unbounded_channel();
            handles.push(RequestHandle {
                request_id,
                n: req.n,
                events: rx,
                num_finished: 0,
                commands: commands.clone(),
            });
            batch.push(Submission {
                request_id,
                req,
                events: tx,
            });
        }
        commands
            .send(Command::Submit(batch))
            .map_err(|_| EngineError::Closed)?;
        Ok(handles)
    }

    /// Runs a whole batch (e.g. a rollout step) and returns each request's completions.
    pub fn generate(
        &self,
        reqs: Vec<GenerateRequest>,
    ) -> Result<Vec<Vec<Completion>>, EngineError> {
        let handles = self.submit_all(reqs)?;
        Ok(handles.into_iter().map(RequestHandle::wait).collect())
    }

    /// Publishes `weights` as the next policy version and returns it (cast to the engine's
    /// device and dtype unless they are in them already; zero-copy when they are, so the
    /// caller must not write them while the engine generates). Running sequences continue
    /// with them from the next iteration on, once no pinned request is running.
    pub fn publish(&self, weights: &Weights) -> Result<u64, EngineError> {
        self.publish_as(weights, None)
    }

    /// Publishes `weights` as policy `version` (resuming a run from a checkpoint).
    pub fn restore_version(&self, weights: &Weights, version: u64) -> Result<(), EngineError> {
        self.publish_as(weights, Some(version)).map(|_| ())
    }

    fn publish_as(&self, weights: &Weights, version: Option<u64>) -> Result<u64, EngineError> {
        let applied = self.stats.lock().policy_version;
        let queueing = crate::publish::QUEUEING.lock();
        let (version, weights) = self.publication.publish(weights, version, applied)?;
        let model = Box::new(CausalLm::new(&self.config, &weights)?);
        drop(queueing);
        self.commands
            .lock()
            .send(Command::Swap { model, version })
            .map_err(|_| EngineError::Closed)?;
        Ok(version)
    }

    /// The newest published policy version: what requests submitted now are generated with.
    pub fn policy_version(&self) -> u64 {
        self.publication.version()
    }

    /// The engine's copy of the newest published weights (the publisher's own tensors when
    /// the publication was zero-copy).
    pub fn published_weights(&self) -> Weights {
        self.publication.weights()
    }

    /// A snapshot of the worker's counters.
    pub fn stats(&self) -> EngineStats {
        *self.stats.lock()
    }

    /// The model's context length (prompt + generated tokens).
    pub fn max_model_len(&self) -> usize {
        self.limits.max_model_len
    }

    fn check(&self, req: &GenerateRequest) -> Result<(), EngineError> {
        let bad = |r: String| Err(EngineError::InvalidRequest(r));
        req.sampling
            .validate()
            .map_err(EngineError::InvalidRequest)?;
        self.limits
            .capacity
            .check(req.prompt_ids.len(), req.n, req.max_tokens)?;
        let total = req.prompt_ids.len().saturating_add(req.max_tokens);
        if total > self.limits.max_model_len {
            return bad(format!(
                "prompt ({} tokens) + max_tokens ({}) = {total} exceeds the model's context of {} tokens",
                req.prompt_ids.len(),
                req.max_tokens,
                self.limits.max_model_len
            ));
        }
        if let Some(&id) = req
            .prompt_ids
            .iter()
            .find(|&&id| id as usize >= self.limits.vocab_size)
        {
            return bad(format!(
                "token id {id} is outside the vocabulary ({})",
                self.limits.vocab_size
            ));
        }
        if req.stop.iter().any(String::is_empty) {
            return bad("stop strings must not be empty".into());
        }
        Ok(())
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        let (dead, _) = mpsc::channel();
        let _ = std::mem::replace(&mut *self.commands.lock(), dead).send(Command::Shutdown);
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

fn num_blocks(cfg: &EngineConfig, shape: &CacheShape, dtype: DType) -> Result<usize, EngineError> {
    if cfg.block_size == 0 || cfg.max_num_seqs == 0 || cfg.max_batched_tokens == 0 {
        return Err(EngineError::InvalidConfig(
            "block_size, max_num_seqs and max_batched_tokens must be positive".into(),
        ));
    }
    let tokens = cfg
        .kv_cache_tokens
        .unwrap_or(cfg.kv_cache_bytes / shape.bytes_per_token(dtype));
    let blocks = tokens / cfg.block_size;
    if blocks == 0 {
        return Err(EngineError::InvalidConfig(format!(
            "the KV cache holds no block of {} tokens ({} bytes per token)",
            cfg.block_size,
            shape.bytes_per_token(dtype)
        )));
    }
    Ok(blocks)
}
