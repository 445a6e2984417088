use super::*;
use rand::{Rng, SeedableRng};

/// `x @ w^T` through [`matmul_nt_many`], into a buffer of NaN: an element the kernel
/// did not write stays NaN.
fn product(kernel: CpuKernel, x: &[f32], w: &[f32], m: usize, n: usize, k: usize) -> Vec<f32> {
    let mut out = vec![std::mem::MaybeUninit::new(f32::NAN); m * n];
    matmul_nt_many(
        kernel,
        x,
        m,
        k,
        &mut [Product {
            w,
            n,
            out: &mut out,
        }],
    );
    // SAFETY: every element was initialised (NaN or written by the kernel).
    out.into_iter()
        .map(|v| unsafe { v.assume_init() })
        .collect()
}

/// Random `x` (m, k) and `w` (n, k).
fn operands(m: usize, n: usize, k: usize, rng: &mut rand::rngs::StdRng) -> (Vec<f32>, Vec<f32>) {
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
            (300, 200, 40),
            (5, 9, 7),
        ] {
            let (x, w) = operands(m, n, k, &mut rng);
            let out = product(kernel, &x, &w, m, n, k);
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
        let batch = product(kernel, &x, &w, m, n, k);
        for i in [0, 5, 36] {
            let alone = product(kernel, &x[i * k..(i + 1) * k], &w, 1, n, k);
            assert_eq!(alone, batch[i * n..(i + 1) * n], "{kernel} row {i}");
            // The same row in a batch of three, at every position.
            for at in 0..3 {
                let mut three = x[..3 * k].to_vec();
                three[at * k..(at + 1) * k].copy_from_slice(&x[i * k..(i + 1) * k]);
                let got = product(kernel, &three, &w, 3, n, k);
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
                product(kernel, &x, &w, m, n, k)
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
