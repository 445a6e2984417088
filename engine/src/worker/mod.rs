//! The engine's worker thread: commands in (submissions, cancellations, published
//! weights), one scheduler iteration at a time, tokens out to each request's stream.

use std::collections::HashMap;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use dppo_model::{CausalLm, Policy, TextTokenizer};
use parking_lot::Mutex;

use crate::cost::{nanos, IterationCost};
use crate::device_sample::SampleKernel;
use crate::plan::Plan;
use crate::request::{find_stop, Event, GenerateRequest};
use crate::runner::Runner;
use crate::sampler::{stream_seed, Sampled, SeqRng};
use crate::scheduler::{Appended, Scheduler, SeqRequest};
use crate::sequence::{FinishReason, RequestId};
use crate::EngineError;

mod draw;

/// What the worker reports, read with [`crate::Engine::stats`]: the pool's fixed shape,
/// counters summed since start, and gauges of the moment (queue, running, blocks used).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    pub num_blocks: usize,
    pub block_size: usize,
    /// Bytes of one KV block (keys and values of every layer). The pool's pages are touched
    /// on first use, so its resident part grows with `peak_blocks_used`, up to the pool.
    pub block_bytes: usize,
    /// The paged attention kernel's variant, where the CUDA kernels run.
    pub attention_kernel: Option<crate::AttentionKernel>,
    pub peak_blocks_used: usize,
    pub num_preemptions: usize,
    pub num_iterations: usize,
    pub num_generated_tokens: usize,
    /// Nanoseconds spent in iterations (schedule, forward, sampling), each counted before
    /// its tokens are streamed: a caller holding its last token sees its time included.
    pub busy_ns: u64,
    /// The policy version the worker generates with (behind [`crate::Engine::policy_version`]
    /// while a publication waits for pinned requests to finish).
    pub policy_version: u64,
    /// Sequences waiting for admission (the queue depth).
    pub num_waiting: usize,
    pub num_running: usize,
    /// KV blocks held by live sequences now.
    pub blocks_used: usize,
    /// Where the iterations' time went and what they moved, summed over iterations.
    pub cost: IterationCost,
    /// The same over decode steps only (every scheduled sequence adds one token).
    pub decode_cost: IterationCost,
    pub num_decode_iterations: usize,
}

/// A request on its way to the worker.
pub(crate) struct Submission {
    pub request_id: RequestId,
    pub req: GenerateRequest,
    pub events: UnboundedSender<Event>,
}

/// What the worker is told, in order.
pub(crate) enum Command {
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

/// Per-request state kept by the worker.
struct RequestState {
    req: GenerateRequest,
    /// One RNG per sample; lent out while a draw is under way.
    rngs: Vec<Option<SeqRng>>,
    events: UnboundedSender<Event>,
    /// Each sample's noise key for device sampling (from the seed when there is one).
    keys: Vec<u64>,
    /// Output tokens per sample (for stop strings).
    outputs: Vec<Vec<u32>>,
    /// Which samples have finished.
    done: Vec<bool>,
}

/// The engine's thread: owns the scheduler and the runner, applies commands between
/// iterations, and streams every sampled token to its request.
pub(crate) struct Worker {
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
    /// Draw on the GPU where the iteration's requests allow it, computing the noise so.
    device_sampling: Option<SampleKernel>,
}

impl Worker {
    /// A worker for `policy`'s requests over `scheduler` and `runner`, counting into `stats`.
    pub fn new(
        scheduler: Scheduler,
        runner: Runner,
        policy: &Policy,
        stats: Arc<Mutex<EngineStats>>,
        device_sampling: Option<SampleKernel>,
    ) -> Self {
        Self {
            scheduler,
            runner,
            tokenizer: policy.tokenizer.clone(),
            eos_token_ids: policy.eos_token_ids().into(),
            requests: HashMap::new(),
            stats,
            policy_version: 0,
            held: None,
            stopping: false,
            device_sampling,
        }
    }

    /// Serves commands from `rx` until the engine shuts down.
    pub fn run(mut self, rx: Receiver<Command>) {
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
        // Runs after every iteration: look at the requests only when a model waits.
        if self.held.is_none() || self.requests.values().any(|r| r.req.pin_policy_version) {
            return;
        }
        if let Some((model, version)) = self.held.take() {
            if let Err(e) = self.runner.set_model(*model) {
                // The device failed while the captured steps were let go; the next iteration
                // meets the same error and fails its requests.
                tracing::error!("engine: dropping the captured decode steps failed: {e}");
            }
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
        let keys = (0..req.n)
            .map(|i| match req.sampling.seed {
                Some(seed) => stream_seed(seed, i as u64),
                None => rand::random(),
            })
            .collect();
        let state = RequestState {
            keys,
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
        let started = Instant::now();
        let mut cost = IterationCost::default();
        let plan = self.scheduler.schedule();
        if plan.is_empty() {
            return Err(EngineError::InvalidConfig(
                "no sequence could be scheduled (KV cache too small for any waiting request)"
                    .into(),
            ));
        }
        cost.schedule_ns = nanos(started);
        cost.seqs = plan.seqs.len() as u64;
        cost.kv_tokens = self.scheduler.attended_positions(&plan) as u64;
        let on_device = self.device_sampling;
        let logits = self
            .runner
            .run(&plan, &self.scheduler, &mut cost, on_device.is_some())?;
        let sampling = Instant::now();
        let sampled = if let Some(kernel) = on_device {
            self.draw_on_device(&plan, &logits, kernel, &mut cost)?
        } else {
            logits.with_rows(|rows| self.draw_all(&plan, rows))?
        };
        cost.sample_ns = nanos(sampling);
        let emitting = Instant::now();
        let ids: Vec<Vec<u32>> = sampled
            .iter()
            .map(|draws| draws.iter().map(|d| d.token_id).collect())
            .collect();
        let appended = self.scheduler.postprocess(&plan, &ids);
        cost.emit_ns = nanos(emitting);
        self.update_stats(&plan, appended.len(), started.elapsed(), &cost);
        for a in appended {
            self.emit(a, &sampled[a.plan_idx][a.sample_idx]);
        }
        Ok(())
    }

    fn update_stats(
        &self,
        plan: &Plan,
        num_new: usize,
        busy: std::time::Duration,
        cost: &IterationCost,
    ) {
        let pool = self.scheduler.pool();
        let mut stats = self.stats.lock();
        stats.cost.add(cost);
        stats.num_iterations += 1;
        if plan.seqs.iter().all(|s| s.num_new_tokens == 1) {
            stats.decode_cost.add(cost);
            stats.num_decode_iterations += 1;
        }
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
                self.scheduler.finish(a.seq_id);
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
