//! The AVX2 tile: 2 rows of `x` against 4 rows of `w` in 8-lane registers (8 accumulators
//! and 6 operands fit the 16 ymm registers; a 4 x 4 tile would spill).

use std::arch::x86_64::*;

/// 8 dot products of length `k`: 2 rows of `x` against 4 rows of `w`. Each lane
/// accumulates every 8th product in order of `k` with fused multiply-adds; the tail is read
/// through a mask, zero-padded; the lanes are then summed in one fixed order.
///
/// # Safety
/// AVX2 and FMA must be available and every pointer must start a row of `k` floats.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn tile(xr: &[*const f32; 2], wr: &[*const f32; 4], k: usize) -> [[f32; 4]; 2] {
    let mut acc = [[_mm256_setzero_ps(); 4]; 2];
    let mut xv = [_mm256_setzero_ps(); 2];
    let mut wv = [_mm256_setzero_ps(); 4];
    let full = k / 8 * 8;
    let mut kk = 0;
    while kk < full {
        for r in 0..2 {
            // SAFETY: kk + 8 <= k (contract).
            xv[r] = unsafe { _mm256_loadu_ps(xr[r].add(kk)) };
        }
        for c in 0..4 {
            // SAFETY: as above.
            wv[c] = unsafe { _mm256_loadu_ps(wr[c].add(kk)) };
        }
        fma_2x4(&mut acc, &xv, &wv);
        kk += 8;
    }
    if full < k {
        let left = (k - full) as i32;
        // Lane l is loaded when l < left (the mask's sign bit set).
        let mask = _mm256_cmpgt_epi32(
            _mm256_set1_epi32(left),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        );
        for r in 0..2 {
            // SAFETY: the mask reads only the k - full floats left in each row.
            xv[r] = unsafe { _mm256_maskload_ps(xr[r].add(full), mask) };
        }
        for c in 0..4 {
            // SAFETY: as above.
            wv[c] = unsafe { _mm256_maskload_ps(wr[c].add(full), mask) };
        }
        fma_2x4(&mut acc, &xv, &wv);
    }
    let mut sums = [[0f32; 4]; 2];
    for r in 0..2 {
        for c in 0..4 {
            sums[r][c] = hsum(acc[r][c]);
        }
    }
    sums
}

/// `acc[r][c] += xv[r] * wv[c]`, lane by lane.
#[target_feature(enable = "avx2,fma")]
#[inline]
fn fma_2x4(acc: &mut [[__m256; 4]; 2], xv: &[__m256; 2], wv: &[__m256; 4]) {
    for (acc_row, &x) in acc.iter_mut().zip(xv) {
        for (a, &w) in acc_row.iter_mut().zip(wv) {
            *a = _mm256_fmadd_ps(x, w, *a);
        }
    }
}

/// The sum of the 8 lanes: halves, then pairs, then the last two.
#[target_feature(enable = "avx2")]
#[inline]
fn hsum(v: __m256) -> f32 {
    let halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
    _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps::<1>(pairs, pairs)))
}
