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
use crate::publish::QUEUEING;

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
    buffers: Buffers,
    /// When it last ran ([`Graphs::tick`]).
    used: u64,
}

/// What a padded step reads and writes besides the model and the pools, kept for its graph.
struct Buffers {
    /// (2 x rows) u32: the token ids, then the positions.
    inputs: Tensor,
    /// The tiles, slots and partial outputs the attention reads.
    index: CudaIndex,
    /// (rows, vocab): the step's logits.
    logits: Tensor,
    /// The attention's and the layer kernels' launches in the pass.
    launches: (u64, u64),
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
    /// Keys whose capture failed: their steps run padded but eagerly.
    uncaptured: Vec<Key>,
    tick: u64,
}

impl Graphs {
    /// `step` under `plan` (padded): its graph replayed with the step's inputs, or the step
    /// run and captured where no graph has its key (run only, where its capture failed or
    /// the GPU has no stream-ordered allocation to capture). Returns the real rows' logits,
    /// which the next step overwrites.
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
            let b = &mut c.buffers;
            b.index.rewrite(plan)?;
            b.inputs.inplace_op1(&Upload(&packed))?;
            c.graph.0.launch().w()?;
            cost.attention_ops += b.launches.0;
            cost.layer_ops += b.launches.1;
            cost.graph_replays += 1;
            return b.logits.narrow(0, 0, real_rows);
        }
        let run = Run::new(step, plan, packed, cost)?;
        let capturable = cuda(run.step.model.device())?
            .cuda_stream()
            .context()
            .has_async_alloc();
        if !capturable || self.uncaptured.contains(&key) {
            return run.buffers.logits.narrow(0, 0, real_rows);
        }
        if self.captured.len() >= MAX_GRAPHS {
            // A graph may still run on the stream: wait before its memory goes.
            run.step.model.device().synchronize()?;
            let oldest = (0..self.captured.len())
                .min_by_key(|&i| self.captured[i].used)
                .expect("full");
            self.captured.swap_remove(oldest);
        }
        let logits = run.buffers.logits.narrow(0, 0, real_rows)?;
        match run.capture() {
            Ok((graph, buffers)) => self.captured.push(Captured {
                key,
                graph: Graph(graph),
                buffers,
                used: self.tick,
            }),
            Err(e) => {
                // The step's result stands (the run computed it); its shape stays eager.
                tracing::warn!(
                    "cuda graphs: decode steps of {} rows run uncaptured: {e}",
                    key.rows
                );
                self.uncaptured.push(key);
            }
        }
        Ok(logits)
    }

    /// Drops every graph, once the stream has finished them where it can say so.
    pub(crate) fn clear(&mut self) -> Result<()> {
        let synced = match self.captured.first() {
            Some(c) => c.buffers.inputs.device().synchronize(),
            None => Ok(()),
        };
        self.captured.clear();
        self.uncaptured.clear();
        synced
    }
}

impl Drop for Graphs {
    fn drop(&mut self) {
        // A graph must not be destroyed while the stream may still run it.
        if let Some(c) = self.captured.first() {
            if let Err(e) = c.buffers.inputs.device().synchronize() {
                tracing::error!("cuda graphs: synchronising before dropping them failed: {e}");
            }
        }
    }
}

/// A padded step run eagerly on buffers of its own (the result is the step's), ready to be
/// captured with the same buffers.
struct Run<'a> {
    step: Step<'a>,
    buffers: Buffers,
}

impl<'a> Run<'a> {
    /// Runs `step` under `plan`, its ids and positions `packed`. The run fills candle's cache
    /// of the small uploads (dims and strides) and loads every module the pass uses.
    fn new(
        mut step: Step<'a>,
        plan: KernelPlan,
        packed: Vec<u32>,
        cost: &mut IterationCost,
    ) -> Result<Self> {
        let device = step.model.device().clone();
        let rows = plan.rows;
        let inputs = Tensor::from_vec(packed, 2 * rows, &device)?;
        let index = CudaIndex::new(plan, &device)?;
        let _cached_uploads = cuda(&device)?.enable_cuda_graph_htod_cache();
        let before = *cost;
        let warm = pass(&mut step, &inputs, &index, cost)?;
        let launches = (
            cost.attention_ops - before.attention_ops,
            cost.layer_ops - before.layer_ops,
        );
        let buffers = Buffers {
            inputs,
            index,
            logits: warm,
            launches,
        };
        Ok(Self { step, buffers })
    }

    /// The pass captured on the engine's stream, its logits copied into a buffer made before
    /// it: every other tensor it makes is freed inside the capture. cudarc's event tracking
    /// is off meanwhile, since a capture cannot wait on events recorded outside it, and every
    /// buffer the pass touches is on the engine's stream; [`QUEUEING`] keeps other threads'
    /// work on that stream (a publication's) out of the capture.
    fn capture(mut self) -> Result<(CudaGraph, Buffers)> {
        let device = cuda(self.step.model.device())?.clone();
        let _cached_uploads = device.enable_cuda_graph_htod_cache();
        // The graph's logits buffer, filled by the copy the capture records, so that the copy's
        // module is loaded before it (loading one inside a capture is not allowed).
        let logits = self.buffers.logits.zeros_like()?;
        logits.slice_set(&self.buffers.logits, 0, 0)?;
        self.buffers.logits = logits;
        let stream = device.cuda_stream();
        let context = stream.context().clone();
        let _queueing = QUEUEING.lock();
        let tracking = context.is_event_tracking();
        // SAFETY: while tracking is off, the capture's buffers and those it reads are used on
        // the engine's stream alone; tracking is restored before the lock is let go.
        unsafe { context.disable_event_tracking() };
        let captured = stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .w()
            .and_then(|()| {
                let scratch = &mut IterationCost::default();
                let b = &self.buffers;
                let out = pass(&mut self.step, &b.inputs, &b.index, scratch)?;
                b.logits.slice_set(&out, 0, 0)
            });
        let graph = stream.end_capture(sys::CUgraphInstantiate_flags(0)).w();
        if tracking {
            // SAFETY: as above; every buffer the capture made is freed.
            unsafe { context.enable_event_tracking() };
        }
        captured?;
        match graph? {
            Some(graph) => Ok((graph, self.buffers)),
            None => bail!("the capture recorded nothing"),
        }
    }
}

/// `step`'s forward pass and the logits of every row, on `inputs` (ids, then positions) and
/// `index`.
fn pass(
    step: &mut Step<'_>,
    inputs: &Tensor,
    index: &CudaIndex,
    cost: &mut IterationCost,
) -> Result<Tensor> {
    let rows = index.plan.rows;
    let ids = inputs.narrow(0, 0, rows)?;
    let positions = inputs.narrow(0, rows, rows)?;
    let mut backend = CudaPagedAttention {
        cache: &mut *step.cache,
        index,
        tables: step.tables,
        extras: Extras::of(step.switches),
        variant: step.variant,
    };
    let hidden = device_timing::forward(step.model, (&ids, &positions), &mut backend, false, cost);
    backend.extras.count(cost);
    step.model.logits(&hidden?)
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
