//! DPPO: unbiased two-level pruning. Prompts are pruned before rollout by their history
//! (`r_q`, over-drawn so the rollout batch stays full), completions after it by |A|
//! (`r_o`); survivors carry Horvitz-Thompson weights `w_q * w_o`, and the loss is
//! normalised over the full unpruned batch.

use rand::rngs::StdRng;

use super::{
    full_batch_normalisers, prune_completions, AlgorithmState, BatchShape, Drawn, Kept,
    PromptHistory, PromptPool, PruningAlgorithm,
};
use crate::config::DppoConfig;
use crate::group::Group;
use crate::loss::Normalisers;

/// DPPO's settings and the prompt history its prompt pruning reads.
pub struct Dppo {
    shape: BatchShape,
    cfg: DppoConfig,
    history: PromptHistory,
}

impl Dppo {
    pub fn new(shape: BatchShape, cfg: DppoConfig) -> Self {
        Self {
            shape,
            history: PromptHistory::new(cfg.history_decay),
            cfg,
        }
    }
}

impl PruningAlgorithm for Dppo {
    fn draw(&mut self, pool: &mut PromptPool<'_>, rng: &mut StdRng) -> Drawn {
        let p = self.shape.prompts_per_step;
        let level = self.cfg.level(self.cfg.r_q);
        let count = match self.cfg.allocation {
            true => self.history.overdraw(p, level.rate),
            false => p,
        };
        let (problems, ids) = pool.next(count);
        let w_q = self
            .history
            .select(&ids, &level, self.cfg.prompt_predictor, rng);
        Drawn { problems, w_q }
    }

    fn update(&mut self, groups: &[Group], step: u64) {
        self.history.update(groups, step);
    }

    fn completion_rate(&self) -> f64 {
        self.cfg.r_o
    }

    fn select_completions(&self, groups: &[Group], rate: f64, rng: &mut StdRng) -> Vec<Kept> {
        let level = self.cfg.level(rate);
        prune_completions(groups, &level, self.shape.scope, self.shape.beta, rng)
    }

    fn normalisers(&self, groups: &[Group], _kept: &[Kept], num_drawn: usize) -> Normalisers {
        full_batch_normalisers(groups, num_drawn, &self.shape)
    }

    fn state(&self) -> AlgorithmState {
        AlgorithmState {
            history: Some(self.history.clone()),
            greso: None,
        }
    }

    fn restore(&mut self, state: AlgorithmState) {
        if let Some(history) = state.history {
            self.history = history;
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::SeedableRng;

    use super::*;
    use crate::config::RunConfig;
    use crate::data::{ProblemOrder, TRAIN_STREAM};
    use crate::prune::PromptStats;

    #[test]
    fn allocation_decides_whether_prompt_pruning_refills_the_batch() {
        let drawn_and_kept = |allocation: bool| {
            let cfg = RunConfig::default_with(&[
                "dppo.r_q=0.5".to_string(),
                format!("dppo.allocation={allocation}"),
            ])
            .unwrap();
            let shape = BatchShape {
                prompts_per_step: 32,
                group_size: 8,
                max_len: 16,
                beta: 0.0,
                scope: cfg.dppo.scope,
            };
            let mut dppo = Dppo::new(shape, cfg.dppo);
            let prompt_ids: Vec<u64> = (0..256).collect();
            // Every prompt seen; the even ones carried no signal: they are the candidates.
            for &id in &prompt_ids {
                let stats = PromptStats {
                    score: if id % 2 == 0 { 0.0 } else { 1.0 },
                    last_step: 0,
                    visits: 1,
                    zero_var_streak: u64::from(id % 2 == 0),
                    right: 0.0,
                    samples: 0,
                    ability_sum: 0.0,
                    group_size: 0,
                };
                dppo.history.entries.insert(id, stats);
            }
            let mut order = ProblemOrder::new(0, TRAIN_STREAM, 256);
            let mut pool = PromptPool {
                order: &mut order,
                prompt_ids: &prompt_ids,
            };
            let mut rng = StdRng::seed_from_u64(1);
            // The first draw measures the candidate fraction that sizes the second.
            dppo.draw(&mut pool, &mut rng);
            let drawn = dppo.draw(&mut pool, &mut rng);
            let kept = drawn.w_q.iter().flatten().count();
            (drawn.problems.len(), kept)
        };
        let (drawn, kept) = drawn_and_kept(true);
        assert!(drawn > 32, "over-drawn: {drawn}");
        assert!(
            (28..=36).contains(&kept),
            "about a full batch rolled out: {kept}"
        );
        let (drawn, kept) = drawn_and_kept(false);
        assert_eq!(drawn, 32);
        assert!(
            (16..32).contains(&kept),
            "pruned prompts are not replaced: {kept}"
        );
    }
}
