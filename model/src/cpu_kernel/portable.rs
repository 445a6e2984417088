//! The portable kernel: plain Rust over arrays of 8 lanes, which the compiler turns into the
//! target's vector instructions (SSE2 on any x86-64, NEON on aarch64). Rust never fuses a
//! multiply and an add, and never reorders float sums, so the bits are the same on every
//! CPU and at every optimisation level. Panels of 8 rows of `x`, tiles of 4 weight rows.

use super::panel::{self, PanelJob, Simd};

/// Lanes of one register.
const LANES: usize = 8;

/// 8 lanes in an array; a multiply, then an add.
pub(super) struct Portable;

impl Simd for Portable {
    const LANES: usize = LANES;
    const PANEL_VECS: usize = 1;
    type V = [f32; LANES];

    #[inline(always)]
    unsafe fn zero() -> [f32; LANES] {
        [0.0; LANES]
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> [f32; LANES] {
        // SAFETY: 8 readable floats (contract).
        unsafe { p.cast::<[f32; LANES]>().read_unaligned() }
    }
    #[inline(always)]
    unsafe fn splat(p: *const f32) -> [f32; LANES] {
        // SAFETY: `p` is readable (contract).
        [unsafe { *p }; LANES]
    }
    #[inline(always)]
    unsafe fn mul_add(a: [f32; LANES], b: [f32; LANES], acc: [f32; LANES]) -> [f32; LANES] {
        std::array::from_fn(|l| acc[l] + a[l] * b[l])
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: [f32; LANES]) {
        // SAFETY: 8 writable floats (contract).
        unsafe { p.cast::<[f32; LANES]>().write_unaligned(v) }
    }
}

/// Runs one panel job.
///
/// # Safety
/// `job` satisfies [`panel::run`]'s contract.
pub(super) unsafe fn run(job: &PanelJob) {
    // SAFETY: forwarded contract; one register covers the panel's rows.
    unsafe { panel::run::<Portable, 4, 1>(job) }
}
