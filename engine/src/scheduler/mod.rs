//! Continuous batching: every iteration runs the sequences already running, admits waiting
//! ones while blocks and budgets allow, and preempts the newest (recompute) when blocks run
//! out. High-priority requests (trainer rollouts) are admitted first and preempted last.
//! Plain bookkeeping; tensors live in the runner.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::kv_pool::KvPool;
use crate::plan::{Plan, ScheduledSeq};
use crate::sequence::{FinishReason, Priority, RequestId, SeqId, Sequence};
use crate::EngineError;

/// Limits of one iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most sequences running at once (a group counts `n` from its admission).
    pub max_num_seqs: usize,
    /// Most tokens computed in one iteration (prefill chunks and decodes together).
    pub max_batched_tokens: usize,
    /// While any high-priority sequence is waiting or running, normal ones are preempted
    /// and wait: high-priority batches then run exactly as they would alone (bit-identical
    /// rollouts however much other traffic there is).
    pub isolate_high_priority: bool,
}

/// The sizes a request must fit in to ever run alone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    pub max_num_seqs: usize,
    pub num_blocks: usize,
    pub block_size: usize,
}

impl Capacity {
    /// Rejects a request that could never be scheduled (so none can deadlock the queue).
    pub fn check(&self, prompt_len: usize, n: usize, max_tokens: usize) -> Result<(), EngineError> {
        let bad = |reason: String| Err(EngineError::InvalidRequest(reason));
        if prompt_len == 0 {
            return bad("the prompt is empty".into());
        }
        if n == 0 || n > self.max_num_seqs {
            return bad(format!(
                "n must be between 1 and max_num_seqs ({}), got {n}",
                self.max_num_seqs
            ));
        }
        if max_tokens == 0 {
            return bad("max_tokens must be at least 1".into());
        }
        let needed = prompt_len
            .saturating_add(max_tokens)
            .div_ceil(self.block_size);
        if needed > self.num_blocks {
            return bad(format!(
                "prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) needs {needed} KV blocks, the pool has {}",
                self.num_blocks
            ));
        }
        Ok(())
    }
}

/// A request as the scheduler sees it.
#[derive(Debug, Clone)]
pub struct SeqRequest {
    pub request_id: RequestId,
    pub prompt_ids: Vec<u32>,
    /// Samples of this prompt; they share the prompt's blocks.
    pub n: usize,
    pub max_tokens: usize,
    pub eos_token_ids: Arc<[u32]>,
    pub priority: Priority,
}

/// A token appended to a sequence by [`Scheduler::postprocess`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Appended {
    pub seq_id: SeqId,
    pub request_id: RequestId,
    pub sample_index: usize,
    pub token_id: u32,
    /// Where the token came from: `sampled[plan_idx][sample_idx]`.
    pub plan_idx: usize,
    pub sample_idx: usize,
    /// Set when this token ended the sequence (EOS or `max_tokens`).
    pub finish: Option<FinishReason>,
}

/// The waiting and running queues over a [`KvPool`].
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    pool: KvPool,
    /// Highest priority first, then oldest first.
    waiting: VecDeque<SeqId>,
    /// Highest priority first, then oldest first; preemption takes from the back.
    running: Vec<SeqId>,
    seqs: HashMap<SeqId, Sequence>,
    next_seq_id: SeqId,
    /// One mark per block for [`Scheduler::attended_positions`], all clear between calls, so
    /// that counting costs the scheduled tables' length, not the pool's.
    attended: Vec<bool>,
}

impl Scheduler {
    /// A scheduler over `pool`.
    pub fn new(cfg: SchedulerConfig, pool: KvPool) -> Self {
        Self {
            cfg,
            attended: vec![false; pool.num_blocks()],
            pool,
            waiting: VecDeque::new(),
            running: Vec::new(),
            seqs: HashMap::new(),
            next_seq_id: 0,
        }
    }

    /// The block pool (for accounting).
    pub fn pool(&self) -> &KvPool {
        &self.pool
    }

    /// A live sequence.
    pub fn seq(&self, seq_id: SeqId) -> Option<&Sequence> {
        self.seqs.get(&seq_id)
    }

    /// Whether any sequence is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Sequences waiting, running.
    pub fn num_waiting_running(&self) -> (usize, usize) {
        (self.waiting.len(), self.running.len())
    }

    /// What requests are checked against.
    pub fn capacity(&self) -> Capacity {
        Capacity {
            max_num_seqs: self.cfg.max_num_seqs,
            num_blocks: self.pool.num_blocks(),
            block_size: self.pool.block_size(),
        }
    }

    /// Queues a request as one sequence that forks into `n` when its prompt is computed.
    pub fn add_request(&mut self, req: SeqRequest) -> Result<SeqId, EngineError> {
        self.capacity()
            .check(req.prompt_ids.len(), req.n, req.max_tokens)?;
        let seq_id = self.next_seq_id;
        self.next_seq_id += 1;
        let seq = Sequence {
            seq_id,
            request_id: req.request_id,
            sample_index: 0,
            num_samples: req.n,
            num_prompt_tokens: req.prompt_ids.len(),
            token_ids: req.prompt_ids,
            num_computed_tokens: 0,
            block_table: Vec::new(),
            max_tokens: req.max_tokens,
            eos_token_ids: req.eos_token_ids,
            priority: req.priority,
        };
        self.seqs.insert(seq_id, seq);
        self.enqueue(seq_id, false);
        Ok(seq_id)
    }

    fn priority(&self, seq_id: SeqId) -> Priority {
        self.seqs[&seq_id].priority
    }

    /// Puts `seq_id` in the waiting queue at the front or the back of its priority class.
    fn enqueue(&mut self, seq_id: SeqId, front: bool) {
        let p = self.priority(seq_id);
        let pos = self
            .waiting
            .iter()
            .position(|&s| {
                let q = self.priority(s);
                q < p || (front && q == p)
            })
            .unwrap_or(self.waiting.len());
        self.waiting.insert(pos, seq_id);
    }

    /// Index in `running` after the last sequence of priority `p` or higher.
    fn running_slot(&self, p: Priority) -> usize {
        self.running
            .iter()
            .position(|&s| self.priority(s) < p)
            .unwrap_or(self.running.len())
    }

    /// Plans one iteration: running sequences first (highest priority, then oldest first),
    /// then admissions.
    pub fn schedule(&mut self) -> Plan {
        let mut plan = Plan::default();
        self.make_way_for_high_priority(&mut plan);
        let mut budget = self.cfg.max_batched_tokens;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let seq_id = self.running[i];
            if self.make_room(seq_id, budget, &mut plan) {
                budget -= plan.seqs.last().map_or(0, |s| s.num_new_tokens);
                i += 1;
            }
        }
        let mut seats = self.seats_taken();
        let isolate = self.cfg.isolate_high_priority && self.has_high_priority();
        while let Some(&seq_id) = self.waiting.front() {
            let seq = &self.seqs[&seq_id];
            let num_new = (seq.len() - seq.num_computed_tokens).min(budget);
            if num_new == 0
                || (isolate && seq.priority < Priority::High)
                || seats + seq.num_samples > self.cfg.max_num_seqs
                || !self
                    .pool
                    .can_append(&seq.block_table, seq.num_computed_tokens, num_new)
            {
                break;
            }
            seats += seq.num_samples;
            self.waiting.pop_front();
            let slot = self.running_slot(seq.priority);
            self.running.insert(slot, seq_id);
            self.push_scheduled(seq_id, num_new, &mut plan);
            budget -= num_new;
        }
        plan
    }

    fn has_high_priority(&self) -> bool {
        let high = |s: &SeqId| self.priority(*s) == Priority::High;
        self.waiting.front().is_some_and(high) || self.running.first().is_some_and(high)
    }

    /// Preempts normal-priority sequences for high-priority work: all of them under
    /// isolation, otherwise the newest until the first waiting high-priority sequence fits.
    fn make_way_for_high_priority(&mut self, plan: &mut Plan) {
        let isolate = self.cfg.isolate_high_priority && self.has_high_priority();
        let high_waiting = self
            .waiting
            .front()
            .is_some_and(|&s| self.priority(s) == Priority::High);
        if !isolate && !high_waiting {
            return;
        }
        while let Some(&victim) = self.running.last() {
            if self.priority(victim) == Priority::High || (!isolate && self.front_fits()) {
                break;
            }
            self.preempt(victim);
            plan.preempted.push(victim);
        }
    }

    /// Whether the first waiting sequence (if any) has seats and blocks for its next chunk.
    fn front_fits(&self) -> bool {
        let Some(seq) = self.waiting.front().map(|s| &self.seqs[s]) else {
            return true;
        };
        let num_new = (seq.len() - seq.num_computed_tokens).min(self.cfg.max_batched_tokens);
        self.seats_taken() + seq.num_samples <= self.cfg.max_num_seqs
            && self
                .pool
                .can_append(&seq.block_table, seq.num_computed_tokens, num_new)
    }

    /// Schedules running `seq_id`, preempting newer sequences (or itself, when it is the
    /// newest) until its blocks fit. Returns false when it was preempted itself.
    fn make_room(&mut self, seq_id: SeqId, budget: usize, plan: &mut Plan) -> bool {
        let seq = &self.seqs[&seq_id];
        let num_new = (seq.len() - seq.num_computed_tokens).min(budget);
        loop {
            let seq = &self.seqs[&seq_id];
            if self
                .pool
                .can_append(&seq.block_table, seq.num_computed_tokens, num_new)
            {
                self.push_scheduled(seq_id, num_new, plan);
                return true;
            }
            let victim = *self.running.last().expect("seq_id itself is running");
            self.preempt(victim);
            plan.preempted.push(victim);
            if victim == seq_id {
                return false;
            }
        }
    }

    fn push_scheduled(&mut self, seq_id: SeqId, num_new: usize, plan: &mut Plan) {
        let seq = self.seqs.get_mut(&seq_id).expect("live");
        let copy = self
            .pool
            .append_slots(&mut seq.block_table, seq.num_computed_tokens, num_new)
            .expect("caller checked can_append");
        plan.block_copies.extend(copy);
        let reaches_end = seq.num_computed_tokens + num_new == seq.len();
        plan.seqs.push(ScheduledSeq {
            seq_id,
            num_computed_tokens: seq.num_computed_tokens,
            num_new_tokens: num_new,
            num_samples: if reaches_end { seq.num_samples } else { 0 },
        });
    }

    /// The key/value positions `plan`'s attention reads: every scheduled sequence's context
    /// (cached and new tokens), a block that several sequences share (a group's prompt)
    /// counted once.
    pub fn attended_positions(&mut self, plan: &Plan) -> usize {
        let block_size = self.pool.block_size();
        let tables = plan.seqs.iter().map(|s| {
            let context = s.num_computed_tokens + s.num_new_tokens;
            let table = &self.seqs[&s.seq_id].block_table;
            (
                context,
                &table[..context.div_ceil(block_size).min(table.len())],
            )
        });
        let mut positions = 0;
        for (context, blocks) in tables.clone() {
            for (i, &block) in blocks.iter().enumerate() {
                if !std::mem::replace(&mut self.attended[block as usize], true) {
                    positions += block_size.min(context - i * block_size);
                }
            }
        }
        for (_, blocks) in tables {
            for &block in blocks {
                self.attended[block as usize] = false;
            }
        }
        positions
    }

    /// Frees the blocks of `seq_id` and sends it to the front of the waiting queue; it
    /// will be recomputed from its tokens (prompt and output so far).
    fn preempt(&mut self, seq_id: SeqId) {
        self.running.retain(|&s| s != seq_id);
        let seq = self.seqs.get_mut(&seq_id).expect("live");
        self.pool.free(&mut seq.block_table);
        seq.num_computed_tokens = 0;
        self.enqueue(seq_id, true);
        tracing::debug!(seq_id, "preempted (recompute)");
    }

    fn seats_taken(&self) -> usize {
        self.running
            .iter()
            .map(|id| self.seqs[id].num_samples)
            .sum()
    }

    /// Applies an iteration's results: marks the new tokens computed, appends the sampled
    /// tokens (`sampled[i]` for `plan.seqs[i]`, `num_samples` of them), forks groups whose
    /// prompt was just computed, and retires sequences that hit EOS or `max_tokens`.
    pub fn postprocess(&mut self, plan: &Plan, sampled: &[Vec<u32>]) -> Vec<Appended> {
        let mut appended = Vec::new();
        for (plan_idx, (s, tokens)) in plan.seqs.iter().zip(sampled).enumerate() {
            let Some(seq) = self.seqs.get_mut(&s.seq_id) else {
                continue; // cancelled between schedule and postprocess
            };
            seq.num_computed_tokens += s.num_new_tokens;
            debug_assert_eq!(tokens.len(), s.num_samples);
            for (sample_idx, &token_id) in tokens.iter().enumerate().rev() {
                let seq_id = if sample_idx == 0 {
                    s.seq_id
                } else {
                    self.fork(s.seq_id, sample_idx)
                };
                let finish = self.append(seq_id, token_id);
                let seq = &self.seqs[&seq_id];
                appended.push(Appended {
                    seq_id,
                    request_id: seq.request_id,
                    sample_index: seq.sample_index,
                    token_id,
                    plan_idx,
                    sample_idx,
                    finish,
                });
                if finish.is_some() {
                    self.finish(seq_id);
                }
            }
        }
        appended
    }

    /// A new running sequence sharing every block of `parent` (before its first sample).
    fn fork(&mut self, parent_id: SeqId, sample_index: usize) -> SeqId {
        let parent = &self.seqs[&parent_id];
        let mut child = parent.clone();
        child.seq_id = self.next_seq_id;
        child.sample_index = sample_index;
        child.num_samples = 1;
        child.block_table = self.pool.fork(&parent.block_table);
        self.next_seq_id += 1;
        let child_id = child.seq_id;
        self.seqs.insert(child_id, child);
        let pos = self
            .running
            .iter()
            .position(|&s| s == parent_id)
            .map_or(self.running.len(), |p| p + 1);
        self.running.insert(pos, child_id);
        child_id
    }

    fn append(&mut self, seq_id: SeqId, token_id: u32) -> Option<FinishReason> {
        let seq = self.seqs.get_mut(&seq_id).expect("live");
        seq.num_samples = 1;
        seq.token_ids.push(token_id);
        if seq.eos_token_ids.contains(&token_id) {
            Some(FinishReason::Stop)
        } else if seq.num_output_tokens() >= seq.max_tokens {
            Some(FinishReason::Length)
        } else {
            None
        }
    }

    /// Retires `seq_id` now (EOS, stop string, cancellation): its blocks return at once.
    pub fn finish(&mut self, seq_id: SeqId) -> Option<Sequence> {
        let mut seq = self.seqs.remove(&seq_id)?;
        self.running.retain(|&s| s != seq_id);
        self.waiting.retain(|&s| s != seq_id);
        self.pool.free(&mut seq.block_table);
        Some(seq)
    }

    /// Cancels every sequence of `request_id`; returns the ids retired.
    pub fn cancel(&mut self, request_id: RequestId) -> Vec<SeqId> {
        let ids: Vec<SeqId> = self
            .seqs
            .values()
            .filter(|s| s.request_id == request_id)
            .map(|s| s.seq_id)
            .collect();
        for &id in &ids {
            self.finish(id);
        }
        ids
    }
}

#[cfg(test)]
mod tests;
