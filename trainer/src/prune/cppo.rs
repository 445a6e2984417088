//! CPPO, a biased baseline: every drawn prompt is rolled out; the `r_o` fraction of the
//! batch's completions with the smallest |A| is dropped, the rest kept with weight 1 and
//! averaged over the retained completions only, as its paper does.

use rand::rngs::StdRng;

use super::{cppo_completions, draw_all, BatchShape, Drawn, Kept, PromptPool, PruningAlgorithm};
use crate::group::Group;
use crate::loss::Normalisers;

/// CPPO's (stateless) choices at its batch-wide rate.
pub struct Cppo {
    shape: BatchShape,
    /// `dppo.r_o`.
    rate: f64,
}

impl Cppo {
    pub fn new(shape: BatchShape, rate: f64) -> Self {
        Self { shape, rate }
    }
}

impl PruningAlgorithm for Cppo {
    fn draw(&mut self, pool: &mut PromptPool<'_>, _rng: &mut StdRng) -> Drawn {
        draw_all(pool, self.shape.prompts_per_step)
    }

    fn completion_rate(&self) -> f64 {
        self.rate
    }

    fn select_completions(&self, groups: &[Group], rate: f64, _rng: &mut StdRng) -> Vec<Kept> {
        cppo_completions(groups, rate, self.shape.beta)
    }

    fn normalisers(&self, groups: &[Group], kept: &[Kept], _num_drawn: usize) -> Normalisers {
        let completion = |k: &Kept| {
            groups[k.group_idx].samples[k.sample_idx]
                .completion_ids
                .len()
        };
        Normalisers {
            num_seqs: kept.len() as f64,
            num_tokens: kept.iter().map(completion).sum::<usize>() as f64,
            max_len: self.shape.max_len as f64,
        }
    }
}
