//! The [`Engine`] handle: a worker thread owns the scheduler and the runner; callers on
//! any thread submit requests over a channel and receive streamed [`Event`]s. Published
//! weights take effect between two iterations, never inside one, and never while a request
//! pinned to one policy version runs.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use candle_core::{DType, Device};
use dppo_model::parallel::multi_threaded;
use dppo_model::{CausalLm, Policy, TextTokenizer, Weights};
use parking_lot::Mutex;
use rayon::prelude::*;

use crate::kv_pool::KvPool;
use crate::paged_attn::CacheShape;
use crate::plan::Plan;
use crate::publish::Publication;
use crate::request::{find_stop, Completion, Event, GenerateRequest};
use crate::runner::{AttentionMode, Runner};
use crate::sampler::{sample, Sampled, SamplingParams, SeqRng};
use crate::scheduler::{Appended, Capacity, Scheduler, SchedulerConfig, SeqRequest};
use crate::sequence::{FinishReason, RequestId};
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
}

/// The engine's dtype when none is configured: f32 on the CPU, bf16 on a GPU.
pub fn default_dtype(device: &Device) -> DType {
    if device.is_cpu() {
        DType::F32
    } else {
        DType::BF16
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
        }
    }
}

/// Counters the worker keeps; read with [`Engine::stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub num_blocks: usize,
    pub block_size: usize,
    /// Bytes of one KV block (keys and values of every layer). The pool's pages are touched
    /// on first use, so its resident part grows with `peak_blocks_used`, up to the pool.
    pub block_bytes: usize,
    pub peak_blocks_used: usize,
    pub num_preemptions: usize,
    pub num_iterations: usize,
    pub num_generated_tokens: usize,
    /// Nanoseconds spent in iterations (schedule, forward, sampling), each counted before
    /// its tokens are streamed: a caller holding its last token sees its time included.
    pub busy_ns: u64,
    /// The policy version the worker generates with (behind [`Engine::policy_version`]
    /// while a publication waits for pinned requests to finish).
    pub policy_version: u64,
    /// Sequences waiting for admission (the queue depth).
    pub num_waiting: usize,
    pub num_running: usize,
    /// KV blocks held by live sequences now.
    pub blocks_used: usize,
}

/// A request on its way to the worker.
struct Submission {
    request_id: RequestId,
    req: GenerateRequest,
    events: UnboundedSender<Event>,
}

enum Command {
    /// Requests admitted together, before the worker's next iteration: a batch's
    /// composition then never depends on thread timing (reproducible rollouts).
    Submit(Vec<Submission>),
    Cancel(RequestId),
    Swap {
        model: Box<CausalLm>,
        version: u64,
    },
    /// The engine is dropped: finish the queued work, then stop (request handles still
    /// alive hold senders, so the channel alone would never close).
    Shutdown,
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
        let (publication, weights) = Publication::new(&policy.weights, device.clone(), dtype)?;
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
        let runner = Runner::new(model, num_blocks, cfg.block_size, cfg.attention, device)?;
        let stats = Arc::new(Mutex::new(EngineStats {
            num_blocks,
            block_size: cfg.block_size,
            block_bytes: shape.bytes_per_token(dtype) * cfg.block_size,
            ..EngineStats::default()
        }));
        let (tx, rx) = mpsc::channel();
        let worker = Worker {
            scheduler,
            runner,
            tokenizer: policy.tokenizer.clone(),
            eos_token_ids: policy.eos_token_ids().into(),
            requests: HashMap::new(),
            stats: stats.clone(),
            policy_version: 0,
            held: None,
            stopping: false,
        };
        let handle = std::thread::Builder::new()
            .name("dppo-engine".into())
            .spawn(move || worker.run(rx))
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
        let (version, weights) = self.publication.publish(weights, version, applied)?;
        let model = Box::new(CausalLm::new(&self.config, &weights)?);
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

/// Per-request state kept by the worker.
struct RequestState {
    req: GenerateRequest,
    /// One RNG per sample; lent out while a draw is under way.
    rngs: Vec<Option<SeqRng>>,
    events: UnboundedSender<Event>,
    /// Output tokens per sample (for stop strings).
    outputs: Vec<Vec<u32>>,
    /// Which samples have finished.
    done: Vec<bool>,
}

struct Worker {
    scheduler: Scheduler,
    runner: Runner,
    tokenizer: TextTokenizer,
    eos_token_ids: Arc<[u32]>,
    requests: HashMap<RequestId, RequestState>,
    stats: Arc<Mutex<EngineStats>>,
    policy_version: u64,
    /// A published model waiting for the pinned requests to finish.
    held: Option<(Box<CausalLm>, u64)>,
    /// Set by `Command::Shutdown`: return once no work is left.
    stopping: bool,
}

impl Worker {
    fn run(mut self, rx: Receiver<Command>) {
        loop {
            // 1. Commands: block while idle, drain without blocking while busy.
            if !self.scheduler.has_work() {
                if self.stopping {
                    return;
                }
                match rx.recv() {
                    Ok(cmd) => self.apply(cmd),
                    Err(_) => return,
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                self.apply(cmd);
            }
            if self.scheduler.has_work() {
                // 2. One iteration.
                if let Err(e) = self.step() {
                    tracing::error!("engine iteration failed: {e}");
                    self.fail_all();
                }
                self.apply_held();
            }
            self.publish_occupancy();
        }
    }

    /// Current queue and pool occupancy, for `/metrics`.
    fn publish_occupancy(&self) {
        let (waiting, running) = self.scheduler.num_waiting_running();
        let pool = self.scheduler.pool();
        let mut stats = self.stats.lock();
        stats.num_waiting = waiting;
        stats.num_running = running;
        stats.blocks_used = pool.num_blocks() - pool.num_free_blocks();
    }

    fn apply(&mut self, cmd: Command) {
        match cmd {
            Command::Submit(batch) => {
                // New requests start with the newest weights the pinned ones allow.
                self.apply_held();
                for s in batch {
                    self.admit(s.request_id, s.req, s.events);
                }
            }
            Command::Cancel(request_id) => self.cancel(request_id),
            Command::Swap { model, version } => {
                self.held = Some((model, version));
                self.apply_held();
            }
            Command::Shutdown => self.stopping = true,
        }
    }

    /// Swaps in the held model unless a pinned request is running: every token of a pinned
    /// request comes from one policy version (a step's rollout).
    fn apply_held(&mut self) {
        if self.requests.values().any(|r| r.req.pin_policy_version) {
            return;
        }
        if let Some((model, version)) = self.held.take() {
            self.runner.set_model(*model);
            self.policy_version = version;
            self.stats.lock().policy_version = version;
        }
    }

    fn admit(
        &mut self,
        request_id: RequestId,
        req: GenerateRequest,
        events: UnboundedSender<Event>,
    ) {
        let eos = if req.ignore_eos {
            Arc::from(Vec::new())
        } else {
            self.eos_token_ids.clone()
        };
        let seq_req = SeqRequest {
            request_id,
            prompt_ids: req.prompt_ids.clone(),
            n: req.n,
            max_tokens: req.max_tokens,
            eos_token_ids: eos,
            priority: req.priority,
        };
        if let Err(e) = self.scheduler.add_request(seq_req) {
            tracing::warn!("request {request_id} rejected: {e}");
            for sample_index in 0..req.n {
                let _ = events.send(Event::Finished {
                    sample_index,
                    reason: FinishReason::Cancelled,
                });
            }
            return;
        }
        let rngs = (0..req.n)
            .map(|i| match req.sampling.seed {
                Some(seed) => Some(SeqRng::new(seed, i as u64)),
                None => Some(SeqRng::from_entropy()),
            })
            .collect();
        let state = RequestState {
            outputs: vec![Vec::new(); req.n],
            done: vec![false; req.n],
            req,
            rngs,
            events,
        };
        self.requests.insert(request_id, state);
    }

    fn cancel(&mut self, request_id: RequestId) {
        self.scheduler.cancel(request_id);
        if let Some(state) = self.requests.remove(&request_id) {
            let live = (0..state.req.n).filter(|&i| !state.done[i]);
            for sample_index in live {
                let _ = state.events.send(Event::Finished {
                    sample_index,
                    reason: FinishReason::Cancelled,
                });
            }
        }
    }

    fn step(&mut self) -> Result<(), EngineError> {
        let started = std::time::Instant::now();
        let plan = self.scheduler.schedule();
        if plan.is_empty() {
            return Err(EngineError::InvalidConfig(
                "no sequence could be scheduled (KV cache too small for any waiting request)"
                    .into(),
            ));
        }
        let logits = self.runner.run(&plan, &self.scheduler)?;
        let sampled = logits.with_rows(|rows| self.draw_all(&plan, rows))?;
        let ids: Vec<Vec<u32>> = sampled
            .iter()
            .map(|draws| draws.iter().map(|d| d.token_id).collect())
            .collect();
        let appended = self.scheduler.postprocess(&plan, &ids);
        self.update_stats(&plan, appended.len(), started.elapsed());
        for a in appended {
            self.emit(a, &sampled[a.plan_idx][a.sample_idx]);
        }
        Ok(())
    }

    /// Samples every row of the iteration, in parallel when rayon has several threads. Each
    /// sample draws from its own RNG (a forking group's row is drawn once per sample), so no
    /// result depends on the batch.
    fn draw_all(&mut self, plan: &Plan, logits: &[Option<&[f32]>]) -> Vec<Vec<Sampled>> {
        // 1. Lend each job the RNGs of the samples it draws for.
        let jobs: Vec<(RequestId, usize, Vec<SeqRng>)> = plan
            .seqs
            .iter()
            .zip(logits)
            .map(|(s, row)| {
                let seq = self.scheduler.seq(s.seq_id).expect("live");
                let state = self
                    .requests
                    .get_mut(&seq.request_id)
                    .expect("live request");
                let first = if s.num_samples > 1 {
                    0
                } else {
                    seq.sample_index
                };
                let count = if row.is_some() { s.num_samples } else { 0 };
                let rngs = (first..first + count)
                    .map(|i| state.rngs[i].take().expect("one draw per sample at a time"))
                    .collect();
                (seq.request_id, first, rngs)
            })
            .collect();
        let params: Vec<SamplingParams> = jobs
            .iter()
            .map(|(r, _, _)| self.requests[r].req.sampling.clone())
            .collect();
        // 2. Draw.
        let draw = |mut rngs: Vec<SeqRng>, row: &Option<&[f32]>, params: &SamplingParams| {
            let draws = match row {
                Some(row) => rngs
                    .iter_mut()
                    .map(|rng| sample(row, params, rng))
                    .collect(),
                None => Vec::new(),
            };
            (draws, rngs)
        };
        let results: Vec<(Vec<Sampled>, Vec<SeqRng>)> = if multi_threaded() {
            jobs.into_par_iter()
                .zip(logits.par_iter())
                .zip(params.par_iter())
                .map(|(((_, _, rngs), row), params)| draw(rngs, row, params))
                .collect()
        } else {
            jobs.into_iter()
                .zip(logits)
                .zip(&params)
                .map(|(((_, _, rngs), row), params)| draw(rngs, row, params))
                .collect()
        };
        // 3. Give the RNGs back.
        let mut sampled = Vec::with_capacity(results.len());
        for (s, (draws, rngs)) in plan.seqs.iter().zip(results) {
            if let Some(seq) = self.scheduler.seq(s.seq_id) {
                let first = if s.num_samples > 1 {
                    0
                } else {
                    seq.sample_index
                };
                let state = self
                    .requests
                    .get_mut(&seq.request_id)
                    .expect("live request");
                for (i, rng) in rngs.into_iter().enumerate() {
                    state.rngs[first + i] = Some(rng);
                }
            }
            sampled.push(draws);
        }
        sampled
    }

    fn update_stats(&self, plan: &Plan, num_new: usize, busy: std::time::Duration) {
        let pool = self.scheduler.pool();
        let mut stats = self.stats.lock();
        stats.num_iterations += 1;
        stats.busy_ns += busy.as_nanos() as u64;
        stats.num_preemptions += plan.preempted.len();
        stats.num_generated_tokens += num_new;
        stats.peak_blocks_used = stats
            .peak_blocks_used
            .max(pool.num_blocks() - pool.num_free_blocks());
    }

    /// Streams one token and retires its sample on EOS, length or a stop string.
    fn emit(&mut self, a: Appended, s: &Sampled) {
        let Some(state) = self.requests.get_mut(&a.request_id) else {
            return;
        };
        let token = Event::Token {
            sample_index: a.sample_index,
            token_id: a.token_id,
            logprob: s.logprob,
            model_logprob: s.model_logprob,
            top_logprobs: s.top_logprobs.clone(),
            policy_version: self.policy_version,
        };
        let receiver_gone = state.events.send(token).is_err();
        state.outputs[a.sample_index].push(a.token_id);
        let mut finish = a.finish;
        if finish.is_none() && !state.req.stop.is_empty() {
            // Decode only a tail long enough to hold any stop string.
            let out = &state.outputs[a.sample_index];
            let window = state.req.stop.iter().map(String::len).max().unwrap_or(0) + 4;
            let tail = &out[out.len().saturating_sub(window)..];
            let text = self.tokenizer.decode(tail, false).unwrap_or_default();
            if find_stop(&text, &state.req.stop).is_some() {
                self.scheduler.finish(a.seq_id, FinishReason::Stop);
                finish = Some(FinishReason::Stop);
            }
        }
        if receiver_gone {
            self.cancel(a.request_id);
            return;
        }
        if let Some(reason) = finish {
            let _ = state.events.send(Event::Finished {
                sample_index: a.sample_index,
                reason,
            });
            state.done[a.sample_index] = true;
            if state.done.iter().all(|&d| d) {
                self.requests.remove(&a.request_id);
            }
        }
    }

    fn fail_all(&mut self) {
        let ids: Vec<RequestId> = self.requests.keys().copied().collect();
        for id in ids {
            self.cancel(id);
        }
    }
}
