//! GRESO (selective rollouts, arXiv 2506.02177), a biased baseline: skip a prompt before
//! rollout with probability `1 - max(p^z, 0.01)`, where `z` counts its most recent
//! consecutive all-correct (p = p_easy) or all-wrong (p = p_hard) visits; `p_easy` and
//! `p_hard` adapt toward a zero-variance target. No re-weighting.

use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::Rng;
use serde::{Deserialize, Serialize};

use super::{
    full_batch_normalisers, prune_completions, AlgorithmState, BatchShape, Drawn, Kept,
    LevelConfig, PromptPool, PruningAlgorithm,
};
use crate::group::Group;
use crate::loss::Normalisers;

/// Mean reward at or above which a visit counts as all-correct.
const EASY: f64 = 0.98;
/// Mean reward at or below which a visit counts as all-wrong.
const HARD: f64 = 0.11;
/// Zero-variance target: 0.25 of the batch, split 1/3 easy and 2/3 hard.
const TARGET_EASY: f64 = 0.25 / 3.0;
const TARGET_HARD: f64 = 0.25 * 2.0 / 3.0;
const STEP: f64 = 0.01;
/// Visits remembered per prompt.
const MEMORY: usize = 16;

/// GRESO's state; serialisable for checkpoints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GresoState {
    pub p_easy: f64,
    pub p_hard: f64,
    /// Mean reward of each recent visit, oldest first.
    pub visits: BTreeMap<u64, Vec<f64>>,
}

impl Default for GresoState {
    fn default() -> Self {
        Self {
            p_easy: 0.5,
            p_hard: 0.5,
            visits: BTreeMap::new(),
        }
    }
}

impl GresoState {
    /// Probability of skipping `prompt_id` now.
    pub fn skip_probability(&self, prompt_id: u64) -> f64 {
        let Some(history) = self.visits.get(&prompt_id) else {
            return 0.0;
        };
        let streak =
            |pred: &dyn Fn(f64) -> bool| history.iter().rev().take_while(|&&m| pred(m)).count();
        let (z, p) = match (streak(&|m| m >= EASY), streak(&|m| m <= HARD)) {
            (0, 0) => return 0.0,
            (easy, 0) => (easy, self.p_easy),
            (_, hard) => (hard, self.p_hard),
        };
        1.0 - p.powi(z as i32).max(0.01)
    }

    /// Which of `prompt_ids` to roll out (true) or skip (false).
    pub fn select<R: Rng>(&self, prompt_ids: &[u64], rng: &mut R) -> Vec<bool> {
        prompt_ids
            .iter()
            .map(|&id| rng.random::<f64>() >= self.skip_probability(id))
            .collect()
    }

    /// Records the step's groups and moves `p_easy`, `p_hard` toward the target.
    pub fn update(&mut self, groups: &[Group]) {
        if groups.is_empty() {
            return;
        }
        let mut easy = 0usize;
        let mut hard = 0usize;
        for g in groups {
            let mean = g.mean_reward();
            easy += usize::from(mean >= EASY);
            hard += usize::from(mean <= HARD);
            let h = self.visits.entry(g.prompt_id).or_default();
            h.push(mean);
            if h.len() > MEMORY {
                h.remove(0);
            }
        }
        let n = groups.len() as f64;
        let adapt = |p: f64, observed: f64, target: f64| {
            let p = if observed >= target {
                p - STEP
            } else {
                p + STEP
            };
            p.clamp(0.05, 0.95)
        };
        self.p_easy = adapt(self.p_easy, easy as f64 / n, TARGET_EASY);
        self.p_hard = adapt(self.p_hard, hard as f64 / n, TARGET_HARD);
    }
}

/// GRESO: its state and the batch it fills.
pub struct Greso {
    shape: BatchShape,
    state: GresoState,
}

impl Greso {
    pub fn new(shape: BatchShape) -> Self {
        Self {
            shape,
            state: GresoState::default(),
        }
    }
}

impl PruningAlgorithm for Greso {
    /// Selective rollout with its adaptive batch size: prompts are drawn until
    /// `prompts_per_step` of them are rolled out (at most one pass over the training set),
    /// so that skipping saves rollouts of uninformative prompts instead of shrinking the
    /// batch.
    fn draw(&mut self, pool: &mut PromptPool<'_>, rng: &mut StdRng) -> Drawn {
        let p = self.shape.prompts_per_step;
        let (mut problems, mut w_q) = (Vec::new(), Vec::new());
        let mut kept = 0;
        while kept < p && problems.len() < pool.len() {
            let (next, ids) = pool.next((p - kept).min(pool.len() - problems.len()));
            for keep in self.state.select(&ids, rng) {
                kept += usize::from(keep);
                w_q.push(keep.then_some(1.0));
            }
            problems.extend(next);
        }
        Drawn { problems, w_q }
    }

    fn update(&mut self, groups: &[Group], _step: u64) {
        self.state.update(groups);
    }

    fn select_completions(&self, groups: &[Group], _rate: f64, rng: &mut StdRng) -> Vec<Kept> {
        let shape = &self.shape;
        prune_completions(groups, &LevelConfig::off(), shape.scope, shape.beta, rng)
    }

    /// Without re-weighting GRESO normalises by the prompts it rolled out.
    fn normalisers(&self, groups: &[Group], _kept: &[Kept], _num_drawn: usize) -> Normalisers {
        full_batch_normalisers(groups, groups.len(), &self.shape)
    }

    fn state(&self) -> AlgorithmState {
        AlgorithmState {
            history: None,
            greso: Some(self.state.clone()),
        }
    }

    fn restore(&mut self, state: AlgorithmState) {
        if let Some(greso) = state.greso {
            self.state = greso;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group::test_group as group;
    use rand::SeedableRng;

    #[test]
    fn skip_probability_follows_the_streak() {
        let mut greso = GresoState::default();
        assert_eq!(
            greso.skip_probability(1),
            0.0,
            "unseen prompts are always rolled out"
        );
        // Prompt 1 all right twice; prompt 2 all wrong three times; prompt 3 mixed last.
        for _ in 0..2 {
            greso.visits.entry(1).or_default().push(1.0);
        }
        greso.visits.insert(2, vec![0.5, 0.0, 0.1, 0.0]);
        greso.visits.insert(3, vec![1.0, 1.0, 0.5]);
        assert!((greso.skip_probability(1) - (1.0 - 0.25)).abs() < 1e-12);
        assert!((greso.skip_probability(2) - (1.0 - 0.125)).abs() < 1e-12);
        assert_eq!(greso.skip_probability(3), 0.0);
        // The floor: never skipped with probability above 0.99.
        greso.visits.insert(4, vec![0.0; 16]);
        assert!((greso.skip_probability(4) - 0.99).abs() < 1e-12);
        let mut rng = StdRng::seed_from_u64(1);
        let kept = (0..4000)
            .filter(|_| greso.select(&[1], &mut rng)[0])
            .count();
        assert!((kept as f64 / 4000.0 - 0.25).abs() < 0.03);
    }

    #[test]
    fn greso_draws_until_the_rollout_batch_is_full() {
        let shape = BatchShape {
            prompts_per_step: 32,
            group_size: 8,
            max_len: 16,
            beta: 0.0,
            scope: crate::prune::CompletionScope::Group,
        };
        let mut greso = Greso::new(shape);
        let prompt_ids: Vec<u64> = (0..256).collect();
        let mut order = crate::data::ProblemOrder::new(0, crate::data::TRAIN_STREAM, 256);
        let mut rng = StdRng::seed_from_u64(3);
        // Every even prompt was all-correct on its last 16 visits: skipped with
        // probability 0.99 (GRESO's floor keeps 1%).
        for id in prompt_ids.iter().filter(|&&id| id % 2 == 0) {
            greso.state.visits.insert(*id, vec![1.0; 16]);
        }
        let mut pool = PromptPool {
            order: &mut order,
            prompt_ids: &prompt_ids,
        };
        let drawn = greso.draw(&mut pool, &mut rng);
        let kept = drawn.w_q.iter().filter(|w| w.is_some()).count();
        assert_eq!(kept, 32, "the rollout batch stays full");
        assert!(
            drawn.problems.len() > 50,
            "about half the drawn prompts are skipped"
        );
        assert_eq!(order.drawn(), drawn.problems.len() as u64);
        // With fewer rollable prompts than a batch, one pass over the training set ends it.
        for &id in &prompt_ids {
            greso.state.visits.insert(id, vec![1.0; 16]);
        }
        let mut pool = PromptPool {
            order: &mut order,
            prompt_ids: &prompt_ids,
        };
        assert_eq!(greso.draw(&mut pool, &mut rng).problems.len(), 256);
    }

    #[test]
    fn exploration_probabilities_adapt_toward_the_target() {
        let mut greso = GresoState::default();
        // Every group all right: too many easy ones (p_easy down), too few hard (p_hard up).
        greso.update(&[group(1, &[1.0, 1.0]), group(2, &[1.0, 1.0])]);
        assert!((greso.p_easy - 0.49).abs() < 1e-12 && (greso.p_hard - 0.51).abs() < 1e-12);
        for _ in 0..100 {
            greso.update(&[group(1, &[1.0, 1.0])]);
        }
        assert_eq!((greso.p_easy, greso.p_hard), (0.05, 0.95));
        assert_eq!(greso.visits[&1].len(), MEMORY);
    }
}
