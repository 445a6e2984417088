//! The x86-64 AVX-512 CPU kernel behind [`crate::linear::linear`]: `x @ w^T` as dot
//! products of rows, 4 rows of `x` against 4 rows of `w` at a time.
//!
//! candle's CPU matmul runs the engine's decode shapes (a few dozen rows against a weight
//! matrix) far below the machine's peak. Here every output element is one dot product
//! accumulated in a fixed order, so a row's result does not depend on which other rows
//! share the batch. Tasks of row and column blocks run on rayon's pool.

use std::arch::x86_64::*;
use std::ops::Range;

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

/// Whether `x @ w^T` can run here: f32 matrices on the CPU of a machine with AVX-512.
pub(crate) fn applies(x: &Tensor, w: &Tensor) -> bool {
    x.device().is_cpu()
        && x.dtype() == DType::F32
        && w.dtype() == DType::F32
        && x.rank() == 2
        && w.rank() == 2
        && available()
}

/// Whether this CPU has AVX-512F (detected once, cached by std).
fn available() -> bool {
    is_x86_feature_detected!("avx512f")
}

/// The custom op computing `x @ w^T` with [`matmul_nt`]; candle records it for backward
/// only when `x` or `w` is tracked.
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
        let mut out = vec![0f32; m * n];
        matmul_nt(&x, &w, m, n, k, &mut out);
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

/// `out (m, n) = x (m, k) @ w (n, k)^T`, all row-major. Panics without AVX-512.
pub(crate) fn matmul_nt(x: &[f32], w: &[f32], m: usize, n: usize, k: usize, out: &mut [f32]) {
    assert!(available(), "matmul_nt needs AVX-512");
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
        let rows = rb * TASK_ROWS..((rb + 1) * TASK_ROWS).min(m);
        let cols = cb * TASK_COLS..((cb + 1) * TASK_COLS).min(n);
        // SAFETY: AVX-512 is available (asserted above); tasks write disjoint blocks of
        // `out`, which outlives them, and read `x`/`w` within the lengths asserted above.
        unsafe { block(x, w, k, n, rows, cols, out.get()) };
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

/// Computes `out[i][j]` for `i` in `rows`, `j` in `cols`, in tiles of 4 x 4. Tiles at
/// the edges repeat the last row or column, whose duplicate results are not stored, so
/// every element goes through the same instructions.
///
/// # Safety
/// AVX-512F must be available; `x` holds at least `rows.end` rows of length `k`, `w` at
/// least `cols.end`, and `out` points at a (`rows.end` x `ldo`) row-major buffer with
/// `cols.end <= ldo`; `rows` and `cols` are not empty.
#[target_feature(enable = "avx512f")]
unsafe fn block(
    x: &[f32],
    w: &[f32],
    k: usize,
    ldo: usize,
    rows: Range<usize>,
    cols: Range<usize>,
    out: *mut f32,
) {
    let last_row = rows.end - 1;
    let last_col = cols.end - 1;
    for j0 in cols.clone().step_by(4) {
        let wj: [usize; 4] = std::array::from_fn(|c| (j0 + c).min(last_col));
        let wr = wj.map(|j| w[j * k..].as_ptr());
        for i0 in rows.clone().step_by(4) {
            let xi: [usize; 4] = std::array::from_fn(|r| (i0 + r).min(last_row));
            let xr = xi.map(|i| x[i * k..].as_ptr());
            // SAFETY: the row indices are clamped into the block (contract).
            let sums = unsafe { tile(xr, wr, k) };
            for (r, row) in sums.iter().enumerate().take(rows.end - i0) {
                for (c, &value) in row.iter().enumerate().take(cols.end - j0) {
                    // SAFETY: (i0 + r, j0 + c) is inside the block, see the contract.
                    unsafe { *out.add((i0 + r) * ldo + j0 + c) = value };
                }
            }
        }
    }
}

/// 16 dot products of length `k`: 4 rows of `x` against 4 rows of `w`. Plain loops over
/// constant bounds, not closures, so that everything inlines into registers.
///
/// # Safety
/// AVX-512F must be available and every pointer must start a row of `k` floats.
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn tile(xr: [*const f32; 4], wr: [*const f32; 4], k: usize) -> [[f32; 4]; 4] {
    let mut acc = [[_mm512_setzero_ps(); 4]; 4];
    let mut xv = [_mm512_setzero_ps(); 4];
    let mut wv = [_mm512_setzero_ps(); 4];
    let full = k / 16 * 16;
    let mut kk = 0;
    while kk < full {
        for r in 0..4 {
            // SAFETY: kk + 16 <= k (contract).
            xv[r] = unsafe { _mm512_loadu_ps(xr[r].add(kk)) };
            wv[r] = unsafe { _mm512_loadu_ps(wr[r].add(kk)) };
        }
        fma_4x4(&mut acc, &xv, &wv);
        kk += 16;
    }
    if full < k {
        let mask: __mmask16 = (1u16 << (k - full)) - 1;
        for r in 0..4 {
            // SAFETY: the mask reads only the k - full floats left in each row.
            xv[r] = unsafe { _mm512_maskz_loadu_ps(mask, xr[r].add(full)) };
            wv[r] = unsafe { _mm512_maskz_loadu_ps(mask, wr[r].add(full)) };
        }
        fma_4x4(&mut acc, &xv, &wv);
    }
    let mut sums = [[0f32; 4]; 4];
    for r in 0..4 {
        for c in 0..4 {
            sums[r][c] = _mm512_reduce_add_ps(acc[r][c]);
        }
    }
    sums
}

/// `acc[r][c] += xv[r] * wv[c]`, lane by lane.
#[target_feature(enable = "avx512f")]
#[inline]
fn fma_4x4(acc: &mut [[__m512; 4]; 4], xv: &[__m512; 4], wv: &[__m512; 4]) {
    for (acc_row, &x) in acc.iter_mut().zip(xv) {
        for (a, &w) in acc_row.iter_mut().zip(wv) {
            *a = _mm512_fmadd_ps(x, w, *a);
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

    /// The kernel needs AVX-512; CI machines have it, so there a missing AVX-512 fails.
    fn kernel_available() -> bool {
        let ok = available();
        assert!(
            ok || std::env::var_os("CI").is_none(),
            "this CI machine lacks AVX-512, so the linear kernel cannot be tested"
        );
        ok
    }

    #[test]
    fn kernel_matches_f64_reference_on_ragged_shapes() {
        if !kernel_available() {
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        // Edges in every dimension: rows and columns not multiples of 4 or of a task,
        // k below, at and above multiples of 16.
        for &(m, n, k) in &[
            (1, 1, 1),
            (3, 5, 15),
            (4, 4, 16),
            (7, 33, 17),
            (65, 70, 64),
            (32, 576, 576),
            (130, 97, 176),
        ] {
            let (x, w) = operands(m, n, k, &mut rng);
            let mut out = vec![f32::NAN; m * n];
            matmul_nt(&x, &w, m, n, k, &mut out);
            let want = reference(&x, &w, m, n, k);
            for (idx, (&got, &want)) in out.iter().zip(&want).enumerate() {
                let tol = 1e-5 * (k as f64).sqrt();
                assert!(
                    (got as f64 - want).abs() <= tol,
                    "({m},{n},{k}) element {idx}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn a_row_is_bit_identical_alone_and_in_any_batch() {
        if !kernel_available() {
            return;
        }
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        let (m, n, k) = (37, 90, 200);
        let (x, w) = operands(m, n, k, &mut rng);
        let mut batch = vec![0f32; m * n];
        matmul_nt(&x, &w, m, n, k, &mut batch);
        for i in [0, 5, 36] {
            let mut alone = vec![0f32; n];
            matmul_nt(&x[i * k..(i + 1) * k], &w, 1, n, k, &mut alone);
            assert_eq!(alone, batch[i * n..(i + 1) * n], "row {i}");
        }
    }

    #[test]
    fn one_thread_gives_the_bits_of_many() {
        if !kernel_available() {
            return;
        }
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
                matmul_nt(&x, &w, m, n, k, &mut out);
                out
            })
        };
        assert_eq!(run(1), run(3));
    }
}
