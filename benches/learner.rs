//! One learner step (packed forward/backward, clipping, AdamW) on builtin:tiny: 32 sequences
//! of 64 prompt + 64 completion tokens. `dppo bench train` reports the same as tokens/s and
//! as a fraction of the machine's matmul peak, on any model.

use candle_core::Device;
use criterion::{criterion_group, criterion_main, Criterion};
use dppo_model::Policy;
use dppo_trainer::learner::{Learner, LearnerConfig};
use dppo_trainer::loss::{Normalisers, TrainSeq};
use dppo_trainer::train_batch::TrainBatch;

fn learner_step(c: &mut Criterion) {
    let policy = Policy::load("builtin:tiny", &Device::Cpu).unwrap();
    let vocab = policy.config.vocab_size as u32;
    let seqs: Vec<TrainSeq> = (0..32)
        .map(|i| TrainSeq {
            tokens: (0..128).map(|t| (i * 31 + t * 7) % vocab).collect(),
            num_prompt_tokens: 64,
            advantage: if i % 2 == 0 { 1.0 } else { -1.0 },
            weight: 1.0,
            rollout_logprobs: vec![-3.0; 64],
        })
        .collect();
    let batch = TrainBatch {
        seqs,
        norm: Normalisers {
            num_seqs: 32.0,
            num_tokens: 32.0 * 64.0,
            max_len: 64.0,
        },
    };
    let cfg = LearnerConfig::token_mean(1e-6, 1.0, 1024, 64);
    let mut learner = Learner::new(&policy.config, &policy.weights, cfg).unwrap();
    c.bench_function("learner_step_tiny_4096_tokens", |b| {
        b.iter(|| learner.step(&batch).unwrap())
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10);
    targets = learner_step
}
criterion_main!(benches);
