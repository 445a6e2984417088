//! The one tile every kernel runs, written once over a [`Simd`] register type.
//!
//! Rows of `x` are first packed transposed into panels of `LANES * PANEL_VECS` rows
//! (`panel[kk * width + l]` is element `kk` of the panel's row `l`, zero past the last row).
//! A tile then takes `R` rows of `w` and, at each step `kk`, broadcasts one weight per row
//! of `w` and multiplies it into whole registers of the panel: an outer product per step,
//! with no horizontal sums at the end and `R * C` independent accumulators.
//!
//! Every output element is one chain of multiply-adds in order of `k`, starting from zero,
//! in one lane of one accumulator, whatever the tile shape, the lane or the panel: a row's
//! result cannot depend on the other rows of the batch, nor on the number of threads.

use std::mem::MaybeUninit;
use std::ops::Range;

/// One SIMD register of f32 lanes and the operations a tile needs.
pub(super) trait Simd {
    /// Lanes of a register (at most [`MAX_LANES`]).
    const LANES: usize;
    /// Registers across a panel: a panel holds `LANES * PANEL_VECS` rows of `x`.
    const PANEL_VECS: usize;
    /// The register.
    type V: Copy;

    /// All lanes zero.
    ///
    /// # Safety
    /// The CPU has the kernel's features.
    unsafe fn zero() -> Self::V;
    /// `LANES` floats from `p`.
    ///
    /// # Safety
    /// As [`Simd::zero`], and `p` points at `LANES` readable floats.
    unsafe fn load(p: *const f32) -> Self::V;
    /// `*p` in every lane.
    ///
    /// # Safety
    /// As [`Simd::zero`], and `p` is readable.
    unsafe fn splat(p: *const f32) -> Self::V;
    /// `acc + a * b` lane by lane (fused where the kernel's instructions fuse).
    ///
    /// # Safety
    /// As [`Simd::zero`].
    unsafe fn mul_add(a: Self::V, b: Self::V, acc: Self::V) -> Self::V;
    /// Writes the lanes to `p`.
    ///
    /// # Safety
    /// As [`Simd::zero`], and `p` points at `LANES` writable floats.
    unsafe fn store(p: *mut f32, v: Self::V);
}

/// The widest register any kernel has, in f32 lanes.
pub(super) const MAX_LANES: usize = 16;

/// Rows of `x` in a panel of `S`.
pub(super) const fn panel_rows<S: Simd>() -> usize {
    S::LANES * S::PANEL_VECS
}

/// Packs one piece of a panel: steps `kk0..kk0 + dst.len() / width` of rows
/// `first..first + width` of `x` (row-major, `k` wide, `m` rows), `width` floats per step
/// at `dst`. Every float of `dst` is written: the lanes past the last row of `x` get zero.
pub(super) fn pack(
    x: &[f32],
    (m, k): (usize, usize),
    first: usize,
    kk0: usize,
    width: usize,
    dst: &mut [MaybeUninit<f32>],
) {
    let steps = dst.len() / width;
    let valid = m.saturating_sub(first).min(width);
    for step in dst.chunks_exact_mut(width) {
        for lane in &mut step[valid..] {
            lane.write(0.0);
        }
    }
    for l in 0..valid {
        let row = &x[(first + l) * k + kk0..][..steps];
        for (s, &v) in row.iter().enumerate() {
            dst[s * width + l].write(v);
        }
    }
}

/// One panel's share of a task: the products of the panel's rows with rows `cols` of `w`.
pub(super) struct PanelJob<'a> {
    /// The weight rows, `k` floats each.
    pub w: &'a [f32],
    /// The panel, `width * k` floats.
    pub panel: &'a [f32],
    pub k: usize,
    /// The output row of the panel's first row, and how many of its rows are real.
    pub first_row: usize,
    pub rows: usize,
    pub cols: Range<usize>,
    /// The output, row-major with `ldo` floats per row.
    pub out: *mut f32,
    pub ldo: usize,
}

impl PanelJob<'_> {
    /// Registers of `S` that cover the panel's real rows: the tile's `C`.
    pub(super) fn vecs<S: Simd>(&self) -> usize {
        self.rows.div_ceil(S::LANES)
    }
}

/// Computes a panel job with tiles of `R` weight rows by `C` registers of panel rows. The
/// last tile of the columns repeats the last weight row, whose duplicate results are not
/// stored, so every element goes through the same instructions wherever it sits.
///
/// # Safety
/// The CPU has `S`'s features; `C <= S::PANEL_VECS` and `C * LANES >= job.rows`; `job.w`
/// holds rows up to `cols.end`; `out` is a (`first_row + rows`) x `ldo` buffer with
/// `cols.end <= ldo` whose elements in this job's rows and columns no one else touches.
#[inline(always)]
pub(super) unsafe fn run<S: Simd, const R: usize, const C: usize>(job: &PanelJob) {
    let (k, width) = (job.k, panel_rows::<S>());
    let last_col = job.cols.end - 1;
    let mut lanes = [0f32; MAX_LANES];
    for j0 in job.cols.clone().step_by(R) {
        let wr: [*const f32; R] =
            std::array::from_fn(|r| job.w[(j0 + r).min(last_col) * k..].as_ptr());
        // SAFETY: rows clamped into `w`; the panel has `width * k` floats (contract).
        let acc = unsafe { tile::<S, R, C>(&wr, job.panel.as_ptr(), width, k) };
        for (r, acc_row) in acc.iter().enumerate().take(job.cols.end - j0) {
            for (c, &v) in acc_row.iter().enumerate() {
                // SAFETY: `lanes` holds MAX_LANES >= LANES floats.
                unsafe { S::store(lanes.as_mut_ptr(), v) };
                let first = c * S::LANES;
                for (l, &value) in lanes[..S::LANES].iter().enumerate() {
                    if first + l < job.rows {
                        let i = job.first_row + first + l;
                        // SAFETY: (i, j0 + r) is inside this job's part of `out` (contract).
                        unsafe { *job.out.add(i * job.ldo + j0 + r) = value };
                    }
                }
            }
        }
    }
}

/// `acc[r][c]` lane `l` = the products of weight row `r` with panel row `c * LANES + l`,
/// summed in order of `k`: one broadcast per weight row and `C` panel registers per step.
///
/// # Safety
/// The CPU has `S`'s features; every `a[r]` starts `k` readable floats and `b` starts
/// `k` steps of `ldb >= C * LANES` floats.
#[inline(always)]
unsafe fn tile<S: Simd, const R: usize, const C: usize>(
    a: &[*const f32; R],
    b: *const f32,
    ldb: usize,
    k: usize,
) -> [[S::V; C]; R] {
    // SAFETY: the features are there and every pointer stays in bounds (contract).
    unsafe {
        let mut acc = [[S::zero(); C]; R];
        let mut xv = [S::zero(); C];
        for kk in 0..k {
            let step = b.add(kk * ldb);
            for (c, v) in xv.iter_mut().enumerate() {
                *v = S::load(step.add(c * S::LANES));
            }
            for (acc_row, &row) in acc.iter_mut().zip(a) {
                let wv = S::splat(row.add(kk));
                for (acc, &x) in acc_row.iter_mut().zip(&xv) {
                    *acc = S::mul_add(wv, x, *acc);
                }
            }
        }
        acc
    }
}
