//! The only place where a plan becomes tensors: input ids, positions, slot mapping and
//! block tables in; one forward pass; the logits rows to sample from out.

use std::time::Instant;

use candle_core::{CpuStorage, DType, Device, Result, Storage, Tensor};
use dppo_model::CausalLm;
use serde::{Deserialize, Serialize};

use crate::cost::{nanos, IterationCost};
use crate::cuda_attn::padding::Padding;
use crate::cuda_attn::{Batch, CudaAttention, Heads, Output, Switches};
use crate::device_timing;
use crate::generic_attn::{BatchIndex, GenericPagedAttention, TensorKvCache};
use crate::paged_attn::{CacheShape, KvCache, PagedAttention, SeqAttnMeta};
use crate::plan::Plan;
use crate::scheduler::Scheduler;
use crate::sequence::SeqId;
use crate::EngineError;

/// Which attention backend the engine runs (`engine.attention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttentionMode {
    /// The CPU kernel for f32 on the CPU; on a GPU of a CUDA build the paged CUDA kernels
    /// where they take the model's heads; the generic path everywhere else.
    #[default]
    Auto,
    /// The CPU kernel: f32 on the CPU only.
    Cpu,
    /// The device-generic path made of tensor ops, on any device and dtype.
    Generic,
    /// The paged CUDA kernels (kernels/paged_attention.cu): f32, bf16 or f16 on a GPU of a
    /// CUDA build (checked on an H200: docs/results.md).
    Cuda,
}

impl AttentionMode {
    /// The backend to run a model of `heads` on `device` with the cache in `dtype`: `Auto`
    /// resolved, and an error where the backend asked for cannot run.
    pub fn resolve(
        self,
        device: &Device,
        dtype: DType,
        heads: &Heads,
    ) -> std::result::Result<Self, EngineError> {
        let cpu_kernel_fits = device.is_cpu() && dtype == DType::F32;
        let cuda_kernels_fit = device.is_cuda() && cfg!(feature = "cuda") && heads.check().is_ok();
        match self {
            Self::Auto if cpu_kernel_fits => Ok(Self::Cpu),
            Self::Auto if cuda_kernels_fit => Ok(Self::Cuda),
            Self::Auto | Self::Generic => Ok(Self::Generic),
            Self::Cpu if cpu_kernel_fits => Ok(Self::Cpu),
            Self::Cpu => Err(EngineError::InvalidConfig(format!(
                "engine.attention = \"cpu\" runs f32 on the CPU only, not {dtype:?} on {:?}; \
                 use \"auto\" or \"generic\"",
                device.location()
            ))),
            Self::Cuda if device.is_cuda() && cfg!(feature = "cuda") => Ok(Self::Cuda),
            // The engine's unit tests run the kernels' source on the CPU (cuda_attn/emulated).
            Self::Cuda
                if device.is_cpu()
                    && cfg!(all(test, target_os = "linux", not(feature = "cuda"))) =>
            {
                Ok(Self::Cuda)
            }
            Self::Cuda => Err(EngineError::InvalidConfig(format!(
                "engine.attention = \"cuda\" runs on a GPU of a CUDA build, not on {:?}; use \
                 \"auto\" or \"generic\"",
                device.location()
            ))),
        }
    }
}

/// The paged KV cache in the form its attention backend reads.
enum Cache {
    /// Host floats for the CPU kernel.
    Cpu(KvCache),
    /// Device tensors for the generic path.
    Tensor(TensorKvCache),
}

/// The model and its paged KV cache.
pub struct Runner {
    model: CausalLm,
    cache: Cache,
    /// The CUDA kernels' state, where `engine.attention` resolved to them.
    cuda: Option<CudaAttention>,
    /// `EngineConfig::time_device`.
    time_device: bool,
    /// With `engine.cuda_graphs` on the CUDA kernels: the pool's block past the scheduler's,
    /// where padded decode steps' pad rows write.
    scratch_block: Option<usize>,
    device: Device,
}

impl Runner {
    /// A runner with a zeroed cache of `num_blocks` blocks of `block_size` tokens, in the
    /// model's dtype, read by the `attention` backend (see [`AttentionMode::resolve`]);
    /// `switches` as `EngineConfig`'s.
    pub fn new(
        model: CausalLm,
        (num_blocks, block_size): (usize, usize),
        attention: AttentionMode,
        switches: Switches,
        device: Device,
    ) -> std::result::Result<Self, EngineError> {
        let cfg = model.config();
        let attention = attention.resolve(&device, model.dtype(), &Heads::of(model.config()))?;
        let graphs = switches.cuda_graphs && attention == AttentionMode::Cuda;
        let scratch_block = graphs.then_some(num_blocks);
        let shape = CacheShape {
            num_layers: cfg.num_hidden_layers,
            num_blocks: num_blocks + usize::from(graphs),
            block_size,
            num_kv_heads: cfg.num_key_value_heads,
            head_dim: cfg.head_dim,
        };
        let cuda = match attention {
            AttentionMode::Cuda => Some(CudaAttention::new(&model, &device, switches)?),
            _ => None,
        };
        let cache = match attention {
            AttentionMode::Cpu => Cache::Cpu(KvCache::new(shape)),
            _ => Cache::Tensor(TensorKvCache::new(shape, model.dtype(), &device)?),
        };
        Ok(Self {
            cuda,
            model,
            cache,
            time_device: switches.time_device,
            scratch_block,
            device,
        })
    }

    /// The paged attention kernel's variant, where the CUDA kernels run.
    pub fn attention_kernel(&self) -> Option<crate::AttentionKernel> {
        self.cuda.as_ref().map(CudaAttention::variant)
    }

    /// Replaces the model (same architecture); called between iterations only. Captured
    /// decode steps, which hold the old weights' addresses, are dropped.
    pub fn set_model(&mut self, model: CausalLm) -> Result<()> {
        let forgotten = match &mut self.cuda {
            Some(cuda) => cuda.forget_graphs(),
            None => Ok(()),
        };
        self.model = model;
        forgotten
    }

    /// Runs `plan`'s forward pass: the logits of the last new token of every scheduled
    /// sequence that samples (prefill chunks that sample nothing have none), fetched to the
    /// host, or left on the device for [`crate::device_sample`] with `on_device`; the time
    /// and the bytes moved are added to `cost`.
    pub fn run(
        &mut self,
        plan: &Plan,
        scheduler: &Scheduler,
        cost: &mut IterationCost,
        on_device: bool,
    ) -> Result<Logits> {
        let started = Instant::now();
        let bs = match &self.cache {
            Cache::Cpu(c) => c.shape().block_size,
            Cache::Tensor(c) => c.shape().block_size,
        };
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
        // A decode step padded to its bucket is replayed from a captured graph (not while
        // the device is timed: the timing synchronises inside the step).
        let padding = match self.scratch_block {
            Some(block) if !self.time_device => Padding::of(plan, block, bs),
            _ => None,
        };
        if let Some(padding) = padding {
            padding.inputs(&mut input_ids, &mut positions);
        }
        let n = input_ids.len();
        // Ids, positions and the sampled rows' indices (none padded: every row samples), 4
        // bytes each.
        let indices = if padding.is_some() {
            0
        } else {
            sample_rows.len()
        };
        cost.h2d_bytes += 4 * (2 * n + indices) as u64;
        let time = self.time_device;
        let tensors = |ids: Vec<u32>, positions: Vec<u32>| -> Result<(Tensor, Tensor)> {
            Ok((
                Tensor::from_vec(ids, n, &self.device)?,
                Tensor::from_vec(positions, n, &self.device)?,
            ))
        };
        let out = match (&mut self.cache, &mut self.cuda) {
            (Cache::Cpu(cache), _) => {
                cache.copy_blocks(&plan.block_copies);
                let mut backend = PagedAttention {
                    cache,
                    seqs: &metas,
                    slot_mapping: &slot_mapping,
                };
                let (ids, positions) = tensors(input_ids, positions)?;
                let inputs = (&ids, &positions);
                let hidden = device_timing::forward(&self.model, inputs, &mut backend, time, cost)?;
                Output::Hidden(hidden)
            }
            (Cache::Tensor(cache), Some(cuda)) => {
                let seq_ids: Vec<SeqId> = plan.seqs.iter().map(|s| s.seq_id).collect();
                let batch = Batch {
                    metas: &metas,
                    block_copies: &plan.block_copies,
                    seq_ids: &seq_ids,
                    slot_mapping: &slot_mapping,
                    input_ids: &input_ids,
                    positions: &positions,
                    padding,
                };
                let live = |id| scheduler.seq(id).is_some();
                cuda.forward(&self.model, cache, &batch, live, cost)?
            }
            (Cache::Tensor(cache), None) => {
                cache.copy_blocks(&plan.block_copies)?;
                let index = BatchIndex::new(&metas, &slot_mapping, cache.shape(), &self.device)?;
                cost.h2d_bytes += index.bytes() as u64;
                let mut backend = GenericPagedAttention {
                    cache,
                    index: &index,
                    ops: 0,
                };
                let (ids, positions) = tensors(input_ids, positions)?;
                let inputs = (&ids, &positions);
                let hidden = device_timing::forward(&self.model, inputs, &mut backend, time, cost)?;
                cost.attention_ops += backend.ops;
                Output::Hidden(hidden)
            }
        };
        // Logits only where a token is sampled: the lm_head is a large share of the FLOPs.
        // Only those rows come to the host, as f32 whatever the engine's dtype; sampled on
        // the device, they stay as computed (the kernel reads bf16 itself).
        let logits = match out {
            _ if sample_rows.is_empty() => None,
            Output::Logits(logits) => Some(logits),
            Output::Hidden(hidden) => {
                let idx = Tensor::new(sample_rows.as_slice(), &self.device)?;
                Some(self.model.logits(&hidden.index_select(&idx, 0)?)?)
            }
        };
        let rows = match logits {
            None => None,
            Some(logits) => {
                let logits = if on_device {
                    logits
                } else {
                    logits.to_dtype(DType::F32)?
                };
                if time {
                    self.device.synchronize()?;
                }
                cost.forward_ns += nanos(started);
                if on_device {
                    Some(logits)
                } else {
                    let fetching = Instant::now();
                    let rows = logits.to_device(&Device::Cpu)?.contiguous()?;
                    cost.fetch_ns += nanos(fetching);
                    cost.d2h_bytes += (4 * rows.elem_count()) as u64;
                    cost.syncs += 1;
                    Some(rows)
                }
            }
        };
        if rows.is_none() {
            cost.forward_ns += nanos(started);
        }
        let mut next = 0..;
        let row_of = plan
            .seqs
            .iter()
            .map(|s| (s.num_samples > 0).then(|| next.next().expect("unbounded")))
            .collect();
        Ok(Logits { rows, row_of })
    }
}

/// An iteration's logits: (rows, vocab) f32 on the host (on the device in the model's dtype
/// when sampled there), one row per sampling sequence, read in place (a copy of a batch's rows would be 25 MB a step for SmolLM2).
pub struct Logits {
    rows: Option<Tensor>,
    /// For each sequence of the plan, its row (`None` where it samples nothing).
    row_of: Vec<Option<usize>>,
}

impl Logits {
    /// The row of plan sequence `p`, if it samples.
    pub fn row(&self, p: usize) -> Option<u32> {
        self.row_of[p].map(|r| r as u32)
    }

    /// The rows as computed: (rows, vocab) f32 on the host, or on the device in the model's
    /// dtype when kept there.
    pub fn rows(&self) -> Option<&Tensor> {
        self.rows.as_ref()
    }

    /// `f` of each plan sequence's logits row, in plan order.
    pub fn with_rows<T>(&self, f: impl FnOnce(&[Option<&[f32]>]) -> T) -> Result<T> {
        let Some(rows) = &self.rows else {
            return Ok(f(&vec![None; self.row_of.len()]));
        };
        let vocab = rows.dim(1)?;
        let (storage, layout) = rows.storage_and_layout();
        let (Storage::Cpu(CpuStorage::F32(data)), Some((start, end))) =
            (&*storage, layout.contiguous_offsets())
        else {
            candle_core::bail!("logits: expected contiguous f32 on the host");
        };
        let data = &data[start..end];
        let rows: Vec<Option<&[f32]>> = self
            .row_of
            .iter()
            .map(|r| r.map(|r| &data[r * vocab..(r + 1) * vocab]))
            .collect();
        Ok(f(&rows))
    }
}
