//! Decode steps replayed from CUDA graphs (`engine.cuda_graphs`): a padded decode step
//! ([`super::padding`]) is run once and captured at the first step of its shape, then each
//! step of that shape writes its token ids, positions, tiles and slots into the buffers the
//! graph reads and launches it, where the op-by-op path queues some twenty candle ops a
//! layer. What a step changes lives in those buffers; what the graph holds by value (the
//! plan's scalars, the block tables' address, the weights' addresses) is its [`Key`], or
//! drops the graphs when it changes ([`Graphs::clear`], at each new model).

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{sys, CudaGraph, DevicePtr};
use candle_core::cuda_backend::{CudaStorage, WrapErr};
use candle_core::{bail, CpuStorage, InplaceOp1, Layout, Result, Tensor};
use dppo_model::CausalLm;

use super::device_buffers::{cuda, CudaIndex, DeviceTables};
use super::launch::CudaPagedAttention;
use super::{AttentionKernel, Extras, KernelPlan, Switches};
use crate::cost::IterationCost;
use crate::device_timing;
use crate::generic_attn::TensorKvCache;

/// Graphs kept at once: a shape per batch bucket and context length in use; the least
/// recently used goes first.
const MAX_GRAPHS: usize = 16;

/// One padded decode step as the launcher has it.
pub(super) struct Step<'a> {
    pub model: &'a CausalLm,
    pub cache: &'a mut TensorKvCache,
    pub tables: &'a DeviceTables,
    /// Token ids and positions, padded to the plan's rows.
    pub inputs: (&'a [u32], &'a [u32]),
    /// The rows that sample: the first ones.
    pub real_rows: usize,
    pub switches: Switches,
    pub variant: AttentionKernel,
}

/// What a captured step holds by value: the plan's launch scalars and the block tables'
/// address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Key {
    rows: usize,
    splits: usize,
    split_len: usize,
    table_width: usize,
    max_pairs: usize,
    tables: u64,
}

impl Key {
    fn of(plan: &KernelPlan, tables: &DeviceTables) -> Self {
        let stream = tables.table.stream();
        let (tables, _sync) = tables.table.device_ptr(stream);
        Self {
            rows: plan.rows,
            splits: plan.splits,
            split_len: plan.split_len,
            table_width: plan.table_width,
            max_pairs: plan.max_pairs,
            tables,
        }
    }
}

/// A captured step and the buffers it reads and writes.
struct Captured {
    key: Key,
    graph: Graph,
    /// (2 x rows) u32: the token ids, then the positions.
    inputs: Tensor,
    /// The tiles, slots and partial outputs the attention reads.
    index: CudaIndex,
    /// (rows, vocab): the step's logits.
    logits: Tensor,
    /// The attention's and the layer kernels' launches in the graph.
    launches: (u64, u64),
    /// When it last ran ([`Graphs::tick`]).
    used: u64,
}

/// An instantiated graph, moved with the engine's runner to its worker thread.
struct Graph(CudaGraph);

// SAFETY: a CUDA graph and its executable are driver handles that any thread may use once
// it binds their context, as `CudaGraph::launch` does; cudarc leaves them `!Send` only
// because they hold raw pointers. The engine uses them from one thread at a time.
unsafe impl Send for Graph {}

/// The captured decode steps of one engine.
#[derive(Default)]
pub(crate) struct Graphs {
    captured: Vec<Captured>,
    tick: u64,
}

impl Graphs {
    /// `step` under `plan` (padded): its graph replayed with the step's inputs, or the step
    /// run and captured where no graph has its key. Returns the real rows' logits, which the
    /// next step overwrites.
    pub(super) fn run(
        &mut self,
        step: Step<'_>,
        plan: KernelPlan,
        cost: &mut IterationCost,
    ) -> Result<Tensor> {
        let key = Key::of(&plan, step.tables);
        let real_rows = step.real_rows;
        let packed = [step.inputs.0, step.inputs.1].concat();
        if packed.len() != 2 * plan.rows {
            bail!(
                "cuda graphs: {} ids and positions for {} rows",
                packed.len(),
                plan.rows
            );
        }
        self.tick += 1;
        if let Some(c) = self.captured.iter_mut().find(|c| c.key == key) {
            c.used = self.tick;
            c.index.rewrite(plan)?;
            c.inputs.inplace_op1(&Upload(&packed))?;
            c.graph.0.launch().w()?;
            cost.attention_ops += c.launches.0;
            cost.layer_ops += c.launches.1;
            cost.graph_replays += 1;
            return c.logits.narrow(0, 0, real_rows);
        }
        if self.captured.len() >= MAX_GRAPHS {
            // A graph may still run on the stream: wait before its memory goes.
            step.model.device().synchronize()?;
            let oldest = (0..self.captured.len())
                .min_by_key(|&i| self.captured[i].used)
                .expect("full");
            self.captured.swap_remove(oldest);
        }
        let c = capture(step, plan, key, packed, cost)?;
        let logits = c.logits.narrow(0, 0, real_rows)?;
        self.captured.push(Captured {
            used: self.tick,
            ..c
        });
        Ok(logits)
    }

    /// Drops every graph once the stream has finished them.
    pub(crate) fn clear(&mut self) -> Result<()> {
        if let Some(c) = self.captured.first() {
            let device = c.inputs.device().clone();
            device.synchronize()?;
        }
        self.captured.clear();
        Ok(())
    }
}

/// Runs `step` (its result is this step's) and captures it with the same buffers. The run
/// fills candle's cache of the small uploads (dims and strides) the capture then copies from
/// the device; cudarc's event tracking is off while capturing, since capture refuses events
/// recorded outside it, and every buffer the step touches is on the engine's stream.
fn capture(
    step: Step<'_>,
    plan: KernelPlan,
    key: Key,
    packed: Vec<u32>,
    cost: &mut IterationCost,
) -> Result<Captured> {
    let Step {
        model,
        cache,
        tables,
        switches,
        variant,
        ..
    } = step;
    let device = cuda(model.device())?.clone();
    let rows = plan.rows;
    let inputs = Tensor::from_vec(packed, 2 * rows, model.device())?;
    let index = CudaIndex::new(plan, model.device())?;
    let _cached_uploads = device.enable_cuda_graph_htod_cache();
    let before = *cost;
    let mut pass = |cost: &mut IterationCost| -> Result<Tensor> {
        let (ids, positions) = (inputs.narrow(0, 0, rows)?, inputs.narrow(0, rows, rows)?);
        let mut backend = CudaPagedAttention {
            cache: &mut *cache,
            index: &index,
            tables,
            extras: Extras::of(switches),
            variant,
        };
        let hidden = device_timing::forward(model, (&ids, &positions), &mut backend, false, cost);
        backend.extras.count(cost);
        model.logits(&hidden?)
    };
    let logits = pass(cost)?;
    let launches = (
        cost.attention_ops - before.attention_ops,
        cost.layer_ops - before.layer_ops,
    );

    let stream = device.cuda_stream();
    let context = stream.context().clone();
    let tracking = context.is_event_tracking();
    // SAFETY: while tracking is off, the capture's buffers and those it reads are used on
    // the engine's stream alone; tracking is restored before anything else runs.
    unsafe { context.disable_event_tracking() };
    let captured = stream
        .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        .w()
        .and_then(|()| {
            // Whatever the pass allocates is freed inside the capture; its logits are copied
            // into the run's, which outlive it.
            let mut scratch = IterationCost::default();
            let out = pass(&mut scratch)?;
            logits.slice_set(&out, 0, 0)
        });
    let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).w();
    if tracking {
        // SAFETY: as above; every buffer the capture made is freed.
        unsafe { context.enable_event_tracking() };
    }
    captured?;
    let Some(graph) = graph? else {
        bail!("cuda graphs: the capture of a decode step recorded nothing");
    };
    Ok(Captured {
        key,
        graph: Graph(graph),
        inputs,
        index,
        logits,
        launches,
        used: 0,
    })
}

/// Writes host `u32`s over a tensor's elements, in place on the device.
struct Upload<'a>(&'a [u32]);

impl InplaceOp1 for Upload<'_> {
    fn name(&self) -> &'static str {
        "graph-inputs-upload"
    }

    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> Result<()> {
        bail!("graph-inputs-upload runs on a GPU only")
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> Result<()> {
        if layout.contiguous_offsets() != Some((0, self.0.len())) {
            bail!(
                "graph-inputs-upload: {} words into {:?}",
                self.0.len(),
                layout.shape()
            );
        }
        let stream = storage.device().cuda_stream();
        let slice = storage.as_cuda_slice_mut::<u32>()?;
        stream.memcpy_htod(self.0, slice).w()
    }
}
