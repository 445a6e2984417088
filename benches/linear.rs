//! `x @ w^T` on SmolLM2-135M's shapes: our `linear` (the AVX-512 kernel where the CPU has
//! it) against candle's matmul in the same process. 32 rows is a decode step of 4 prompts x
//! 8 samples; 512 rows is a prefill or a packed training row. builtin:tiny's 256-row decode
//! step of the default run (32 prompts x 8 samples) runs short dot products (k = 64, 176).

use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, Criterion};
use dppo_model::linear::linear;

fn shapes(c: &mut Criterion) {
    let dev = Device::Cpu;
    // (rows, out, in): q/o projection, gate/up, down, lm_head.
    for (m, n, k) in [
        (32, 576, 576),
        (32, 1536, 576),
        (32, 576, 1536),
        (32, 49152, 576),
        (512, 1536, 576),
        (256, 176, 64),
        (256, 64, 176),
    ] {
        let x = Tensor::randn(0f32, 1.0, (m, k), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap();
        let mut group = c.benchmark_group(format!("linear_{m}x{n}x{k}"));
        group.sample_size(20);
        group.bench_function("dppo", |b| b.iter(|| linear(&x, &w, None).unwrap()));
        group.bench_function("candle_matmul", |b| {
            b.iter(|| x.matmul(&w.t().unwrap()).unwrap())
        });
        group.finish();
    }
}

criterion_group!(benches, shapes);
criterion_main!(benches);
