//! The portable tile: plain Rust over arrays of 8 lanes, which the compiler turns into the
//! target's vector instructions (SSE2 on any x86-64, NEON on aarch64). Rust never fuses a
//! multiply and an add, and never reorders float sums, so the bits are the same on every
//! CPU and at every optimisation level.

/// Lanes of one accumulator.
const LANES: usize = 8;

/// 8 dot products of length `k`: 2 rows of `x` against 4 rows of `w`. Lane `l` accumulates
/// the products at `l, l + 8, l + 16, ...` in order of `k` (the tail zero-padded); the lanes
/// are then summed in one fixed tree.
///
/// # Safety
/// Every pointer must start a row of `k` floats.
pub(super) unsafe fn tile(xr: &[*const f32; 2], wr: &[*const f32; 4], k: usize) -> [[f32; 4]; 2] {
    // SAFETY: each pointer starts a row of `k` floats (contract).
    let xs: [&[f32]; 2] = xr.map(|p| unsafe { std::slice::from_raw_parts(p, k) });
    let ws: [&[f32]; 4] = wr.map(|p| unsafe { std::slice::from_raw_parts(p, k) });
    let mut acc = [[[0f32; LANES]; 4]; 2];
    let full = k / LANES * LANES;
    for kk in (0..full).step_by(LANES) {
        let xv = xs.map(|row| lanes(&row[kk..kk + LANES]));
        let wv = ws.map(|row| lanes(&row[kk..kk + LANES]));
        mul_add_2x4(&mut acc, &xv, &wv);
    }
    if full < k {
        let xv = xs.map(|row| lanes(&row[full..]));
        let wv = ws.map(|row| lanes(&row[full..]));
        mul_add_2x4(&mut acc, &xv, &wv);
    }
    acc.map(|row| row.map(sum_lanes))
}

/// Up to 8 floats as one accumulator's lanes, zero-padded.
#[inline(always)]
fn lanes(values: &[f32]) -> [f32; LANES] {
    let mut out = [0f32; LANES];
    out[..values.len()].copy_from_slice(values);
    out
}

/// `acc[r][c][l] += xv[r][l] * wv[c][l]` (a multiply, then an add).
#[inline(always)]
fn mul_add_2x4(acc: &mut [[[f32; LANES]; 4]; 2], xv: &[[f32; LANES]; 2], wv: &[[f32; LANES]; 4]) {
    for (acc_row, x) in acc.iter_mut().zip(xv) {
        for (a, w) in acc_row.iter_mut().zip(wv) {
            for l in 0..LANES {
                a[l] += x[l] * w[l];
            }
        }
    }
}

/// The sum of the lanes: halves, then pairs, then the last two.
#[inline(always)]
fn sum_lanes(v: [f32; LANES]) -> f32 {
    let h: [f32; 4] = std::array::from_fn(|l| v[l] + v[l + 4]);
    let p = [h[0] + h[2], h[1] + h[3]];
    p[0] + p[1]
}
