//! Lazy noise in the emulated kernels: the same draws as the exact noise on ties and
//! infinities, a fraction of the logs, and a skip only where a score surely stays below.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{emulate, launch, logits, Launch};
use crate::device_sample::{checked_draws, Noise, SOURCE, THREADS};
use crate::gumbel::Drawn;
use crate::kernel_emu::{Args, Emulator};

/// Rows of ties and infinities: +inf at ids in other threads, warps and rounds (the lowest id
/// wins the tie), every logit -inf, every logit equal. Lazy noise draws what the exact
/// noise draws, and both the host reference's tokens; so do split draws.
#[test]
fn lazy_noise_keeps_ties_and_infinities() {
    let kernels = ["gumbel_sample_f32", "gumbel_sample_split_f32"];
    let emu = Emulator::build("kernels/sample.cu", SOURCE, &kernels).unwrap();
    let vocab = 4099;
    let mut infs = vec![0.5f32; vocab];
    // Thread 0's first group, thread 5's, warp 1's thread 40, and thread 0's third round.
    for id in [3, 21, 163, 2051] {
        infs[id] = f32::INFINITY;
    }
    let rows = vec![infs, vec![f32::NEG_INFINITY; vocab], vec![1.25f32; vocab]];
    let draws = checked_draws(rows.len());
    let exact = emulate(&emu, &rows, &draws, false, Noise::Every);
    let lazy = emulate(&emu, &rows, &draws, false, Noise::Lazy);
    for (d, (e, l)) in draws.iter().zip(exact.iter().zip(&lazy)) {
        let want = crate::gumbel::draw(&rows[d.row as usize], &d.params, &d.key);
        assert_eq!((e.token, l.token), (want.token, want.token), "{d:?}");
    }
    assert!(exact
        .iter()
        .zip(&draws)
        .all(|(e, d)| d.row != 0 || e.token == 3));
    assert_eq!(
        format!("{lazy:?}"),
        format!("{exact:?}"),
        "lazy noise, bit for bit"
    );
    // Split over parts that put the infinities in different blocks (3 parts: ids 3, 21 and
    // 163 in the first, 2051 in the second), the same tokens: ties go to the lowest id across
    // parts too.
    for parts in [3, 7] {
        let how = Launch {
            noise: Noise::Lazy,
            parts: Some(parts),
            ..Launch::default()
        };
        let (split, _) = launch(&emu, &rows, &draws, how);
        let tokens = |d: &[Drawn]| d.iter().map(|d| d.token).collect::<Vec<_>>();
        assert_eq!(tokens(&split), tokens(&exact), "{parts} parts");
    }
}

#[test]
fn lazy_noise_takes_a_fraction_of_the_logs() {
    // The kernel with its logs counted, and a kernel (test only) that reads and resets the count.
    let counted = "static unsigned long long emu_logs = 0;
        static inline float emu_counted_logf(float x) { ++emu_logs; return logf(x); }
        #define logf(x) emu_counted_logf(x)";
    let read = "extern \"C\" __global__ void read_logs(unsigned long long *out) {
        if (threadIdx.x == 0) { *out = emu_logs; emu_logs = 0; }
    }";
    let source = format!("{counted}\n{SOURCE}\n{read}\n");
    let kernels = ["gumbel_sample_bf16", "read_logs"];
    let emu = Emulator::build("kernels/sample.cu", &source, &kernels).unwrap();
    let logs = || {
        let mut n = 0u64;
        let args = Args::default().arg(&mut n as *mut u64);
        emu.launch("read_logs", (1, 1, 1), (32, 1, 1), 0, &args)
            .unwrap();
        n
    };
    // An untrained model's logits (close together): without lazy noise nearly every score of
    // a draw at a temperature takes two logs.
    let mut rng = StdRng::seed_from_u64(29);
    let rows = logits(&mut rng, 6, 151_936, 0.3);
    let draws = checked_draws(6);
    logs();
    emulate(&emu, &rows, &draws, true, Noise::Every);
    let every = logs();
    emulate(&emu, &rows, &draws, true, Noise::Lazy);
    let lazy = logs();
    // Each draw at a temperature that truncates nothing takes the noise of every score.
    let plain = draws
        .iter()
        .filter(|d| d.params.inv_temperature > 0.0 && d.params.top_k == 0)
        .filter(|d| d.params.top_p == 1.0 && d.params.min_p == 0.0)
        .count() as u64;
    assert!(
        plain > 0 && every > 2 * 151_936 * plain,
        "{every} logs, {plain} plain draws"
    );
    eprintln!("logs: {every} with every score's noise, {lazy} with lazy noise");
    // Each thread's own best alone leaves about 60x fewer; the warp's shared bar halves
    // that again.
    assert!(
        lazy * 80 < every,
        "{lazy} logs with lazy noise, {every} without"
    );
}

/// `surely_below` of kernels/sample.cu over `(u, s, best)` triples, by a kernel that exists
/// only in this test.
fn surely_below(emu: &Emulator, cases: &[(f32, f32, f32)]) -> Vec<bool> {
    let unzip = |f: fn(&(f32, f32, f32)) -> f32| cases.iter().map(f).collect::<Vec<f32>>();
    let (u, s, best) = (unzip(|c| c.0), unzip(|c| c.1), unzip(|c| c.2));
    let mut out = vec![2u32; cases.len()];
    let n = cases.len() as u32;
    let args = Args::default()
        .arg(u.as_ptr())
        .arg(s.as_ptr())
        .arg(best.as_ptr())
        .arg(n)
        .arg(out.as_mut_ptr());
    emu.launch("probe_surely_below", (1, 1, 1), (THREADS, 1, 1), 0, &args)
        .unwrap();
    out.into_iter().map(|b| b == 1).collect()
}

#[test]
fn lazy_noise_skips_only_scores_that_stay_below_the_best() {
    let probe = "extern \"C\" __global__ void probe_surely_below(const float *u, const float *s,
        const float *best, unsigned int n, unsigned int *out) {
        for (unsigned int i = threadIdx.x; i < n; i += THREADS) out[i] = surely_below(u[i], s[i], best[i]);
    }";
    let source = format!("{SOURCE}\n{probe}\n");
    let emu = Emulator::build("kernels/sample.cu", &source, &["probe_surely_below"]).unwrap();
    let mut rng = StdRng::seed_from_u64(5);
    // The uniforms the kernel makes: word k's (k + 0.5) / 2^23. Its noisy score, in f32 as
    // the kernel computes it and in f64.
    let uniform = |k: u32| crate::gumbel::uniform(k << 9);
    let score32 = |k: u32, s: f32| s - (-(uniform(k).ln())).ln();
    let score64 = |k: u32, s: f32| s as f64 - (-(uniform(k) as f64).ln()).ln();
    let top = 1u32 << 23;
    for s in [0.0f32, 3.5, -40.25, 1234.5, -1.0e5] {
        for gap in [-30.0f32, -16.0, -10.0, -7.0, -3.0, -1.0, 0.0, 1.5] {
            let best = s - gap;
            // The first word whose f64 score reaches best (`top` where none does), and words
            // around it and anywhere.
            let (mut lo, mut hi) = (0u32, top);
            while lo < hi {
                let mid = lo + (hi - lo) / 2;
                if score64(mid, s) >= best as f64 {
                    hi = mid
                } else {
                    lo = mid + 1
                }
            }
            let edge = lo;
            let mut words: Vec<u32> = (edge.saturating_sub(3000)..(edge + 3000).min(top)).collect();
            words.extend((0..3000).map(|_| rng.random_range(0..top)));
            words.extend([0, top - 1]);
            let cases: Vec<(f32, f32, f32)> =
                words.iter().map(|&k| (uniform(k), s, best)).collect();
            let skipped = surely_below(&emu, &cases);
            let what = |k: u32| format!("s {s}, best {best}, word {k} (first reaching {edge})");
            for (&k, &skip) in words.iter().zip(&skipped) {
                if skip {
                    assert!(score64(k, s) < best as f64, "{}", what(k));
                    assert!(score32(k, s) < best, "{}", what(k));
                }
                // Where the scores are moderate, the margin is small: a word whose 1 - u is
                // 1% past the least that reaches best in exact arithmetic is skipped.
                let v = 1.0 - uniform(k) as f64;
                if s.abs() + best.abs() < 100.0 && v > 1.01 * (gap as f64).exp() {
                    assert!(skip, "not skipped: {}", what(k));
                }
            }
        }
    }
    // A gap that is NaN or infinite skips nothing it cannot be sure of.
    let inf = f32::INFINITY;
    let edges = [
        (0.5, -inf, 0.0),
        (0.5, 0.0, -inf),
        (0.5, -inf, -inf),
        (0.5, inf, inf),
        (0.99, f32::NAN, 0.0),
    ];
    assert_eq!(surely_below(&emu, &edges), [false; 5]);
}
