//! The only place where a plan becomes tensors: input ids, positions, slot mapping and
//! block tables in; one forward pass; the logits rows to sample from out.

use candle_core::{Device, Result, Tensor};
use dppo_model::CausalLm;

use crate::paged_attn::{CacheShape, KvCache, PagedAttention, SeqAttnMeta};
use crate::plan::Plan;
use crate::scheduler::Scheduler;

/// The model and its paged KV cache.
pub struct Runner {
    model: CausalLm,
    cache: KvCache,
    device: Device,
}

impl Runner {
    /// A runner with a zeroed cache of `num_blocks` blocks of `block_size` tokens.
    pub fn new(model: CausalLm, num_blocks: usize, block_size: usize, device: Device) -> Self {
        let cfg = model.config();
        let shape = CacheShape {
            num_layers: cfg.num_hidden_layers,
            num_blocks,
            block_size,
            num_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
        };
        Self {
            model,
            cache: KvCache::new(shape),
            device,
        }
    }

    /// Replaces the model (same architecture); called between iterations only.
    pub fn set_model(&mut self, model: CausalLm) {
        self.model = model;
    }

    /// The model in use.
    pub fn model(&self) -> &CausalLm {
        &self.model
    }

    /// Runs `plan`. Returns, for each scheduled sequence that samples, the logits row
    /// (vocab,) of its last new token; `None` for prefill chunks that sample nothing.
    pub fn run(&mut self, plan: &Plan, scheduler: &Scheduler) -> Result<Vec<Option<Vec<f32>>>> {
        self.cache.copy_blocks(&plan.block_copies);
        let bs = self.cache.shape().block_size;
        let mut input_ids = Vec::with_capacity(plan.num_tokens());
        let mut positions = Vec::with_capacity(plan.num_tokens());
        let mut slot_mapping = Vec::with_capacity(plan.num_tokens());
        let mut metas = Vec::with_capacity(plan.seqs.len());
        let mut sample_rows = Vec::new();
        for s in &plan.seqs {
            let seq = scheduler
                .seq(s.seq_id)
                .expect("scheduled sequences are live");
            let span = s.num_computed_tokens..s.num_computed_tokens + s.num_new_tokens;
            metas.push(SeqAttnMeta {
                first_row: input_ids.len(),
                num_new_tokens: s.num_new_tokens,
                num_computed_tokens: s.num_computed_tokens,
                block_table: seq.block_table.clone(),
            });
            input_ids.extend_from_slice(&seq.token_ids[span.clone()]);
            for p in span {
                positions.push(p as u32);
                slot_mapping.push(seq.block_table[p / bs] as usize * bs + p % bs);
            }
            if s.num_samples > 0 {
                sample_rows.push(input_ids.len() as u32 - 1);
            }
        }
        let n = input_ids.len();
        let input_ids = Tensor::from_vec(input_ids, n, &self.device)?;
        let positions = Tensor::from_vec(positions, n, &self.device)?;
        let mut backend = PagedAttention {
            cache: &mut self.cache,
            seqs: &metas,
            slot_mapping: &slot_mapping,
        };
        let hidden = self.model.forward(&input_ids, &positions, &mut backend)?;
        // Logits only where a token is sampled: the lm_head is a large share of the FLOPs.
        let mut rows = if sample_rows.is_empty() {
            Vec::new().into_iter()
        } else {
            let idx = Tensor::new(sample_rows.as_slice(), &self.device)?;
            let logits = self.model.logits(&hidden.index_select(&idx, 0)?)?;
            logits.to_vec2::<f32>()?.into_iter()
        };
        Ok(plan
            .seqs
            .iter()
            .map(|s| if s.num_samples > 0 { rows.next() } else { None })
            .collect())
    }
}
