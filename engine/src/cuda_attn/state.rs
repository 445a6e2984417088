//! The CUDA backend across iterations: the block tables' host mirror and device copy, and
//! one forward pass through the kernels per iteration.

use candle_core::{Device, Result, Tensor};
use dppo_model::CausalLm;

use super::copies::SlotCopies;
use super::padding::Padding;
use super::tables::{TableMirror, TableUpload};
#[cfg(any(all(test, target_os = "linux"), feature = "cuda"))]
use super::Extras;
use super::{AttentionKernel, Heads, KernelPlan};
use crate::cost::IterationCost;
#[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
use crate::device_timing;
use crate::generic_attn::TensorKvCache;
use crate::kv_pool::BlockCopy;
use crate::paged_attn::SeqAttnMeta;
use crate::sequence::SeqId;
use crate::EngineError;

/// The iteration's batch as the backend needs it.
pub struct Batch<'a> {
    pub metas: &'a [SeqAttnMeta],
    /// The scheduler's copy-on-write orders, carried out before the forward pass.
    pub block_copies: &'a [BlockCopy],
    /// The sequence of each meta.
    pub seq_ids: &'a [SeqId],
    pub slot_mapping: &'a [usize],
    /// Token ids and positions, padded where `padding` is.
    pub input_ids: &'a [u32],
    pub positions: &'a [u32],
    /// A decode step padded to its bucket (`engine.cuda_graphs`): the forward pass yields the
    /// real rows' logits.
    pub padding: Option<Padding>,
}

/// What a forward pass yields.
pub enum Output {
    /// The hidden states of the batch's rows.
    Hidden(Tensor),
    /// The logits of a padded decode step's real rows, every row sampling.
    Logits(Tensor),
}

/// The engine's switches the CUDA backend follows, as `EngineConfig`'s.
#[derive(Debug, Clone, Copy, Default)]
pub struct Switches {
    /// `EngineConfig::time_device`.
    pub time_device: bool,
    /// `engine.rope_kernel`: the projection's bias and rotation by `qkv_rope`.
    pub rope_kernel: bool,
    /// `engine.rope_writes_kv`: with `rope_kernel`, `qkv_rope` writes K and V into the pools.
    pub rope_writes_kv: bool,
    /// `engine.rope_qk_norm`: with `rope_kernel`, `qkv_rope` takes the q/k norms of the
    /// models that have them (Qwen3) too.
    pub rope_qk_norm: bool,
    /// `engine.layer_kernels`: the add-and-norm and the gated product by kernels of ours.
    pub layer_kernels: bool,
    /// `EngineConfig::attention_kernel`: the attention kernel's variant, `None` the default
    /// for the model and GPU.
    pub attention_kernel: Option<super::AttentionKernel>,
    /// `engine.cuda_graphs`: decode steps padded to a bucket and replayed from a captured
    /// CUDA graph (on the CPU's emulation, padded and run).
    pub cuda_graphs: bool,
}

/// What the CUDA backend keeps between iterations.
pub struct CudaAttention {
    tables: TableMirror,
    /// Blocks a grid should hold (twice the GPU's multiprocessors): the plan splits
    /// contexts until it does.
    min_blocks: usize,
    switches: Switches,
    /// The attention kernel's variant: the switches' choice, else the default for the model.
    variant: AttentionKernel,
    #[cfg(feature = "cuda")]
    device_tables: Option<super::device_buffers::DeviceTables>,
    /// The captured decode steps (`engine.cuda_graphs`).
    #[cfg(feature = "cuda")]
    graphs: super::graphs::Graphs,
    /// The emulated kernels' copy of the tables (the engine's unit tests on the CPU).
    #[cfg(all(test, target_os = "linux", not(feature = "cuda")))]
    emulated_tables: Option<Vec<u32>>,
}

impl CudaAttention {
    /// The backend for `model` on `device`; an error names what the kernels cannot serve.
    pub fn new(
        model: &CausalLm,
        device: &Device,
        switches: Switches,
    ) -> std::result::Result<Self, EngineError> {
        let heads = Heads::of(model.config());
        heads.check()?;
        let gpu = gpu(device)?;
        let variant = match switches.attention_kernel {
            Some(chosen) => chosen,
            None => AttentionKernel::default_for(heads, model.dtype(), gpu.tensor_cores),
        };
        variant.check_serves(heads, model.dtype())?;
        Ok(Self {
            tables: TableMirror::default(),
            min_blocks: 2 * gpu.multiprocessors,
            switches,
            variant,
            #[cfg(feature = "cuda")]
            device_tables: None,
            #[cfg(feature = "cuda")]
            graphs: super::graphs::Graphs::default(),
            #[cfg(all(test, target_os = "linux", not(feature = "cuda")))]
            emulated_tables: None,
        })
    }

    /// Drops the captured steps, which hold the weights' addresses: called when the model
    /// changes.
    pub fn forget_graphs(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        self.graphs.clear()?;
        Ok(())
    }

    /// The attention kernel's variant the launches use.
    pub fn variant(&self) -> AttentionKernel {
        self.variant
    }

    /// Runs `model` over `batch`, the kernels reading `cache`; `live` tells which sequences
    /// still exist (the others' table rows are freed). Adds the uploads and launches to
    /// `cost`. After an error the mirror may hold changes the device's copy never got, so
    /// both start afresh and the next iteration sends the whole table.
    pub fn forward(
        &mut self,
        model: &CausalLm,
        cache: &mut TensorKvCache,
        batch: &Batch<'_>,
        live: impl Fn(SeqId) -> bool,
        cost: &mut IterationCost,
    ) -> Result<Output> {
        let out = self.forward_in_step(model, cache, batch, live, cost);
        if out.is_err() {
            self.tables = TableMirror::default();
            #[cfg(feature = "cuda")]
            {
                self.device_tables = None;
            }
            #[cfg(all(test, target_os = "linux", not(feature = "cuda")))]
            {
                self.emulated_tables = None;
            }
        }
        out
    }

    fn forward_in_step(
        &mut self,
        model: &CausalLm,
        cache: &mut TensorKvCache,
        batch: &Batch<'_>,
        live: impl Fn(SeqId) -> bool,
        cost: &mut IterationCost,
    ) -> Result<Output> {
        let seqs: Vec<(SeqId, &[u32])> = batch
            .seq_ids
            .iter()
            .zip(batch.metas)
            .map(|(&s, m)| (s, m.block_table.as_slice()))
            .collect();
        let (rows, upload) = self.tables.update(&seqs, live);
        let mut plan = KernelPlan::new(
            batch.metas,
            (&rows, self.tables.width()),
            batch.slot_mapping,
            cache.shape(),
            Heads::of(model.config()),
            self.min_blocks,
        )
        .map_err(candle_core::Error::wrap)?;
        if let Some(padding) = batch.padding {
            let pool_slots = cache.shape().num_blocks * cache.shape().block_size;
            (padding.extend(&mut plan, self.min_blocks, pool_slots))
                .map_err(candle_core::Error::wrap)?;
            cost.padded_steps += 1;
        }
        let layers = model.config().num_hidden_layers as u64;
        cost.h2d_bytes += plan.upload_bytes()
            + match &upload {
                TableUpload::Whole => 4 * self.tables.host().len() as u64,
                TableUpload::Entries(pairs) => 4 * pairs.len() as u64,
            };
        let copies = SlotCopies::of(batch.block_copies, cache.shape().block_size);
        cost.h2d_bytes += 4 * copies.pairs.len() as u64;
        // The attention kernels of every layer, the table's scatter when entries changed, and
        // the copies in each layer's K and V pools; the backend counts the K/V writes.
        cost.attention_ops += plan.launches_per_layer() * layers
            + matches!(&upload, TableUpload::Entries(p) if !p.is_empty()) as u64
            + 2 * layers * u64::from(!copies.is_empty());
        self.launch(model, cache, batch, plan, (&upload, &copies, cost))
    }

    #[cfg(feature = "cuda")]
    fn launch(
        &mut self,
        model: &CausalLm,
        cache: &mut TensorKvCache,
        batch: &Batch<'_>,
        plan: KernelPlan,
        (upload, copies, cost): (&TableUpload, &SlotCopies, &mut IterationCost),
    ) -> Result<Output> {
        use super::device_buffers::CudaIndex;
        use super::launch::{copy_slots, CudaPagedAttention};
        let device = model.device();
        copy_slots(cache, copies, &plan)?;
        let tables = upload.apply(&mut self.device_tables, self.tables.host(), device)?;
        if batch.padding.is_some() {
            let step = super::graphs::Step {
                model,
                cache,
                tables,
                inputs: (batch.input_ids, batch.positions),
                real_rows: batch.metas.len(),
                switches: self.switches,
                variant: self.variant,
            };
            return self.graphs.run(step, plan, cost).map(Output::Logits);
        }
        let index = CudaIndex::new(plan, device)?;
        let mut backend = CudaPagedAttention {
            cache,
            index: &index,
            tables,
            extras: Extras::of(self.switches),
            variant: self.variant,
        };
        let inputs = inputs(batch, device)?;
        let time = self.switches.time_device;
        let out = device_timing::forward(model, (&inputs.0, &inputs.1), &mut backend, time, cost);
        backend.extras.count(cost);
        out.map(Output::Hidden)
    }

    #[cfg(not(feature = "cuda"))]
    fn launch(
        &mut self,
        model: &CausalLm,
        cache: &mut TensorKvCache,
        batch: &Batch<'_>,
        plan: KernelPlan,
        (upload, copies, cost): (&TableUpload, &SlotCopies, &mut IterationCost),
    ) -> Result<Output> {
        // In the engine's unit tests the CPU runs the kernels' source (`super::emulated`); a
        // padded step runs as its captured graph would, without the capture.
        #[cfg(all(test, target_os = "linux"))]
        {
            super::emulated::copy_blocks(cache, copies, &plan)?;
            let host = self.tables.host();
            let tables = upload.apply(&mut self.emulated_tables, host, model.device())?;
            let mut backend = super::emulated::Backend {
                cache,
                plan: &plan,
                tables,
                extras: Extras::of(self.switches),
                variant: self.variant,
            };
            let inputs = inputs(batch, model.device())?;
            let time = self.switches.time_device;
            let out =
                device_timing::forward(model, (&inputs.0, &inputs.1), &mut backend, time, cost);
            backend.extras.count(cost);
            match batch.padding {
                Some(_) => Ok(Output::Logits(model.logits(&out?)?.narrow(
                    0,
                    0,
                    batch.metas.len(),
                )?)),
                None => out.map(Output::Hidden),
            }
        }
        #[cfg(not(all(test, target_os = "linux")))]
        {
            let _ = (model, cache, batch, plan, upload, copies, cost);
            let _ = self.switches;
            candle_core::bail!("cuda attention in a build without CUDA")
        }
    }
}

/// The batch's token ids and positions as tensors on `device`.
#[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
fn inputs(batch: &Batch<'_>, device: &Device) -> Result<(Tensor, Tensor)> {
    Ok((
        Tensor::from_slice(batch.input_ids, batch.input_ids.len(), device)?,
        Tensor::from_slice(batch.positions, batch.positions.len(), device)?,
    ))
}

/// What the kernels' launches depend on of the GPU.
struct Gpu {
    /// The plan splits contexts until the grid fills them twice.
    multiprocessors: usize,
    /// Whether it runs the tensor-core kernels (sm_80 on).
    tensor_cores: bool,
}

#[cfg(feature = "cuda")]
fn gpu(device: &Device) -> Result<Gpu> {
    use super::device_buffers::{multiprocessors, tensor_cores};
    match device {
        Device::Cuda(d) => Ok(Gpu {
            multiprocessors: multiprocessors(d)?,
            tensor_cores: tensor_cores(d)?,
        }),
        _ => candle_core::bail!("cuda attention on {:?}", device.location()),
    }
}

#[cfg(not(feature = "cuda"))]
fn gpu(device: &Device) -> Result<Gpu> {
    // The engine's unit tests emulate the kernels on the CPU, the tensor-core ones too.
    #[cfg(all(test, target_os = "linux"))]
    if device.is_cpu() {
        return Ok(Gpu {
            multiprocessors: super::emulated::MULTIPROCESSORS,
            tensor_cores: true,
        });
    }
    candle_core::bail!(
        "cuda attention in a build without CUDA, on {:?}",
        device.location()
    )
}
