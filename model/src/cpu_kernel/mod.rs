//! The CPU kernels behind [`crate::linear::linear`]: `x @ w^T`, with the rows of `x` packed
//! into transposed panels and multiplied by a few rows of `w` at a time (see [`panel`]).
//!
//! candle's CPU matmul runs the engine's decode shapes (a few dozen rows against a weight
//! matrix) far below the machine's peak, and its results for one row change in the last
//! bits with the other rows of the batch. Here every output element is one chain of
//! multiply-adds in order of `k`, so a row's result does not depend on which other rows
//! share the batch: a seeded sample's logprobs are the same alone or batched, which
//! bit-exact resume and isolated serving rest on. Three kernels compute it: AVX-512,
//! AVX2+FMA and a portable one in plain Rust (every CPU, aarch64 included). The kernel is
//! chosen once per process, the best the CPU has unless `DPPO_CPU_KERNEL` names one.
//! Results differ between kernels in the last bits; within one kernel they never depend on
//! the batch. Tasks of row and column blocks run on rayon's pool.

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod panel;
mod portable;

use std::mem::MaybeUninit;
use std::sync::OnceLock;

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

use crate::uninit;

/// The environment variable that forces a kernel (`avx512`, `avx2` or `portable`).
pub const KERNEL_ENV: &str = "DPPO_CPU_KERNEL";

/// One implementation of `x @ w^T` on the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuKernel {
    /// 16-lane AVX-512F, panels of 64 rows (x86-64).
    Avx512,
    /// 8-lane AVX2 with FMA, panels of 16 rows (x86-64).
    Avx2,
    /// Plain Rust that the compiler vectorises for the target, panels of 8 rows (any CPU).
    Portable,
}

impl CpuKernel {
    /// Every kernel, fastest first: the order in which the automatic choice tries them.
    pub const ALL: [CpuKernel; 3] = [CpuKernel::Avx512, CpuKernel::Avx2, CpuKernel::Portable];

    /// The name `DPPO_CPU_KERNEL` and reports use.
    pub fn name(self) -> &'static str {
        match self {
            CpuKernel::Avx512 => "avx512",
            CpuKernel::Avx2 => "avx2",
            CpuKernel::Portable => "portable",
        }
    }

    /// The CPU features the kernel needs, for error messages.
    fn requires(self) -> &'static str {
        match self {
            CpuKernel::Avx512 => "an x86-64 CPU with AVX-512F",
            CpuKernel::Avx2 => "an x86-64 CPU with AVX2 and FMA",
            CpuKernel::Portable => "nothing",
        }
    }

    /// Whether this CPU can run the kernel (detected at run time, cached by std).
    pub fn is_available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            CpuKernel::Avx512 => is_x86_feature_detected!("avx512f"),
            #[cfg(target_arch = "x86_64")]
            CpuKernel::Avx2 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            #[cfg(not(target_arch = "x86_64"))]
            CpuKernel::Avx512 | CpuKernel::Avx2 => false,
            CpuKernel::Portable => true,
        }
    }

    /// The kernel named `requested` (`None` or empty: the first of [`CpuKernel::ALL`] that
    /// `available` accepts). Pure, so the rules are testable whatever this CPU has.
    fn resolve(
        requested: Option<&str>,
        available: impl Fn(CpuKernel) -> bool,
    ) -> std::result::Result<CpuKernel, String> {
        let names = || Self::ALL.map(Self::name).join(", ");
        match requested.map(str::trim).filter(|s| !s.is_empty()) {
            None => Ok(Self::ALL
                .into_iter()
                .find(|&k| available(k))
                .unwrap_or(CpuKernel::Portable)),
            Some(name) => {
                let kernel = Self::ALL
                    .into_iter()
                    .find(|k| k.name() == name)
                    .ok_or_else(|| {
                        format!("unknown kernel {name:?}; expected one of {}", names())
                    })?;
                if available(kernel) {
                    Ok(kernel)
                } else {
                    let here: Vec<_> = Self::ALL
                        .into_iter()
                        .filter(|&k| available(k))
                        .map(Self::name)
                        .collect();
                    Err(format!(
                        "kernel {name:?} needs {}, which this CPU lacks; this CPU can run: {}",
                        kernel.requires(),
                        here.join(", ")
                    ))
                }
            }
        }
    }
}

impl std::fmt::Display for CpuKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The kernel this process runs: the one `DPPO_CPU_KERNEL` names, else the best this CPU
/// has. Decided on the first call and fixed for the process's lifetime, so every
/// projection of a run goes through the same kernel. An unknown name or a kernel this CPU
/// lacks is an error naming the variable.
pub fn cpu_kernel() -> crate::Result<CpuKernel> {
    static CHOICE: OnceLock<std::result::Result<CpuKernel, String>> = OnceLock::new();
    CHOICE
        .get_or_init(|| {
            let requested = std::env::var(KERNEL_ENV).ok();
            CpuKernel::resolve(requested.as_deref(), CpuKernel::is_available)
        })
        .clone()
        .map_err(|reason| crate::ModelError::CpuKernel {
            var: KERNEL_ENV,
            reason,
        })
}

/// Whether `x @ w^T` runs on our kernels: f32 matrices on the CPU.
pub(crate) fn applies(x: &Tensor, w: &Tensor) -> bool {
    x.device().is_cpu()
        && x.dtype() == DType::F32
        && w.dtype() == DType::F32
        && x.rank() == 2
        && w.rank() == 2
}

/// The custom op computing `x @ w^T` with [`matmul_nt_many`] on the process's kernel; candle
/// records it for backward only when `x` or `w` is tracked.
pub(crate) struct NtMatmul;

impl CustomOp2 for NtMatmul {
    fn name(&self) -> &'static str {
        "dppo-linear"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (m, k) = xl.shape().dims2()?;
        let (n, kw) = wl.shape().dims2()?;
        if k != kw {
            candle_core::bail!("linear: x is ({m}, {k}) but w is ({n}, {kw})");
        }
        let x = contiguous_f32(xs, xl, "x")?;
        let w = contiguous_f32(ws, wl, "w")?;
        let out = outputs(&x, m, k, &[(&w, n)])?.pop().expect("one product");
        Ok((CpuStorage::F32(out), Shape::from((m, n))))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _y: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        // Detached: `w` is a var and `x` an activation, so gradients computed from them as
        // they are would record ops and keep the whole forward graph alive for as long as the
        // weights' gradients live (candle detaches the gradients of non-var nodes only).
        let (x, w) = (x.detach(), w.detach());
        let grad_x = grad.matmul(&w)?;
        let grad_w = grad.t()?.matmul(&x)?;
        Ok((Some(grad_x), Some(grad_w)))
    }
}

/// The f32 data of a 2-D operand, borrowed when it is contiguous, copied otherwise.
fn contiguous_f32<'a>(
    storage: &'a CpuStorage,
    layout: &Layout,
    what: &str,
) -> Result<std::borrow::Cow<'a, [f32]>> {
    let CpuStorage::F32(data) = storage else {
        candle_core::bail!("linear: {what} must be f32");
    };
    Ok(match layout.contiguous_offsets() {
        Some((start, end)) => std::borrow::Cow::Borrowed(&data[start..end]),
        None => {
            let (rows, cols) = layout.shape().dims2()?;
            let (rs, cs) = (layout.stride()[0], layout.stride()[1]);
            let base = layout.start_offset();
            let copied = (0..rows)
                .flat_map(|r| (0..cols).map(move |c| data[base + r * rs + c * cs]))
                .collect();
            std::borrow::Cow::Owned(copied)
        }
    })
}

/// Rows of `x` one task handles (a whole number of panels of every kernel): its panels stay
/// in L2 while the task runs.
const TASK_ROWS: usize = 128;
/// Rows of `w` one task handles (a multiple of every tile's rows): enough tasks for every
/// core at the decode shapes, and a task's weight rows stay in L2 across its panels.
const TASK_COLS: usize = 96;
/// Steps of `k` in one piece of packing work.
const PACK_STEPS: usize = 64;
/// Below this many multiply-adds the work runs on the calling thread.
const PARALLEL_MIN_FLOPS: usize = 1 << 18;

/// `x @ w^T` (`x` (m, k), each `w` (n, k), all row-major) for each `(w, n)` of `weights`,
/// on the process's kernel in one pass (see [`matmul_nt_many`]). The outputs are not zeroed
/// first: the kernel writes every element, and zeroing the logits' 25 MB (SmolLM2 at a
/// batch of 128) would be serial work on the calling thread.
pub(crate) fn outputs(
    x: &[f32],
    m: usize,
    k: usize,
    weights: &[(&[f32], usize)],
) -> Result<Vec<Vec<f32>>> {
    let kernel = cpu_kernel().map_err(candle_core::Error::wrap)?;
    let mut outs: Vec<_> = weights
        .iter()
        .map(|&(_, n)| uninit::buffer(m * n))
        .collect();
    let mut products: Vec<Product> = weights
        .iter()
        .zip(outs.iter_mut())
        .map(|(&(w, n), out)| Product { w, n, out })
        .collect();
    matmul_nt_many(kernel, x, m, k, &mut products);
    // SAFETY: `matmul_nt_many` wrote every element of every output.
    Ok(outs
        .into_iter()
        .map(|out| unsafe { uninit::assume_init(out) })
        .collect())
}

/// One of the products of [`matmul_nt_many`]: weights `w` (n, k) and the output (m, n).
struct Product<'a> {
    w: &'a [f32],
    n: usize,
    out: &'a mut [MaybeUninit<f32>],
}

/// `out (m, n) = x (m, k) @ w (n, k)^T`, all row-major, for every product, on `kernel`,
/// into buffers that need not be initialised: every element of each `out` is written, none
/// is read. `x` is packed once and the tasks of all products run in one parallel pass: the
/// projections that read one input (q, k, v; gate, up) cost one hand-off, not several, and
/// each output has the same bits as when computed alone. Panics if this CPU lacks the
/// kernel (callers get it from [`cpu_kernel`]).
fn matmul_nt_many(kernel: CpuKernel, x: &[f32], m: usize, k: usize, products: &mut [Product]) {
    assert!(kernel.is_available(), "this CPU lacks the {kernel} kernel");
    assert_eq!(x.len(), m * k);
    for p in products.iter() {
        assert_eq!(p.w.len(), p.n * k);
        assert_eq!(p.out.len(), m * p.n);
    }
    let total_n: usize = products.iter().map(|p| p.n).sum();
    if m == 0 || total_n == 0 {
        return;
    }
    let (width, run): (usize, PanelFn) = match kernel {
        #[cfg(target_arch = "x86_64")]
        CpuKernel::Avx512 => (panel::panel_rows::<avx512::Avx512>(), avx512::run),
        #[cfg(target_arch = "x86_64")]
        CpuKernel::Avx2 => (panel::panel_rows::<avx2::Avx2>(), avx2::run),
        CpuKernel::Portable => (panel::panel_rows::<portable::Portable>(), portable::run),
        #[cfg(not(target_arch = "x86_64"))]
        CpuKernel::Avx512 | CpuKernel::Avx2 => unreachable!("no x86-64 kernels here"),
    };
    let parallel = m * total_n * k >= PARALLEL_MIN_FLOPS && crate::parallel::multi_threaded();
    // 1. Pack `x` into panels, in pieces of a few steps of one panel each: on the pool
    // when the product is, so that no serial copy runs between two parallel ones.
    let panel_len = width * k;
    let mut packed = uninit::buffer(m.div_ceil(width) * panel_len);
    let piece_len = width * PACK_STEPS;
    let pack_panel = |(p, panel): (usize, &mut [MaybeUninit<f32>])| {
        let pack_piece = |(c, piece): (usize, &mut [MaybeUninit<f32>])| {
            panel::pack(x, (m, k), p * width, c * PACK_STEPS, width, piece);
        };
        if parallel {
            panel
                .par_chunks_mut(piece_len)
                .enumerate()
                .for_each(pack_piece);
        } else {
            panel.chunks_mut(piece_len).enumerate().for_each(pack_piece);
        }
    };
    use rayon::prelude::*;
    if parallel {
        packed
            .par_chunks_mut(panel_len)
            .enumerate()
            .for_each(pack_panel);
    } else {
        packed
            .chunks_mut(panel_len)
            .enumerate()
            .for_each(pack_panel);
    }
    // SAFETY: the pieces cover `packed`, and `pack` writes every float of its piece.
    let packed = unsafe { uninit::assume_init_ref(&packed) };
    // 2. Every task: a group of panels against a block of one product's rows of `w`.
    let row_groups = m.div_ceil(TASK_ROWS);
    let outs: Vec<(&[f32], usize, OutPtr)> = products
        .iter_mut()
        .map(|p| (p.w, p.n, OutPtr(p.out.as_mut_ptr().cast::<f32>())))
        .collect();
    let col_blocks: Vec<(usize, usize)> = outs
        .iter()
        .enumerate()
        .flat_map(|(i, &(_, n, _))| (0..n.div_ceil(TASK_COLS)).map(move |cb| (i, cb)))
        .collect();
    let tasks = row_groups * col_blocks.len();
    let task = |t: usize| {
        let (g, (product, cb)) = (t % row_groups, col_blocks[t / row_groups]);
        let (w, n, out) = outs[product];
        let cols = cb * TASK_COLS..((cb + 1) * TASK_COLS).min(n);
        let first_panel = g * TASK_ROWS / width;
        let last_panel = ((g + 1) * TASK_ROWS).min(m).div_ceil(width);
        for p in first_panel..last_panel {
            let job = panel::PanelJob {
                w,
                panel: &packed[p * panel_len..(p + 1) * panel_len],
                k,
                first_row: p * width,
                rows: (m - p * width).min(width),
                cols: cols.clone(),
                out: out.get(),
                ldo: n,
            };
            // SAFETY: the kernel is available (asserted above); the job's rows fit its
            // panel; tasks write disjoint blocks of the outputs, which outlive them.
            unsafe { run(&job) };
        }
    };
    if parallel && tasks > 1 {
        (0..tasks).into_par_iter().for_each(task);
    } else {
        (0..tasks).for_each(task);
    }
}

/// `x @ w^T` for each of `ws` on the process's kernel, as [`NtMatmul`] computes each alone
/// (the same bits), in one pass (see [`matmul_nt_many`]). Outside autograd only: nothing
/// is recorded for backward.
pub(crate) fn products(x: &Tensor, ws: &[&Tensor]) -> Result<Vec<Tensor>> {
    let (m, k) = x.dims2()?;
    let (xs, xl) = x.storage_and_layout();
    let candle_core::Storage::Cpu(xs) = &*xs else {
        candle_core::bail!("linear: x is not on the CPU");
    };
    let x_data = contiguous_f32(xs, xl, "x")?;
    let guards: Vec<_> = ws.iter().map(|w| w.storage_and_layout()).collect();
    let mut weights = Vec::with_capacity(ws.len());
    for (storage, layout) in &guards {
        let candle_core::Storage::Cpu(storage) = &**storage else {
            candle_core::bail!("linear: w is not on the CPU");
        };
        let (n, kw) = layout.shape().dims2()?;
        if kw != k {
            candle_core::bail!("linear: x is ({m}, {k}) but w is ({n}, {kw})");
        }
        weights.push((contiguous_f32(storage, layout, "w")?, n));
    }
    let weights: Vec<(&[f32], usize)> = weights.iter().map(|(w, n)| (&**w, *n)).collect();
    outputs(&x_data, m, k, &weights)?
        .into_iter()
        .zip(&weights)
        .map(|(out, &(_, n))| Tensor::from_vec(out, (m, n), x.device()))
        .collect()
}

/// A kernel's entry point for one panel job (see [`panel::run`]).
type PanelFn = unsafe fn(&panel::PanelJob);

/// The output buffer shared by tasks that write disjoint elements of it.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);

// SAFETY: tasks only write elements no other task touches (see `matmul_nt_many`).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

#[cfg(test)]
mod tests;
