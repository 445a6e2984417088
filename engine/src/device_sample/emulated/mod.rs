//! kernels/sample.cu and sample_split.cu themselves, run on the CPU ([`crate::kernel_emu`]) over the draws `dppo
//! doctor` checks on a GPU, held to the host reference by the same measure.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{
    checked_draws, push_args, Agreement, DeviceDraw, DrawInputs, DrawOutputs, Noise, LOGPROB_TOL,
    PART_WORDS, SOURCE, THREADS,
};
use crate::gumbel::Drawn;
use crate::kernel_emu::{Args, Emulator};
use crate::sampler::MAX_TOP_LOGPROBS;

mod lazy_noise;

/// `draws` from `rows` (each `vocab` long) by the emulated one-block kernel, launched as
/// [`super::sample`] launches it on a GPU: on the rows in f32, or in bf16 (`bf16`, the rows
/// then being bf16 values already), with `noise`.
fn emulate(
    emu: &Emulator,
    rows: &[Vec<f32>],
    draws: &[DeviceDraw],
    bf16: bool,
    noise: Noise,
) -> Vec<Drawn> {
    let how = Launch {
        bf16,
        noise,
        ..Launch::default()
    };
    launch(emu, rows, draws, how).0
}

/// How a test launches the kernel.
#[derive(Debug, Clone, Copy, Default)]
struct Launch {
    /// The rows in bf16 (bf16 values already), else f32.
    bf16: bool,
    noise: Noise,
    /// The split kernel with this many parts a draw, else the one-block kernel.
    parts: Option<u32>,
    /// Logits before the first row's, so that rows start off a group's alignment.
    skew: usize,
}

/// `draws` from `rows` by the emulated kernel `how` names, and the split kernel's counts of
/// parts a draw after the launch (empty for the one-block kernel).
fn launch(
    emu: &Emulator,
    rows: &[Vec<f32>],
    draws: &[DeviceDraw],
    how: Launch,
) -> (Vec<Drawn>, Vec<u32>) {
    let mut logits = vec![0.0f32; how.skew];
    logits.extend(rows.concat());
    let halves: Vec<half::bf16> = logits.iter().map(|&x| half::bf16::from_f32(x)).collect();
    let vocab = rows[0].len() as u32;
    let lazy = how.noise.kernel_arg();
    let inputs = DrawInputs::of(draws);
    let n = draws.len();
    let mut out = DrawOutputs {
        tokens: vec![u32::MAX; n],
        logprobs: vec![f32::NAN; n],
        model_logprobs: vec![f32::NAN; n],
        top: (
            vec![u32::MAX; n * MAX_TOP_LOGPROBS],
            vec![f32::NAN; n * MAX_TOP_LOGPROBS],
        ),
    };
    let parts = how.parts.unwrap_or(1);
    // The parts' words start as NaN, as the GPU's launch leaves them; the counts at zero.
    let mut scratch = (
        vec![u32::MAX; n * parts as usize * PART_WORDS],
        vec![0u32; n],
    );
    let split = how.parts.map(|_| &mut scratch);
    let args = if how.bf16 {
        let ptr = halves[how.skew..].as_ptr();
        Args::filled(|list| push_args(list, ptr, (&vocab, &lazy), &inputs, &mut out, split))
    } else {
        let ptr = logits[how.skew..].as_ptr();
        Args::filled(|list| push_args(list, ptr, (&vocab, &lazy), &inputs, &mut out, split))
    };
    let dtype = if how.bf16 { "bf16" } else { "f32" };
    let name = match how.parts {
        Some(_) => format!("gumbel_sample_split_{dtype}"),
        None => format!("gumbel_sample_{dtype}"),
    };
    emu.launch(&name, (n as u32, parts, 1), (THREADS, 1, 1), 0, &args)
        .unwrap();
    let arrived = match how.parts {
        Some(_) => scratch.1,
        None => Vec::new(),
    };
    (out.drawn(&inputs.n_tops), arrived)
}

/// Logits as the doctor draws them: normal(0, `std`) (3 in the doctor).
fn logits(rng: &mut StdRng, rows: usize, vocab: usize, std: f32) -> Vec<Vec<f32>> {
    (0..rows)
        .map(|_| {
            (0..vocab)
                .map(|_| {
                    let (u, v): (f32, f32) = (rng.random(), rng.random());
                    std * (-2.0 * (1.0 - u).ln()).sqrt() * (std::f32::consts::TAU * v).cos()
                })
                .collect()
        })
        .collect()
}

#[test]
fn the_kernel_draws_what_its_host_reference_draws() {
    let kernels = ["gumbel_sample_f32", "gumbel_sample_bf16"];
    let emu = Emulator::build("kernels/sample.cu", SOURCE, &kernels).unwrap();
    let mut rng = StdRng::seed_from_u64(23);
    // Qwen's vocabulary, as the doctor checks it, and one that is no multiple of the groups
    // of four or of the block's threads, with a NaN and an infinity among the logits; in f32,
    // and in bf16 as the model computes them (the reference reads their f32 values). Logits
    // as spread as a trained model's (std 12) leave most scores too low to draw noise for;
    // an untrained model's (std 0.3) leave none, and lazy noise skips most of their logs.
    for bf16 in [false, true] {
        for (rows, vocab, std) in [
            (16, 151_936, 3.0),
            (6, 32_003, 3.0),
            (16, 151_936, 12.0),
            (6, 151_936, 0.3),
        ] {
            let mut logits = logits(&mut rng, rows, vocab, std);
            logits[1][7] = f32::NAN;
            logits[2][vocab - 1] = f32::NEG_INFINITY;
            if bf16 {
                for x in logits.iter_mut().flatten() {
                    *x = half::bf16::from_f32(*x).to_f32();
                }
            }
            let draws = checked_draws(rows);
            let got = emulate(&emu, &logits, &draws, bf16, Noise::Every);
            // The doctor allows a near-tie to part a draw on a GPU; here the host's own libm
            // computes both sides, so every draw agrees.
            let what = format!("vocabulary {vocab}, std {std}, bf16 {bf16}");
            let agreement = Agreement::of(&logits, &draws, &got);
            assert!(agreement.passed(), "{what}: {agreement:?}");
            assert_eq!(agreement.agreed, draws.len(), "{what}");
            assert_eq!(got.len(), draws.len());
            for (d, g) in draws.iter().zip(&got) {
                assert!((g.token as usize) < vocab, "{what}: {d:?}: {g:?}");
                assert_eq!(g.top_logprobs.len(), d.params.top_logprobs as usize);
            }
            // Lazy noise skips only scores that could not win: the same draws, bit for bit.
            let lazy = emulate(&emu, &logits, &draws, bf16, Noise::Lazy);
            assert_eq!(lazy, got, "{what}, lazy noise");
        }
    }
}

/// The split kernel draws the one-block kernel's tokens and top-logprob ids, whatever its
/// parts: one, a few that do not divide the row's groups, and more parts than groups (some
/// empty). Its logprobs stay within [`LOGPROB_TOL`] of that kernel's (the log-sum-exps merge
/// in another order). Truncated draws, which block 0 of their draw runs alone, are that
/// kernel's bit for bit. Every count is left at zero. Rows start aligned to a group's load
/// and off it, the vocabulary is a multiple of four and not, in f32 and bf16, with both
/// noises, the blocks run in both orders.
#[test]
fn split_draws_draw_what_one_block_draws() {
    let kernels = [
        "gumbel_sample_f32",
        "gumbel_sample_bf16",
        "gumbel_sample_split_f32",
        "gumbel_sample_split_bf16",
    ];
    let emu = Emulator::build("kernels/sample.cu", SOURCE, &kernels).unwrap();
    let mut rng = StdRng::seed_from_u64(31);
    for (rows, vocab, std, all_parts) in [
        (3, 151_936, 0.3, &[3u32, 18][..]),
        (3, 32_003, 3.0, &[1, 5]),
        (4, 4_100, 12.0, &[2, 7]),
        (3, 200, 1.0, &[64]),
    ] {
        let mut logits = logits(&mut rng, rows, vocab, std);
        logits[1][7] = f32::NAN;
        logits[2][vocab - 1] = f32::NEG_INFINITY;
        let draws = checked_draws(rows);
        for bf16 in [false, true] {
            if bf16 {
                for x in logits.iter_mut().flatten() {
                    *x = half::bf16::from_f32(*x).to_f32();
                }
            }
            for noise in [Noise::Every, Noise::Lazy] {
                let one = Launch {
                    bf16,
                    noise,
                    ..Launch::default()
                };
                let (want, _) = launch(&emu, &logits, &draws, one);
                // Each part count twice, the emulation running the blocks first to last in one
                // launch and last to first in the other (so another part merges), over rows
                // aligned for the groups' vector loads and off them.
                let launches = all_parts
                    .iter()
                    .flat_map(|&p| [(p, 0), (p, 1 + p as usize % 3)]);
                for (parts, skew) in launches {
                    let how = Launch {
                        parts: Some(parts),
                        skew,
                        ..one
                    };
                    let what = format!("vocabulary {vocab}, std {std}, {how:?}");
                    let (got, arrived) = launch(&emu, &logits, &draws, how);
                    // The last part of each draw leaves its count at zero for the next launch.
                    assert!(arrived.iter().all(|&c| c == 0), "{what}: {arrived:?}");
                    for (i, ((d, w), g)) in draws.iter().zip(&want).zip(&got).enumerate() {
                        let p = &d.params;
                        let truncated = p.inv_temperature > 0.0
                            && ((p.top_k > 0 && (p.top_k as usize) < vocab)
                                || p.top_p < 1.0
                                || p.min_p > 0.0);
                        let what = format!("{what}, draw {i} {p:?}");
                        if truncated {
                            assert_eq!(format!("{g:?}"), format!("{w:?}"), "{what}");
                            continue;
                        }
                        assert_eq!(g.token, w.token, "{what}");
                        let ids =
                            |d: &Drawn| d.top_logprobs.iter().map(|t| t.0).collect::<Vec<_>>();
                        assert_eq!(ids(g), ids(w), "{what}");
                        let mut pairs =
                            vec![(g.logprob, w.logprob), (g.model_logprob, w.model_logprob)];
                        pairs.extend(
                            g.top_logprobs
                                .iter()
                                .zip(&w.top_logprobs)
                                .map(|(a, b)| (a.1, b.1)),
                        );
                        for (a, b) in pairs {
                            assert!((a - b).abs() <= LOGPROB_TOL, "{what}: {a} against {b}");
                        }
                    }
                }
            }
        }
    }
}

/// The truncation's search finds the same cut whatever its thresholds a pass: the kernel
/// built with 2 parts a pass (a bisection), 3, 5 and 16 draws what the default (7) draws, bit
/// for bit, over top-k from 1 to nearly the vocabulary, top-p from 0.5 to 0.999 and min-p, on
/// close, spread and tied logits, f32 and bf16; and the default draws the host reference's
/// tokens.
#[test]
fn the_cut_is_the_same_whatever_the_searchs_parts() {
    let kernels = ["gumbel_sample_f32", "gumbel_sample_bf16"];
    let build = |splits: Option<u32>| {
        let source = match splits {
            Some(n) => format!("#define SPLITS {n}\n#line 1\n{SOURCE}"),
            None => SOURCE.to_string(),
        };
        Emulator::build("kernels/sample.cu", &source, &kernels).unwrap()
    };
    let default = build(None);
    let others: Vec<Emulator> = [2, 3, 5, 16].map(|n| build(Some(n))).into();
    let mut rng = StdRng::seed_from_u64(29);
    // A vocabulary past the passes' unrolled loads, one whose last unrolled load is its last
    // logit (2,047 = 8 x 256 - 1), and one smaller than the block.
    for vocab in [20_011, 2_047, 200] {
        let mut rows = logits(&mut rng, 3, vocab, 0.3);
        rows.extend(logits(&mut rng, 3, vocab, 6.0));
        // Ties at every cut: a few values only; and two adjacent floats, so that a cut one
        // key too low keeps more.
        rows.push((0..vocab).map(|i| (i % 5) as f32 * 0.25).collect());
        let above_one = f32::from_bits(1.0f32.to_bits() + 1);
        rows.push(
            (0..vocab)
                .map(|i| if i % 97 == 0 { above_one } else { 1.0 })
                .collect(),
        );
        let draws = truncated_draws(rows.len());
        for bf16 in [false, true] {
            if bf16 {
                for x in rows.iter_mut().flatten() {
                    *x = half::bf16::from_f32(*x).to_f32();
                }
            }
            let want = emulate(&default, &rows, &draws, bf16, Noise::Every);
            let agreement = Agreement::of(&rows, &draws, &want);
            let what = format!("vocabulary {vocab}, bf16 {bf16}");
            assert_eq!(agreement.agreed, draws.len(), "{what}: {agreement:?}");
            for (emu, splits) in others.iter().zip([2, 3, 5, 16]) {
                let got = emulate(emu, &rows, &draws, bf16, Noise::Every);
                assert_eq!(got, want, "{splits} parts a pass, {what}");
            }
        }
    }
}

/// For each of `rows` rows, draws truncated by top-k from 1 to 20,000, top-p from 0.5 to
/// 0.999, both, and min-p with top-p, at temperatures 1 and 0.7.
fn truncated_draws(rows: usize) -> Vec<DeviceDraw> {
    let truncations = [
        (1, 1.0f32, 0.0f32),
        (50, 1.0, 0.0),
        (7_919, 1.0, 0.0),
        (20_000, 1.0, 0.0),
        (0, 0.5, 0.0),
        (0, 0.99, 0.0),
        (0, 0.999, 0.0),
        (100, 0.9, 0.0),
        (0, 0.95, 0.01),
    ];
    let mut draws = Vec::new();
    for row in 0..rows {
        for (i, &(top_k, top_p, min_p)) in truncations.iter().enumerate() {
            let mut draw = checked_draws(1)[0];
            draw.row = row as u32;
            draw.key.position = 5 + i as u32;
            draw.params = crate::gumbel::DrawParams {
                inv_temperature: [1.0, 1.0 / 0.7][(row + i) % 2],
                top_k,
                top_p,
                min_p,
                top_logprobs: 0,
            };
            draws.push(draw);
        }
    }
    draws
}
