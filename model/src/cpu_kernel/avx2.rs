//! The AVX2+FMA kernel: panels of 16 rows of `x` (2 ymm registers), tiles of 6 or 12 weight
//! rows (at most 12 accumulators, which with the operands fit the 16 ymm registers).

use std::arch::x86_64::*;

use super::panel::{self, PanelJob, Simd};

/// 8-lane AVX2 registers, fused multiply-adds.
pub(super) struct Avx2;

impl Simd for Avx2 {
    const LANES: usize = 8;
    const PANEL_VECS: usize = 2;
    type V = __m256;

    #[inline(always)]
    unsafe fn zero() -> __m256 {
        // SAFETY: AVX2 is available (contract).
        unsafe { _mm256_setzero_ps() }
    }
    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        // SAFETY: as above; 8 readable floats (contract).
        unsafe { _mm256_loadu_ps(p) }
    }
    #[inline(always)]
    unsafe fn splat(p: *const f32) -> __m256 {
        // SAFETY: as above; `p` is readable (contract).
        unsafe { _mm256_broadcast_ss(&*p) }
    }
    #[inline(always)]
    unsafe fn mul_add(a: __m256, b: __m256, acc: __m256) -> __m256 {
        // SAFETY: FMA is available (contract).
        unsafe { _mm256_fmadd_ps(a, b, acc) }
    }
    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        // SAFETY: as above; 8 writable floats (contract).
        unsafe { _mm256_storeu_ps(p, v) }
    }
}

/// Runs one panel job with the tile that fits its rows.
///
/// # Safety
/// AVX2 and FMA are available, and `job` satisfies [`panel::run`]'s contract.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn run(job: &PanelJob) {
    // SAFETY: forwarded contract; the tile's C covers the job's rows.
    unsafe {
        match job.vecs::<Avx2>() {
            1 => panel::run::<Avx2, 12, 1>(job),
            _ => panel::run::<Avx2, 6, 2>(job),
        }
    }
}
