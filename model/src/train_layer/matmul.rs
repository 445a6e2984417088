//! Strided f32 matrix products on the `gemm` crate (the library behind candle's CPU
//! matmul), written into or added onto an existing buffer: the backward pass sums weight
//! gradients over the packed buffers of a step, and the gradients of a kv head over its
//! query heads, in place, with no temporary and no separate add.

use gemm::Parallelism;

/// A row-major view of a matrix inside a slice: element `(i, j)` is
/// `data[offset + i * rs + j * cs]`.
#[derive(Clone, Copy)]
pub(super) struct View<'a> {
    pub data: &'a [f32],
    pub offset: usize,
    pub rs: usize,
    pub cs: usize,
}

impl<'a> View<'a> {
    /// A whole row-major matrix with `cols` columns.
    pub fn rows(data: &'a [f32], cols: usize) -> Self {
        Self {
            data,
            offset: 0,
            rs: cols,
            cs: 1,
        }
    }

    /// The transpose of this view.
    pub fn t(self) -> Self {
        Self {
            rs: self.cs,
            cs: self.rs,
            ..self
        }
    }

    /// Checks that a `rows` x `cols` matrix at this view lies inside the slice.
    fn check(&self, rows: usize, cols: usize, what: &str) {
        if rows > 0 && cols > 0 {
            let last = self.offset + (rows - 1) * self.rs + (cols - 1) * self.cs;
            assert!(
                last < self.data.len(),
                "matmul: {what} ({rows} x {cols}) runs past its buffer"
            );
        }
    }
}

/// How a product runs: on rayon's pool (the layer's big projections) or on the calling
/// thread (the per-sequence attention products, already one task each).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Threads {
    Pool,
    Caller,
}

/// `dst (m x n) [+]= a (m x k) @ b (k x n)`, `dst` row-major with `ldd` floats per row
/// starting at `dst_offset`; with `add` the product is added onto `dst`, otherwise `dst`
/// is overwritten (and need not hold numbers).
#[allow(clippy::too_many_arguments)]
pub(super) fn matmul(
    dst: &mut [f32],
    dst_offset: usize,
    ldd: usize,
    a: View,
    b: View,
    (m, n, k): (usize, usize, usize),
    add: bool,
    threads: Threads,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(
        dst_offset + (m - 1) * ldd + n <= dst.len(),
        "matmul: the output runs past its buffer"
    );
    a.check(m, k, "left operand");
    b.check(k, n, "right operand");
    let parallelism = match threads {
        Threads::Pool if crate::parallel::multi_threaded() => {
            Parallelism::Rayon(rayon::current_num_threads())
        }
        _ => Parallelism::None,
    };
    // SAFETY: the three views were checked to lie inside their slices; `dst` is borrowed
    // mutably, so nothing else reads or writes it meanwhile.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr().add(dst_offset),
            1,
            ldd as isize,
            add,
            a.data.as_ptr().add(a.offset),
            a.cs as isize,
            a.rs as isize,
            b.data.as_ptr().add(b.offset),
            b.cs as isize,
            b.rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strided_products_match_f64_loops_and_add_in_place() {
        let (m, n, k) = (5, 7, 9);
        let a: Vec<f32> = (0..k * m).map(|i| (i as f32 * 0.37).sin()).collect();
        let b: Vec<f32> = (0..k * n).map(|i| (i as f32 * 0.11).cos()).collect();
        // a is stored (k, m): the product uses its transpose.
        let at = View::rows(&a, m).t();
        let mut dst = vec![1.5f32; 2 + m * 10];
        for add in [false, true] {
            let before = dst.clone();
            matmul(
                &mut dst,
                2,
                10,
                at,
                View::rows(&b, n),
                (m, n, k),
                add,
                Threads::Pool,
            );
            for i in 0..m {
                for j in 0..n {
                    let want: f64 = (0..k)
                        .map(|t| a[t * m + i] as f64 * b[t * n + j] as f64)
                        .sum::<f64>()
                        + if add {
                            before[2 + i * 10 + j] as f64
                        } else {
                            0.0
                        };
                    let got = dst[2 + i * 10 + j] as f64;
                    assert!((got - want).abs() < 1e-5, "({i},{j}) add={add}");
                }
                // Columns past `n` in a row of the output are left alone.
                assert_eq!(dst[2 + i * 10 + n], before[2 + i * 10 + n]);
            }
        }
    }
}
