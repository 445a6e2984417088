//! The sampler on a SmolLM2-sized vocabulary (49152): plain temperature sampling, top-k,
//! and top-p, one row per call (the engine samples rows in parallel).

use criterion::{criterion_group, criterion_main, Criterion};
use dppo_engine::sampler::{sample, SamplingParams, SeqRng};
use rand::{rngs::StdRng, Rng, SeedableRng};

fn sampler(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(0);
    let logits: Vec<f32> = (0..49152).map(|_| rng.random_range(-10.0..10.0)).collect();
    let mut seq_rng = SeqRng::new(0, 0);
    for (name, params) in [
        ("temperature_1", SamplingParams::default()),
        (
            "top_k_50",
            SamplingParams {
                top_k: 50,
                ..SamplingParams::default()
            },
        ),
        (
            "top_p_0.9",
            SamplingParams {
                top_p: 0.9,
                ..SamplingParams::default()
            },
        ),
        (
            "greedy",
            SamplingParams {
                temperature: 0.0,
                ..SamplingParams::default()
            },
        ),
    ] {
        c.bench_function(&format!("sample_49152_{name}"), |b| {
            b.iter(|| sample(&logits, &params, &mut seq_rng))
        });
    }
}

criterion_group!(benches, sampler);
criterion_main!(benches);
