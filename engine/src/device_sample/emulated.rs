//! kernels/sample.cu itself, run on the CPU ([`crate::kernel_emu`]) over the draws `dppo
//! doctor` checks on a GPU, held to the host reference by the same measure.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::{
    checked_draws, push_args, Agreement, DeviceDraw, DrawInputs, DrawOutputs, SOURCE, THREADS,
};
use crate::gumbel::Drawn;
use crate::kernel_emu::{Args, Emulator};
use crate::sampler::MAX_TOP_LOGPROBS;

/// `draws` from `rows` (each `vocab` long) by the emulated kernel, launched as
/// [`super::sample`] launches it on a GPU: on the rows in f32, or in bf16 (`bf16`, the rows
/// then being bf16 values already).
fn emulate(emu: &Emulator, rows: &[Vec<f32>], draws: &[DeviceDraw], bf16: bool) -> Vec<Drawn> {
    let logits: Vec<f32> = rows.concat();
    let halves: Vec<half::bf16> = logits.iter().map(|&x| half::bf16::from_f32(x)).collect();
    let vocab = rows[0].len() as u32;
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
    let (kernel, args) = if bf16 {
        let ptr = halves.as_ptr();
        let args = Args::filled(|list| push_args(list, ptr, &vocab, &inputs, &mut out));
        ("gumbel_sample_bf16", args)
    } else {
        let ptr = logits.as_ptr();
        let args = Args::filled(|list| push_args(list, ptr, &vocab, &inputs, &mut out));
        ("gumbel_sample_f32", args)
    };
    emu.launch(kernel, (n as u32, 1, 1), (THREADS, 1, 1), 0, &args)
        .unwrap();
    out.drawn(&inputs.n_tops)
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
    // as spread as a trained model's (std 12) leave most scores too low to draw noise for.
    for bf16 in [false, true] {
        for (rows, vocab, std) in [(16, 151_936, 3.0), (6, 32_003, 3.0), (16, 151_936, 12.0)] {
            let mut logits = logits(&mut rng, rows, vocab, std);
            logits[1][7] = f32::NAN;
            logits[2][vocab - 1] = f32::NEG_INFINITY;
            if bf16 {
                for x in logits.iter_mut().flatten() {
                    *x = half::bf16::from_f32(*x).to_f32();
                }
            }
            let draws = checked_draws(rows);
            let got = emulate(&emu, &logits, &draws, bf16);
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
        }
    }
}
