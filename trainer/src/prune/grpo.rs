//! GRPO: no pruning. Every drawn prompt is rolled out and every completion that carries
//! signal is learned from, with weight 1, normalised over the full batch.

use rand::rngs::StdRng;

use super::{
    draw_all, full_batch_normalisers, prune_completions, BatchShape, Drawn, Kept, LevelConfig,
    PromptPool, PruningAlgorithm,
};
use crate::group::Group;
use crate::loss::Normalisers;

/// GRPO's (stateless) choices.
pub struct Grpo {
    shape: BatchShape,
}

impl Grpo {
    pub fn new(shape: BatchShape) -> Self {
        Self { shape }
    }
}

impl PruningAlgorithm for Grpo {
    fn draw(&mut self, pool: &mut PromptPool<'_>, _rng: &mut StdRng) -> Drawn {
        draw_all(pool, self.shape.prompts_per_step)
    }

    fn select_completions(&self, groups: &[Group], _rate: f64, rng: &mut StdRng) -> Vec<Kept> {
        let shape = &self.shape;
        prune_completions(groups, &LevelConfig::off(), shape.scope, shape.beta, rng)
    }

    fn normalisers(&self, groups: &[Group], _kept: &[Kept], num_drawn: usize) -> Normalisers {
        full_batch_normalisers(groups, num_drawn, &self.shape)
    }
}
