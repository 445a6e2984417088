//! The DPPO learner: GRPO at zero rates, Monte-Carlo unbiasedness of pruning (with proof of
//! power against the biased baselines), packing invariance, and learning progress.

use std::collections::BTreeMap;

use candle_core::{Device, Tensor};
use dppo_model::ops::token_logprobs;
use dppo_model::{Arch, CausalAttention, CausalLm};
use dppo_trainer::learner::{Learner, LearnerConfig};
use dppo_trainer::loss::LossAgg;
use dppo_trainer::prune::{
    cppo_completions, full_batch_normalisers, prune_completions, Algorithm, BatchShape,
    CandidateRule, CompletionScope, Cppo, Kept, LevelConfig, PromptHistory, PromptPredictor,
    PruneMode, PruningAlgorithm,
};
use dppo_trainer::train_batch::{build_train_batch, TrainBatch};
use dppo_trainer::{compute_advantages, Group, Sample, ScaleRewards};
use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::util::{random_weights, small_config};

const G: usize = 4;
const MAX_LEN: usize = 6;

fn learner(agg: LossAgg, pack_tokens: usize) -> Learner {
    let cfg = small_config(Arch::Llama);
    let weights = random_weights(&cfg, 5);
    let mut lc = LearnerConfig::token_mean(1e-2, 0.0, pack_tokens, 8);
    lc.loss.loss_agg = agg;
    Learner::new(&cfg, &weights, lc).unwrap()
}

/// Completion-token logprobs of `prompt + completion` under `model`, one sequence alone.
fn logprobs_of(model: &CausalLm, prompt: &[u32], completion: &[u32]) -> Vec<f32> {
    let ids: Vec<u32> = prompt.iter().chain(completion).copied().collect();
    let n = ids.len();
    let t = Tensor::new(ids.as_slice(), &Device::Cpu).unwrap();
    let pos = Tensor::arange(0u32, n as u32, &Device::Cpu).unwrap();
    let h = model.forward(&t, &pos, &mut CausalAttention).unwrap();
    let p = prompt.len();
    let logits = model.logits(&h.narrow(0, p - 1, n - p).unwrap()).unwrap();
    token_logprobs(&logits, &t.narrow(0, p, n - p).unwrap())
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// A fixed batch: 6 prompts x G samples, 0/1 rewards (two groups without signal), rollout
/// logprobs near the model's (so that some ratios clip).
pub(crate) fn batch(model: &CausalLm) -> Vec<Group> {
    let mut rng = StdRng::seed_from_u64(9);
    let vocab = model.config().vocab_size as u32;
    let rewards = [
        [1., 0., 0., 1.],
        [1., 1., 1., 1.],
        [0., 0., 1., 0.],
        [0., 0., 0., 0.],
        [1., 1., 0., 1.],
        [0., 1., 1., 0.],
    ];
    let mut groups: Vec<Group> = rewards
        .iter()
        .enumerate()
        .map(|(j, rs)| {
            let prompt: Vec<u32> = (0..2 + j % 3).map(|_| rng.random_range(0..vocab)).collect();
            let samples = rs
                .iter()
                .map(|&reward| {
                    let len = 2 + rng.random_range(0..MAX_LEN - 1);
                    let completion: Vec<u32> =
                        (0..len).map(|_| rng.random_range(0..vocab)).collect();
                    let lp = logprobs_of(model, &prompt, &completion);
                    let rollout_logprobs =
                        lp.iter().map(|x| x + rng.random_range(-0.4..0.4)).collect();
                    Sample {
                        prompt_ids: prompt.clone(),
                        completion_ids: completion,
                        reward,
                        rollout_logprobs,
                        policy_version: 0,
                    }
                })
                .collect();
            Group::new(j as u64, samples)
        })
        .collect();
    compute_advantages(&mut groups, ScaleRewards::Group);
    groups
}

/// Fixed random directions to project gradients on.
fn directions(learner: &Learner, num: usize) -> Vec<BTreeMap<String, Tensor>> {
    (0..num as u64)
        .map(|d| {
            let mut rng = StdRng::seed_from_u64(100 + d);
            learner
                .vars
                .iter()
                .map(|(n, v)| {
                    let data: Vec<f32> = (0..v.elem_count())
                        .map(|_| rng.random_range(-1.0..1.0))
                        .collect();
                    (
                        n.clone(),
                        Tensor::from_vec(data, v.shape(), &Device::Cpu).unwrap(),
                    )
                })
                .collect()
        })
        .collect()
}

fn project(grads: &BTreeMap<String, Tensor>, dirs: &[BTreeMap<String, Tensor>]) -> Vec<f64> {
    dirs.iter()
        .map(|d| {
            grads
                .iter()
                .map(|(n, g)| {
                    (g * &d[n])
                        .unwrap()
                        .sum_all()
                        .unwrap()
                        .to_scalar::<f32>()
                        .unwrap() as f64
                })
                .sum()
        })
        .collect()
}

pub(crate) fn all_kept(groups: &[Group]) -> Vec<Kept> {
    let mut rng = StdRng::seed_from_u64(0);
    prune_completions(
        groups,
        &LevelConfig::off(),
        CompletionScope::Group,
        0.0,
        &mut rng,
    )
}

/// The train batch of `kept` with `algorithm`'s normalisers, every prompt of `groups` drawn.
pub(crate) fn train_batch(groups: &[Group], kept: &[Kept], algorithm: Algorithm) -> TrainBatch {
    let shape = BatchShape {
        prompts_per_step: groups.len(),
        group_size: G,
        max_len: MAX_LEN,
        beta: 0.0,
        scope: CompletionScope::Group,
    };
    let norm = match algorithm {
        Algorithm::Cppo => Cppo::new(shape, 0.0).normalisers(groups, kept, groups.len()),
        Algorithm::Grpo | Algorithm::Dppo | Algorithm::Greso => {
            full_batch_normalisers(groups, groups.len(), &shape)
        }
    };
    build_train_batch(groups, kept, norm)
}

#[test]
fn zero_rates_are_grpo_bit_for_bit() {
    let learner = learner(LossAgg::TokenMean, 64);
    let groups = batch(&learner.model);
    let grpo = all_kept(&groups);
    let mut rng = StdRng::seed_from_u64(1);
    let mut history = PromptHistory::new(0.5);
    history.update(&groups, 0);
    let zero = LevelConfig::off();
    let w_q = history.select(
        &(0..6).collect::<Vec<_>>(),
        &zero,
        PromptPredictor::SignalEma,
        &mut rng,
    );
    assert!(w_q.iter().all(|w| *w == Some(1.0)));
    let dppo = prune_completions(&groups, &zero, CompletionScope::Group, 0.0, &mut rng);
    assert_eq!(dppo, grpo);
    assert!(dppo.iter().all(|k| k.weight == 1.0));
    let (g1, m1) = learner
        .gradients(&train_batch(&groups, &grpo, Algorithm::Grpo))
        .unwrap();
    let (g2, m2) = learner
        .gradients(&train_batch(&groups, &dppo, Algorithm::Dppo))
        .unwrap();
    assert_eq!(m1.pg_loss.to_bits(), m2.pg_loss.to_bits());
    for (name, g) in &g1 {
        let (a, b) = (crate::util::flat(g), crate::util::flat(&g2[name]));
        assert!(
            a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
            "{name}"
        );
    }
}

/// Projected gradient of each signal-carrying completion alone (weight 1) under the full
/// batch's normalisers. The batch gradient is linear in the weights, so any pruned estimate
/// is `sum_kept w_k * p_k` (checked against a real backward below).
fn contributions(
    learner: &Learner,
    groups: &[Group],
    dirs: &[BTreeMap<String, Tensor>],
) -> BTreeMap<(usize, usize), Vec<f64>> {
    let full = train_batch(groups, &all_kept(groups), Algorithm::Dppo);
    all_kept(groups)
        .iter()
        .zip(&full.seqs)
        .map(|(k, seq)| {
            let one = TrainBatch {
                seqs: vec![seq.clone()],
                norm: full.norm,
            };
            let (g, _) = learner.gradients(&one).unwrap();
            ((k.group_idx, k.sample_idx), project(&g, dirs))
        })
        .collect()
}

/// One pruning draw of DPPO at the prompt level (`level_q`), then the completion level.
fn draw(
    groups: &[Group],
    history: &mut PromptHistory,
    level_q: &LevelConfig,
    level_o: &LevelConfig,
    scope: CompletionScope,
    rng: &mut StdRng,
) -> Vec<Kept> {
    let ids: Vec<u64> = groups.iter().map(|g| g.prompt_id).collect();
    let w_q = history.select(&ids, level_q, PromptPredictor::SignalEma, rng);
    let rolled: Vec<usize> = (0..groups.len()).filter(|&j| w_q[j].is_some()).collect();
    let subset: Vec<Group> = rolled
        .iter()
        .map(|&j| Group {
            w_q: w_q[j].unwrap(),
            ..groups[j].clone()
        })
        .collect();
    let kept = prune_completions(&subset, level_o, scope, 0.0, rng);
    let bound = 1.0 / ((1.0 - level_q.rate) * (1.0 - level_o.rate));
    kept.into_iter()
        .map(|k| {
            assert!(
                k.weight >= 1.0 && k.weight <= bound + 1e-12,
                "weight {} out of bounds",
                k.weight
            );
            Kept {
                group_idx: rolled[k.group_idx],
                ..k
            }
        })
        .collect()
}

/// Mean and standard error per direction of `num_draws` pruned estimates.
fn monte_carlo(
    p: &BTreeMap<(usize, usize), Vec<f64>>,
    mut one_draw: impl FnMut() -> Vec<Kept>,
    num_draws: usize,
) -> Vec<(f64, f64)> {
    let dims = p.values().next().unwrap().len();
    let mut sums = vec![(0f64, 0f64); dims];
    for _ in 0..num_draws {
        let mut est = vec![0f64; dims];
        for k in one_draw() {
            for (e, x) in est.iter_mut().zip(&p[&(k.group_idx, k.sample_idx)]) {
                *e += k.weight * x;
            }
        }
        for (s, e) in sums.iter_mut().zip(est) {
            s.0 += e;
            s.1 += e * e;
        }
    }
    let n = num_draws as f64;
    sums.iter()
        .map(|&(s, sq)| {
            let mean = s / n;
            let var = (sq / n - mean * mean).max(0.0) * n / (n - 1.0);
            (mean, (var / n).sqrt())
        })
        .collect()
}

/// The test: every projected mean within 4 standard errors of the full-batch value.
fn is_unbiased(stats: &[(f64, f64)], full: &[f64]) -> bool {
    stats
        .iter()
        .zip(full)
        .all(|(&(mean, se), &f)| (mean - f).abs() <= 4.0 * se + 1e-9 * f.abs())
}

fn level(rate: f64, candidates: CandidateRule, mode: PruneMode) -> LevelConfig {
    LevelConfig {
        rate,
        candidates,
        mode,
    }
}

#[test]
fn pruned_gradients_are_unbiased_and_the_test_detects_bias() {
    let below = CandidateRule::BelowMean;
    let lowest = CandidateRule::LowestFraction { fraction: 0.67 };
    let fixed = PruneMode::FixedCount;
    let off = LevelConfig::off();
    for agg in [
        LossAgg::SeqMeanTokenMean,
        LossAgg::SeqMeanTokenSumNorm,
        LossAgg::TokenMean,
    ] {
        let learner = learner(agg, 64);
        let groups = batch(&learner.model);
        let dirs = directions(&learner, 3);
        let p = contributions(&learner, &groups, &dirs);
        // Linearity: the sum of the parts is the real full-batch gradient.
        let full = project(
            &learner
                .gradients(&train_batch(&groups, &all_kept(&groups), Algorithm::Dppo))
                .unwrap()
                .0,
            &dirs,
        );
        let parts: Vec<f64> = (0..3).map(|d| p.values().map(|x| x[d]).sum()).collect();
        for (a, b) in full.iter().zip(&parts) {
            assert!(
                (a - b).abs() <= 1e-4 * a.abs().max(1e-3),
                "{agg:?}: {a} vs {b}"
            );
        }
        // A stale history: each prompt's record is its neighbour's, so that below-mean
        // prompt candidates include prompts that carry signal (as real predictions do).
        let mut history = PromptHistory::new(0.5);
        let stale: Vec<Group> = groups
            .iter()
            .zip(groups.iter().cycle().skip(1))
            .map(|(g, next)| Group {
                samples: next.samples.clone(),
                advantages: next.advantages.clone(),
                ..g.clone()
            })
            .collect();
        history.update(&stale, 0);
        let mut rng = StdRng::seed_from_u64(2024);
        // Every design that claims unbiasedness: each prompt-level draw (off, fixed count,
        // Poisson) with each completion-level draw and scope. Token-mean is exactly
        // unbiased only without prompt pruning (its N_tok is then estimated).
        let prompt_levels = [
            ("no prompt pruning", off),
            ("prompt fixed/below-mean", level(0.5, below, fixed)),
            ("prompt fixed/lowest", level(0.5, lowest, fixed)),
            (
                "prompt poisson/lowest",
                level(0.5, lowest, PruneMode::Poisson),
            ),
        ];
        let completion_levels = [
            ("no completion pruning", off, CompletionScope::Group),
            (
                "fixed/below-mean/group",
                level(0.5, below, fixed),
                CompletionScope::Group,
            ),
            (
                "fixed/lowest/batch",
                level(0.6, lowest, fixed),
                CompletionScope::Batch,
            ),
            (
                "poisson/below-mean/group",
                level(0.5, below, PruneMode::Poisson),
                CompletionScope::Group,
            ),
            (
                "poisson/below-mean/batch",
                level(0.5, below, PruneMode::Poisson),
                CompletionScope::Batch,
            ),
        ];
        let mut cases = Vec::new();
        for (i, &(q_name, lq)) in prompt_levels.iter().enumerate() {
            for (j, &(o_name, lo, scope)) in completion_levels.iter().enumerate() {
                let exact = agg != LossAgg::TokenMean || i == 0;
                if (i, j) != (0, 0) && exact {
                    cases.push((format!("{q_name} + {o_name}"), lq, lo, scope));
                }
            }
        }
        for (name, lq, lo, scope) in cases {
            let stats = monte_carlo(
                &p,
                || draw(&groups, &mut history, &lq, &lo, scope, &mut rng),
                3000,
            );
            // Against the exact sum of the parts (the real backward agrees with it to f32
            // rounding, checked above), which a draw that prunes only zero-signal prompts
            // reproduces to the last bits.
            assert!(
                is_unbiased(&stats, &parts),
                "{agg:?} {name}: {stats:?} vs {parts:?}"
            );
            assert!(
                stats.iter().any(|s| s.1 > 0.0),
                "{name}: no pruning happened"
            );
        }
        // Proof of power: the same test flags the deterministic ablation and CPPO.
        let det = level(0.5, below, PruneMode::Deterministic);
        let stats = monte_carlo(
            &p,
            || {
                draw(
                    &groups,
                    &mut history,
                    &off,
                    &det,
                    CompletionScope::Batch,
                    &mut rng,
                )
            },
            50,
        );
        assert!(
            !is_unbiased(&stats, &full),
            "{agg:?}: deterministic pruning should look biased"
        );
        let cppo = cppo_completions(&groups, 0.5, 0.0);
        let cppo_grad = project(
            &learner
                .gradients(&train_batch(&groups, &cppo, Algorithm::Cppo))
                .unwrap()
                .0,
            &dirs,
        );
        let stats: Vec<(f64, f64)> = cppo_grad.iter().map(|&m| (m, 0.0)).collect();
        assert!(
            !is_unbiased(&stats, &full),
            "{agg:?}: CPPO should look biased"
        );
    }
}

#[test]
fn dropping_zero_advantage_items_changes_nothing() {
    let learner = learner(LossAgg::SeqMeanTokenMean, 64);
    let groups = batch(&learner.model);
    let signal = all_kept(&groups);
    let mut everything = Vec::new();
    for (g, group) in groups.iter().enumerate() {
        for i in 0..group.samples.len() {
            everything.push(Kept {
                group_idx: g,
                sample_idx: i,
                weight: 1.0,
            });
        }
    }
    assert!(
        everything.len() > signal.len(),
        "the batch has zero-advantage groups"
    );
    let (a, ma) = learner
        .gradients(&train_batch(&groups, &signal, Algorithm::Dppo))
        .unwrap();
    let (b, mb) = learner
        .gradients(&train_batch(&groups, &everything, Algorithm::Dppo))
        .unwrap();
    assert!((ma.pg_loss - mb.pg_loss).abs() <= 1e-7);
    for (name, g) in &a {
        assert_close!(crate::util::flat(g), crate::util::flat(&b[name]), 1e-6);
    }
}

#[test]
fn one_buffer_equals_many_buffers() {
    let groups = batch(&learner(LossAgg::TokenMean, 64).model);
    let kept = all_kept(&groups);
    let one = learner(LossAgg::TokenMean, 4096);
    let many = learner(LossAgg::TokenMean, 12);
    let tb = train_batch(&groups, &kept, Algorithm::Dppo);
    let (a, ma) = one.gradients(&tb).unwrap();
    let (b, mb) = many.gradients(&tb).unwrap();
    assert_eq!(ma.num_buffers, 1);
    assert!(mb.num_buffers >= 4, "{} buffers", mb.num_buffers);
    assert!((ma.pg_loss - mb.pg_loss).abs() <= 1e-6);
    for (name, g) in &a {
        let scale = crate::util::flat(g)
            .iter()
            .fold(1f32, |m, x| m.max(x.abs()));
        assert_close!(
            crate::util::flat(g),
            crate::util::flat(&b[name]),
            1e-5 * scale
        );
    }
}

#[test]
fn repeated_steps_raise_the_advantage_weighted_logprob() {
    let mut learner = learner(LossAgg::SeqMeanTokenMean, 64);
    let groups = batch(&learner.model);
    let kept = all_kept(&groups);
    let objective = |model: &CausalLm| -> f64 {
        kept.iter()
            .map(|k| {
                let s = &groups[k.group_idx].samples[k.sample_idx];
                let lp: f32 = logprobs_of(model, &s.prompt_ids, &s.completion_ids)
                    .iter()
                    .sum();
                groups[k.group_idx].advantages[k.sample_idx] * lp as f64
            })
            .sum()
    };
    let before = objective(&learner.model);
    // Rollout logprobs = current ones each step (on-policy), as in the real loop.
    for _ in 0..5 {
        let mut fresh = groups.clone();
        for g in fresh.iter_mut() {
            for s in g.samples.iter_mut() {
                s.rollout_logprobs = logprobs_of(&learner.model, &s.prompt_ids, &s.completion_ids);
            }
        }
        learner
            .step(&train_batch(&fresh, &kept, Algorithm::Dppo))
            .unwrap();
    }
    let after = objective(&learner.model);
    assert!(after > before + 1.0, "objective {before} -> {after}");
}

#[test]
fn kl_reference_is_the_frozen_initial_policy() {
    let plain = learner(LossAgg::TokenMean, 64);
    let mut cfg = plain.cfg;
    cfg.loss.beta = 0.5;
    let model_cfg = plain.model.config().clone();
    let mut with_kl = Learner::new(&model_cfg, &plain.weights().unwrap(), cfg).unwrap();
    let groups = batch(&plain.model);
    let tb = train_batch(&groups, &all_kept(&groups), Algorithm::Dppo);
    // At the reference, k3 KL and its gradient are zero.
    let (a, ma) = plain.gradients(&tb).unwrap();
    let (b, mb) = with_kl.gradients(&tb).unwrap();
    assert!((ma.pg_loss - mb.pg_loss).abs() < 1e-7);
    for (name, g) in &a {
        assert_close!(crate::util::flat(g), crate::util::flat(&b[name]), 1e-6);
    }
    // After steps the policy moves, the reference does not, and the KL term is positive.
    let reference_before =
        logprobs_of(&with_kl.reference.as_ref().unwrap().model, &[1, 2], &[3, 4]);
    for _ in 0..3 {
        with_kl.step(&tb).unwrap();
    }
    assert_eq!(
        logprobs_of(&with_kl.reference.as_ref().unwrap().model, &[1, 2], &[3, 4]),
        reference_before
    );
    let without = Learner::new(&model_cfg, &with_kl.weights().unwrap(), plain.cfg).unwrap();
    let (_, m_kl) = with_kl.gradients(&tb).unwrap();
    let (_, m_plain) = without.gradients(&tb).unwrap();
    assert!(
        m_kl.pg_loss > m_plain.pg_loss,
        "{} vs {}",
        m_kl.pg_loss,
        m_plain.pg_loss
    );
}

/// The real data sets shipped in the repository.
fn data_dir() -> std::path::PathBuf {
    crate::util::repo_root().join("data")
}

/// Every gold answer of the shipped data sets, as (`file:line`, raw answer).
fn gold_answers() -> Vec<(String, String)> {
    let files = [
        "gsm8k/train.jsonl",
        "gsm8k/test.jsonl",
        "eval/math500.jsonl",
        "eval/aime24.jsonl",
        "eval/aime25.jsonl",
        "eval/amc2023.jsonl",
        "eval/minervamath.jsonl",
        "eval/olympiadbench.jsonl",
    ];
    let mut out = Vec::new();
    for file in files {
        let path = data_dir().join(file);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for (line_no, line) in text.lines().enumerate() {
            let row: serde_json::Value = serde_json::from_str(line).unwrap();
            let raw = row["answer"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| row["answer"].to_string());
            out.push((format!("{file}:{}", line_no + 1), raw));
        }
    }
    out
}

/// Every gold answer of the real data sets parses, and a completion boxing it scores 1 in
/// every mode that reads `\boxed{}`.
#[test]
fn verifier_accepts_every_real_gold_answer() {
    use dppo_rewards::{equivalent, parse_gold, verify, ExtractMode};
    let golds = gold_answers();
    assert!(golds.len() > 10_000, "{} gold answers", golds.len());
    for (at, raw) in golds {
        let gold = parse_gold(&raw).unwrap_or_else(|e| panic!("{at}: {e}"));
        // `dppo score` reads gold answers back from the normal form `--samples` writes.
        let again = parse_gold(&gold.to_string()).unwrap_or_else(|e| panic!("{at}: {e}"));
        assert!(
            equivalent(&again, &gold),
            "{at}: {gold} reads back as {again}"
        );
        let final_answer = raw.rsplit("####").next().unwrap().trim();
        let completion = format!("Reasoning... so the result is \\boxed{{{final_answer}}}.");
        for mode in [
            ExtractMode::Boxed,
            ExtractMode::Strict,
            ExtractMode::Flexible,
        ] {
            let verdict = verify(&completion, false, &gold, mode);
            assert!(
                verdict.is_correct,
                "{at} ({mode}): {raw:?} parsed as {gold}"
            );
        }
    }
}
