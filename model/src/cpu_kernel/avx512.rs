//! The AVX-512 tile: 4 rows of `x` against 4 rows of `w` in 16-lane registers (16
//! accumulators and 8 operands fit the 32 zmm registers).

use std::arch::x86_64::*;

/// 16 dot products of length `k`: 4 rows of `x` against 4 rows of `w`. Plain loops over
/// constant bounds, not closures, so that everything inlines into registers. Each lane
/// accumulates every 16th product in order of `k`; the tail is read zero-padded.
///
/// # Safety
/// AVX-512F must be available and every pointer must start a row of `k` floats.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn tile(xr: &[*const f32; 4], wr: &[*const f32; 4], k: usize) -> [[f32; 4]; 4] {
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
