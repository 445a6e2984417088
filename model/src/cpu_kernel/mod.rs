//! The CPU kernels behind [`crate::linear::linear`]: `x @ w^T` as dot products of rows, a
//! few rows of `x` against a few rows of `w` at a time.
//!
//! candle's CPU matmul runs the engine's decode shapes (a few dozen rows against a weight
//! matrix) far below the machine's peak, and its results for one row change in the last
//! bits with the other rows of the batch. Here every output element is one dot product
//! accumulated in a fixed order, so a row's result does not depend on which other rows
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
mod portable;

use std::ops::Range;
use std::sync::OnceLock;

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

/// The environment variable that forces a kernel (`avx512`, `avx2` or `portable`).
pub const KERNEL_ENV: &str = "DPPO_CPU_KERNEL";

/// One implementation of `x @ w^T` on the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuKernel {
    /// 16-lane AVX-512F, 4 x 4 tiles (x86-64).
    Avx512,
    /// 8-lane AVX2 with FMA, 2 x 4 tiles (x86-64).
    Avx2,
    /// Plain Rust that the compiler vectorises for the target, 2 x 4 tiles (any CPU).
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

/// The custom op computing `x @ w^T` with [`matmul_nt`] on the process's kernel; candle
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
        let kernel = cpu_kernel().map_err(candle_core::Error::wrap)?;
        let x = contiguous_f32(xs, xl, "x")?;
        let w = contiguous_f32(ws, wl, "w")?;
        let mut out = vec![0f32; m * n];
        matmul_nt(kernel, &x, &w, m, n, k, &mut out);
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

/// Rows of `x` and of `w` one task handles; sized so a task's rows of `x` stay in L2 and
/// the decode shapes still split into enough tasks for every core.
const TASK_ROWS: usize = 64;
const TASK_COLS: usize = 32;
/// Below this many multiply-adds the work runs on the calling thread.
const PARALLEL_MIN_FLOPS: usize = 1 << 18;

/// `out (m, n) = x (m, k) @ w (n, k)^T`, all row-major, on `kernel`. Panics if this CPU
/// lacks the kernel (callers get it from [`cpu_kernel`]).
pub(crate) fn matmul_nt(
    kernel: CpuKernel,
    x: &[f32],
    w: &[f32],
    m: usize,
    n: usize,
    k: usize,
    out: &mut [f32],
) {
    assert!(kernel.is_available(), "this CPU lacks the {kernel} kernel");
    assert_eq!(x.len(), m * k);
    assert_eq!(w.len(), n * k);
    assert_eq!(out.len(), m * n);
    if m == 0 || n == 0 {
        return;
    }
    let row_blocks = m.div_ceil(TASK_ROWS);
    let col_blocks = n.div_ceil(TASK_COLS);
    let out = OutPtr(out.as_mut_ptr());
    let task = |t: usize| {
        let (rb, cb) = (t % row_blocks, t / row_blocks);
        let blk = Block {
            rows: rb * TASK_ROWS..((rb + 1) * TASK_ROWS).min(m),
            cols: cb * TASK_COLS..((cb + 1) * TASK_COLS).min(n),
            k,
            ldo: n,
        };
        // SAFETY: the kernel is available (asserted above); tasks write disjoint blocks of
        // `out`, which outlives them, and read `x`/`w` within the lengths asserted above.
        unsafe { run_block(kernel, x, w, &blk, out.get()) };
    };
    let tasks = row_blocks * col_blocks;
    if m * n * k < PARALLEL_MIN_FLOPS || tasks == 1 || !crate::parallel::multi_threaded() {
        (0..tasks).for_each(task);
    } else {
        use rayon::prelude::*;
        (0..tasks).into_par_iter().for_each(task);
    }
}

/// The output buffer shared by tasks that write disjoint elements of it.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);

// SAFETY: tasks only write elements no other task touches (see `matmul_nt`).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// One task's share of the output: `out[i][j]` for `i` in `rows`, `j` in `cols`, with dot
/// products of length `k` and `ldo` floats per output row.
struct Block {
    rows: Range<usize>,
    cols: Range<usize>,
    k: usize,
    ldo: usize,
}

/// [`block`] with the tile of `kernel`.
///
/// # Safety
/// As [`block`], and this CPU has `kernel`.
unsafe fn run_block(kernel: CpuKernel, x: &[f32], w: &[f32], blk: &Block, out: *mut f32) {
    // SAFETY: forwarded contract; each tile function needs exactly its kernel's features.
    unsafe {
        match kernel {
            #[cfg(target_arch = "x86_64")]
            CpuKernel::Avx512 => block(avx512::tile, x, w, blk, out),
            #[cfg(target_arch = "x86_64")]
            CpuKernel::Avx2 => block(avx2::tile, x, w, blk, out),
            CpuKernel::Portable => block(portable::tile, x, w, blk, out),
            #[cfg(not(target_arch = "x86_64"))]
            CpuKernel::Avx512 | CpuKernel::Avx2 => unreachable!("no x86-64 kernels here"),
        }
    }
}

/// A kernel's tile: the `R x C` dot products of length `k` of `R` rows of `x` against `C`
/// rows of `w`, each accumulated in an order that depends only on `k`.
///
/// # Safety
/// The CPU has the kernel's features and every pointer starts a row of `k` floats.
type Tile<const R: usize, const C: usize> =
    unsafe fn(&[*const f32; R], &[*const f32; C], usize) -> [[f32; C]; R];

/// Computes one block of the output in tiles. Tiles at the edges repeat the last row or
/// column, whose duplicate results are not stored, so every element goes through the same
/// instructions whatever its position.
///
/// # Safety
/// `tile` can run on this CPU; `x` holds at least `rows.end` rows of length `k`, `w` at
/// least `cols.end`, and `out` points at a (`rows.end` x `ldo`) row-major buffer with
/// `cols.end <= ldo`; `rows` and `cols` are not empty.
unsafe fn block<const R: usize, const C: usize>(
    tile: Tile<R, C>,
    x: &[f32],
    w: &[f32],
    blk: &Block,
    out: *mut f32,
) {
    let Block { rows, cols, k, ldo } = blk;
    let (k, ldo) = (*k, *ldo);
    let last_row = rows.end - 1;
    let last_col = cols.end - 1;
    for j0 in cols.clone().step_by(C) {
        let wr: [*const f32; C] = std::array::from_fn(|c| w[(j0 + c).min(last_col) * k..].as_ptr());
        for i0 in rows.clone().step_by(R) {
            let xr: [*const f32; R] =
                std::array::from_fn(|r| x[(i0 + r).min(last_row) * k..].as_ptr());
            // SAFETY: the row indices are clamped into the block (contract).
            let sums = unsafe { tile(&xr, &wr, k) };
            for (r, row) in sums.iter().enumerate().take(rows.end - i0) {
                for (c, &value) in row.iter().enumerate().take(cols.end - j0) {
                    // SAFETY: (i0 + r, j0 + c) is inside the block, see the contract.
                    unsafe { *out.add((i0 + r) * ldo + j0 + c) = value };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Random `x` (m, k) and `w` (n, k).
    fn operands(
        m: usize,
        n: usize,
        k: usize,
        rng: &mut rand::rngs::StdRng,
    ) -> (Vec<f32>, Vec<f32>) {
        let mut random = |len: usize| (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        (random(m * k), random(n * k))
    }

    fn reference(x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
        let mut out = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                out[i * n + j] = (0..k)
                    .map(|t| x[i * k + t] as f64 * w[j * k + t] as f64)
                    .sum();
            }
        }
        out
    }

    /// The kernels this CPU has (the portable one always); the others are reported as not
    /// tested, never failed.
    fn kernels_here() -> Vec<CpuKernel> {
        CpuKernel::ALL
            .into_iter()
            .filter(|k| {
                let ok = k.is_available();
                if !ok {
                    eprintln!("kernel {k}: this CPU lacks it, not tested");
                }
                ok
            })
            .collect()
    }

    #[test]
    fn every_kernel_matches_f64_reference_on_ragged_shapes() {
        for kernel in kernels_here() {
            let mut rng = rand::rngs::StdRng::seed_from_u64(7);
            // Edges in every dimension: rows and columns not multiples of a tile or of a
            // task, k below, at and above multiples of 8 and 16.
            for &(m, n, k) in &[
                (1, 1, 1),
                (3, 5, 15),
                (4, 4, 16),
                (7, 33, 17),
                (65, 70, 64),
                (32, 576, 576),
                (130, 97, 176),
                (5, 9, 7),
            ] {
                let (x, w) = operands(m, n, k, &mut rng);
                let mut out = vec![f32::NAN; m * n];
                matmul_nt(kernel, &x, &w, m, n, k, &mut out);
                let want = reference(&x, &w, m, n, k);
                for (idx, (&got, &want)) in out.iter().zip(&want).enumerate() {
                    let tol = 1e-5 * (k as f64).sqrt();
                    assert!(
                        (got as f64 - want).abs() <= tol,
                        "{kernel} ({m},{n},{k}) element {idx}: {got} vs {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn on_every_kernel_a_row_is_bit_identical_alone_and_in_any_batch() {
        for kernel in kernels_here() {
            let mut rng = rand::rngs::StdRng::seed_from_u64(8);
            let (m, n, k) = (37, 90, 200);
            let (x, w) = operands(m, n, k, &mut rng);
            let mut batch = vec![0f32; m * n];
            matmul_nt(kernel, &x, &w, m, n, k, &mut batch);
            for i in [0, 5, 36] {
                let mut alone = vec![0f32; n];
                matmul_nt(kernel, &x[i * k..(i + 1) * k], &w, 1, n, k, &mut alone);
                assert_eq!(alone, batch[i * n..(i + 1) * n], "{kernel} row {i}");
                // The same row in a batch of three, at every position.
                for at in 0..3 {
                    let mut three = x[..3 * k].to_vec();
                    three[at * k..(at + 1) * k].copy_from_slice(&x[i * k..(i + 1) * k]);
                    let mut got = vec![0f32; 3 * n];
                    matmul_nt(kernel, &three, &w, 3, n, k, &mut got);
                    assert_eq!(
                        got[at * n..(at + 1) * n],
                        batch[i * n..(i + 1) * n],
                        "{kernel} row {i} at {at} of 3"
                    );
                }
            }
        }
    }

    #[test]
    fn on_every_kernel_one_thread_gives_the_bits_of_many() {
        for kernel in kernels_here() {
            let mut rng = rand::rngs::StdRng::seed_from_u64(9);
            // Above the parallel threshold and several tasks in both dimensions.
            let (m, n, k) = (150, 100, 64);
            let (x, w) = operands(m, n, k, &mut rng);
            let run = |threads: usize| {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .expect("thread pool");
                pool.install(|| {
                    assert_eq!(crate::parallel::multi_threaded(), threads > 1);
                    let mut out = vec![f32::NAN; m * n];
                    matmul_nt(kernel, &x, &w, m, n, k, &mut out);
                    out
                })
            };
            assert_eq!(run(1), run(3), "{kernel}");
        }
    }

    #[test]
    fn the_choice_follows_the_cpu_and_the_variable() {
        let all = |_: CpuKernel| true;
        let avx2_only = |k: CpuKernel| k != CpuKernel::Avx512;
        let plain = |k: CpuKernel| k == CpuKernel::Portable;
        assert_eq!(CpuKernel::resolve(None, all), Ok(CpuKernel::Avx512));
        assert_eq!(CpuKernel::resolve(None, avx2_only), Ok(CpuKernel::Avx2));
        assert_eq!(CpuKernel::resolve(Some(""), plain), Ok(CpuKernel::Portable));
        assert_eq!(
            CpuKernel::resolve(Some("portable"), all),
            Ok(CpuKernel::Portable)
        );
        assert_eq!(
            CpuKernel::resolve(Some(" avx2 "), avx2_only),
            Ok(CpuKernel::Avx2)
        );
        let lacks = CpuKernel::resolve(Some("avx512"), avx2_only).unwrap_err();
        assert!(
            lacks.contains("AVX-512F") && lacks.contains("this CPU can run: avx2, portable"),
            "{lacks}"
        );
        let unknown = CpuKernel::resolve(Some("sse"), all).unwrap_err();
        assert!(
            unknown.contains("\"sse\"") && unknown.contains("avx512, avx2, portable"),
            "{unknown}"
        );
    }
}
