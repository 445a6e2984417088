//! The naive baseline, as HF `generate` does it: each sample keeps a contiguous K/V cache
//! grown by concatenation every step, the batch is static (it runs until its longest member
//! is done) and padded to the longest prompt, and every sample prefills its prompt again.
//! Used as the benchmark baseline and as the contiguous-cache reference in tests.

use candle_core::{Device, Result, Tensor};
use dppo_model::attention::causal_attention;
use dppo_model::{AttentionBackend, CausalLm};

use crate::device_sample::SamplingPlace;
use crate::gumbel::{self, DrawKey, DrawParams};
use crate::request::{Completion, GenerateRequest};
use crate::sampler::{sample, stream_seed, SeqRng};
use crate::sequence::FinishReason;

/// Per-sample contiguous caches for one static batch.
struct ContiguousAttention {
    /// `cache[s][layer]` = (K, V), each (tokens, kv_heads, head_dim).
    cache: Vec<Vec<Option<(Tensor, Tensor)>>>,
    /// Rows of the batch per sample, in order.
    num_new: Vec<usize>,
}

impl AttentionBackend for ContiguousAttention {
    fn attend(&mut self, layer_idx: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let mut outs = Vec::with_capacity(self.num_new.len());
        let mut row = 0;
        for (s, &n) in self.num_new.iter().enumerate() {
            let (k_new, v_new) = (k.narrow(0, row, n)?, v.narrow(0, row, n)?);
            let (k_all, v_all, num_cached) = match self.cache[s][layer_idx].take() {
                Some((kc, vc)) => {
                    let cached = kc.dim(0)?;
                    (
                        Tensor::cat(&[kc, k_new], 0)?,
                        Tensor::cat(&[vc, v_new], 0)?,
                        cached,
                    )
                }
                None => (k_new, v_new, 0),
            };
            outs.push(causal_attention(
                &q.narrow(0, row, n)?,
                &k_all,
                &v_all,
                num_cached,
            )?);
            self.cache[s][layer_idx] = Some((k_all, v_all));
            row += n;
        }
        Tensor::cat(&outs, 0)
    }
}

impl ContiguousAttention {
    /// Keeps the first `len` cached tokens of sample `s` (drops prefill padding).
    fn truncate(&mut self, s: usize, len: usize) -> Result<()> {
        for slot in self.cache[s].iter_mut() {
            if let Some((k, v)) = slot.take() {
                *slot = Some((k.narrow(0, 0, len)?, v.narrow(0, 0, len)?));
            }
        }
        Ok(())
    }
}

/// Generates every request of `reqs` as one static batch; `eos` ends a sample unless the
/// request ignores EOS. Samples draw from `SeqRng::new(seed, i)` like the engine does.
pub fn generate_naive(
    model: &CausalLm,
    reqs: &[GenerateRequest],
    eos: &[u32],
    device: &Device,
) -> Result<Vec<Vec<Completion>>> {
    generate_naive_on(model, reqs, eos, device, SamplingPlace::Host)
}

/// [`generate_naive`] drawing as the engine does with `engine.sampling = place`: with
/// `Device`, by the Gumbel sampler keyed by each sample's seed stream, position and index
/// (seeded requests draw what the engine draws; unseeded ones use seed 0 here).
pub fn generate_naive_on(
    model: &CausalLm,
    reqs: &[GenerateRequest],
    eos: &[u32],
    device: &Device,
    place: SamplingPlace,
) -> Result<Vec<Vec<Completion>>> {
    // One row per sample: (request index, sample index).
    let samples: Vec<(usize, usize)> = reqs
        .iter()
        .enumerate()
        .flat_map(|(r, req)| (0..req.n).map(move |i| (r, i)))
        .collect();
    let num_layers = model.config().num_hidden_layers;
    let mut backend = ContiguousAttention {
        cache: vec![vec![None; num_layers]; samples.len()],
        num_new: Vec::new(),
    };
    let mut rngs: Vec<SeqRng> = samples
        .iter()
        .map(|&(r, i)| match reqs[r].sampling.seed {
            Some(seed) => SeqRng::new(seed, i as u64),
            None => SeqRng::from_entropy(),
        })
        .collect();
    let mut outputs: Vec<Completion> = samples.iter().map(|&(_, i)| Completion::empty(i)).collect();
    let mut done = vec![false; samples.len()];
    // 1. Prefill, padded to the longest prompt (pad rows are computed, then dropped).
    let max_prompt = reqs.iter().map(|r| r.prompt_ids.len()).max().unwrap_or(0);
    let mut ids = Vec::new();
    for &(r, _) in &samples {
        let p = &reqs[r].prompt_ids;
        ids.extend_from_slice(p);
        ids.extend(std::iter::repeat_n(0u32, max_prompt - p.len()));
    }
    backend.num_new = vec![max_prompt; samples.len()];
    let positions: Vec<u32> = (0..samples.len())
        .flat_map(|_| 0..max_prompt as u32)
        .collect();
    let mut last_rows: Vec<usize> = samples
        .iter()
        .enumerate()
        .map(|(s, &(r, _))| s * max_prompt + reqs[r].prompt_ids.len() - 1)
        .collect();
    let mut hidden = forward(model, ids, positions, &mut backend, device)?;
    for (s, &(r, _)) in samples.iter().enumerate() {
        backend.truncate(s, reqs[r].prompt_ids.len())?;
    }
    // 2. Decode one token per sample per step until the longest sample is done; finished
    //    samples keep running (a static batch) but their tokens are discarded.
    let max_new = reqs.iter().map(|r| r.max_tokens).max().unwrap_or(0);
    let on_device = place.on_device(device);
    for step in 0..max_new {
        let idx = Tensor::new(
            last_rows.iter().map(|&r| r as u32).collect::<Vec<_>>(),
            device,
        )?;
        let logits = model
            .logits(&hidden.index_select(&idx, 0)?)?
            .to_vec2::<f32>()?;
        let mut next = Vec::with_capacity(samples.len());
        for (s, &(r, i)) in samples.iter().enumerate() {
            let req = &reqs[r];
            let drawn = if on_device {
                let key = DrawKey {
                    key: stream_seed(req.sampling.seed.unwrap_or(0), i as u64),
                    position: (req.prompt_ids.len() + step) as u32,
                    sample_index: i as u32,
                };
                let params = DrawParams::of(&req.sampling);
                gumbel::sampled(gumbel::draw(&logits[s], &params, &key), false)
            } else {
                sample(&logits[s], &req.sampling, &mut rngs[s])
            };
            let out = &mut outputs[s];
            if !done[s] {
                out.token_ids.push(drawn.token_id);
                out.logprobs.push(drawn.logprob);
                let finish = if !req.ignore_eos && eos.contains(&drawn.token_id) {
                    Some(FinishReason::Stop)
                } else if out.token_ids.len() == req.max_tokens {
                    Some(FinishReason::Length)
                } else {
                    None
                };
                if let Some(reason) = finish {
                    out.finish_reason = reason;
                    done[s] = true;
                }
            }
            next.push(drawn.token_id);
        }
        if step + 1 == max_new || done.iter().all(|&d| d) {
            break;
        }
        let positions: Vec<u32> = samples
            .iter()
            .map(|&(r, _)| (reqs[r].prompt_ids.len() + step) as u32)
            .collect();
        backend.num_new = vec![1; samples.len()];
        hidden = forward(model, next, positions, &mut backend, device)?;
        last_rows = (0..samples.len()).collect();
    }
    // 3. Regroup by request.
    let mut grouped: Vec<Vec<Completion>> = reqs.iter().map(|_| Vec::new()).collect();
    for (&(r, _), out) in samples.iter().zip(outputs) {
        grouped[r].push(out);
    }
    Ok(grouped)
}

fn forward(
    model: &CausalLm,
    ids: Vec<u32>,
    positions: Vec<u32>,
    backend: &mut ContiguousAttention,
    device: &Device,
) -> Result<Tensor> {
    let n = ids.len();
    let ids = Tensor::from_vec(ids, n, device)?;
    let positions = Tensor::from_vec(positions, n, device)?;
    model.forward(&ids, &positions, backend)
}
