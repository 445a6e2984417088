//! Pruning + packing of a 4096-sequence batch (512 prompts x 8 samples): the per-step
//! bookkeeping that must stay negligible beside a training step.

use criterion::{criterion_group, criterion_main, Criterion};
use dppo_trainer::pack::pack;
use dppo_trainer::prune::{
    prune_completions, CandidateRule, CompletionScope, LevelConfig, PromptHistory, PromptPredictor,
    PruneMode,
};
use dppo_trainer::{compute_advantages, Group, Sample, ScaleRewards};
use rand::{rngs::StdRng, Rng, SeedableRng};

fn batch() -> Vec<Group> {
    let mut rng = StdRng::seed_from_u64(0);
    let mut groups: Vec<Group> = (0..512)
        .map(|j| {
            let prompt: Vec<u32> = (0..rng.random_range(32..256)).collect();
            let samples = (0..8)
                .map(|_| {
                    let len = rng.random_range(16..1024);
                    Sample {
                        prompt_ids: prompt.clone(),
                        completion_ids: vec![7; len],
                        reward: f64::from(rng.random_range(0..2u8)),
                        rollout_logprobs: vec![-1.0; len],
                        policy_version: 0,
                    }
                })
                .collect();
            Group::new(j, samples)
        })
        .collect();
    compute_advantages(&mut groups, ScaleRewards::Group);
    groups
}

fn prune_and_pack(c: &mut Criterion) {
    let groups = batch();
    let level = LevelConfig {
        rate: 0.5,
        candidates: CandidateRule::BelowMean,
        mode: PruneMode::FixedCount,
    };
    let mut history = PromptHistory::new(0.5);
    history.update(&groups, 0);
    let ids: Vec<u64> = (0..512).collect();
    let mut rng = StdRng::seed_from_u64(1);
    for (name, predictor) in [
        ("prune_prompts_512", PromptPredictor::SignalEma),
        ("prune_prompts_512_difficulty", PromptPredictor::Difficulty),
    ] {
        c.bench_function(name, |b| {
            b.iter(|| history.select(&ids, &level, predictor, &mut rng))
        });
    }
    c.bench_function("prune_completions_4096", |b| {
        b.iter(|| prune_completions(&groups, &level, CompletionScope::Group, 0.0, &mut rng))
    });
    let lengths: Vec<usize> = groups
        .iter()
        .flat_map(|g| {
            g.samples
                .iter()
                .map(|s| s.prompt_ids.len() + s.completion_ids.len())
        })
        .collect();
    c.bench_function("pack_4096_into_4096_token_buffers", |b| {
        b.iter(|| pack(&lengths, 4096, 64).unwrap())
    });
}

criterion_group!(benches, prune_and_pack);
criterion_main!(benches);
