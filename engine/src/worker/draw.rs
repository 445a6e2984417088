//! The sampling stage of an iteration: every scheduled sample's next token, drawn on the
//! device in one launch or on the host from each sample's own RNG.

use dppo_model::parallel::multi_threaded;
use rayon::prelude::*;

use super::Worker;
use crate::cost::IterationCost;
use crate::device_sample::{self, DeviceDraw, SampleKernel};
use crate::gumbel::{self, DrawKey, DrawParams};
use crate::plan::{Plan, ScheduledSeq};
use crate::runner::Logits;
use crate::sampler::{sample, Sampled, SamplingParams, SeqRng};
use crate::sequence::{RequestId, Sequence};
use crate::EngineError;

/// The first sample index `s` draws for: a forking group's row draws for all its samples,
/// any other row for its own sample.
fn first_sample(s: &ScheduledSeq, seq: &Sequence) -> usize {
    if s.num_samples > 1 {
        0
    } else {
        seq.sample_index
    }
}

impl Worker {
    /// Draws every sample of the iteration on the device (one kernel launch), in the shape
    /// [`Worker::draw_all`] returns: per plan sequence, its draws in sample order.
    pub(super) fn draw_on_device(
        &self,
        plan: &Plan,
        logits: &Logits,
        kernel: SampleKernel,
        cost: &mut IterationCost,
    ) -> Result<Vec<Vec<Sampled>>, EngineError> {
        let mut draws = Vec::new();
        let mut owners = Vec::new();
        for (p, s) in plan.seqs.iter().enumerate() {
            let Some(row) = logits.row(p) else { continue };
            let seq = self.scheduler.seq(s.seq_id).expect("live");
            let state = &self.requests[&seq.request_id];
            let params = &state.req.sampling;
            let first = first_sample(s, seq);
            for i in first..first + s.num_samples {
                draws.push(DeviceDraw {
                    row,
                    key: DrawKey {
                        key: state.keys[i],
                        position: (s.num_computed_tokens + s.num_new_tokens) as u32,
                        sample_index: i as u32,
                    },
                    params: DrawParams::of(params),
                });
                owners.push((p, params.model_logprobs));
            }
        }
        let rows = logits.rows().expect("a plan with draws has logits");
        let drawn = device_sample::sample(rows, &draws, kernel)?;
        // Per draw: its row, key, counters, temperature, top-k, top-p, min-p and top-logprob
        // count up; token and two logprobs down, and the top logprobs' slots when asked.
        cost.h2d_bytes += (40 * draws.len()) as u64;
        let tops = draws.iter().any(|d| d.params.top_logprobs > 0);
        cost.d2h_bytes += ((12 + 160 * tops as usize) * draws.len()) as u64;
        // The result copies, each waiting for the kernel.
        cost.syncs += 3 + 2 * tops as u64;
        let mut sampled = vec![Vec::new(); plan.seqs.len()];
        for ((p, model_logprobs), d) in owners.into_iter().zip(drawn) {
            sampled[p].push(gumbel::sampled(d, model_logprobs));
        }
        Ok(sampled)
    }

    /// Samples every row of the iteration, in parallel when rayon has several threads. Each
    /// sample draws from its own RNG (a forking group's row is drawn once per sample), so no
    /// result depends on the batch.
    pub(super) fn draw_all(&mut self, plan: &Plan, logits: &[Option<&[f32]>]) -> Vec<Vec<Sampled>> {
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
                let first = first_sample(s, seq);
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
                let first = first_sample(s, seq);
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
}
