//! The AVX-512 kernel: panels of 64 rows of `x` (4 zmm registers), tiles of 6 to 12 weight
//! rows (at most 24 accumulators, which with the operands fit the 32 zmm registers).

use std::arch::x86_64::*;

use super::panel::{self, PanelJob, Simd};

/// 16-lane AVX-512F registers, fused multiply-adds.
pub(super) struct Avx512;

impl Simd for Avx512 {
    const LANES: usize = 16;
    const PANEL_VECS: usize = 4;
    type V = __m512;

    #[inline(always)]
    unsafe fn zero() -> __m512 {
        // SAFETY: AVX-512F is available (contract).
        unsafe { _mm512_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        // SAFETY: as above; 16 readable floats (contract).
        unsafe { _mm512_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn splat(p: *const f32) -> __m512 {
        // SAFETY: as above; `p` is readable (contract).
        unsafe { _mm512_set1_ps(*p) }
    }
    #[inline(always)]
    unsafe fn mul_add(a: __m512, b: __m512, acc: __m512) -> __m512 {
        // SAFETY: AVX-512F is available (contract).
        unsafe { _mm512_fmadd_ps(a, b, acc) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        // SAFETY: as above; 16 writable floats (contract).
        unsafe { _mm512_storeu_ps(p, v) }
    }
}

/// Runs one panel job with the tile that fits its rows.
///
/// # Safety
/// AVX-512F is available, and `job` satisfies [`panel::run`]'s contract.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn run(job: &PanelJob) {
    // SAFETY: forwarded contract; the tile's C covers the job's rows.
    unsafe {
        match job.vecs::<Avx512>() {
            1 => panel::run::<Avx512, 12, 1>(job),
            2 => panel::run::<Avx512, 12, 2>(job),
            3 => panel::run::<Avx512, 8, 3>(job),
            _ => panel::run::<Avx512, 6, 4>(job),
        }
    }
}
