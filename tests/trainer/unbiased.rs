//! Monte-Carlo unbiasedness of pruning: the mean of many pruned gradient estimates is the
//! full batch's, for every claimed combination, and the test has the power to catch the
//! biased baselines.

use super::*;

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
