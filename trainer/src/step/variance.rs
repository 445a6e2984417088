//! The gradient-variance study (`eval.grad_variance_draws`): how far completion-pruned
//! gradients scatter around the unpruned one, on a step's own groups.

use std::collections::BTreeMap;
use std::ops::Range;

use rand::rngs::StdRng;

use crate::group::Group;
use crate::optim::squared_norm;
use crate::prune::LevelConfig;
use crate::TrainError;

use super::Trainer;

/// First random-stream phase of the gradient-variance draws (far from the training phases).
const VARIANCE_PHASE: u64 = 1 << 32;

/// Gradients by parameter name, as the learner returns them.
type Gradients = BTreeMap<String, candle_core::Tensor>;

/// `a - b` per parameter over the parameters of both; a gradient missing from one side (no
/// kept item reached that parameter) counts as zero.
fn difference(a: &Gradients, b: &Gradients) -> Result<Gradients, TrainError> {
    let names = a.keys().chain(b.keys().filter(|n| !a.contains_key(*n)));
    let mut out = Gradients::new();
    for name in names {
        let diff = match (a.get(name), b.get(name)) {
            (Some(x), Some(y)) => (x - y)?,
            (Some(x), None) => x.clone(),
            (None, Some(y)) => y.neg()?,
            (None, None) => unreachable!("every name comes from a or b"),
        };
        out.insert(name.clone(), diff);
    }
    Ok(out)
}

impl Trainer {
    /// How far the completion-pruned gradient scatters around the unpruned one on this
    /// step's groups: the mean over `draws` pruning draws of `|g_draw - g_full|^2 /
    /// |g_full|^2` (docs/algorithm.md §5). For the unbiased DPPO this is the estimator's relative
    /// variance; for CPPO's deterministic cut it is its squared bias. Prompt-level pruning
    /// has already happened and is not part of it. Draws use their own random streams, so
    /// training is unchanged.
    ///
    /// With several ranks each gradient is the whole batch's (every rank's share,
    /// all-reduced), so every rank computes the same figure.
    pub(super) fn pruning_variance(
        &self,
        groups: &[Group],
        own: Range<usize>,
        num_drawn: usize,
        level: &LevelConfig,
        draws: usize,
    ) -> Result<f64, TrainError> {
        let gradient = |rate: f64, rng: &mut StdRng| {
            let level = LevelConfig { rate, ..*level };
            let (batch, _) = self.train_batch(groups, own.clone(), num_drawn, &level, rng);
            Ok::<_, TrainError>(self.learner.reduced_gradients(&batch)?.0)
        };
        let full = gradient(0.0, &mut self.phase_rng(VARIANCE_PHASE))?;
        let norm = squared_norm(&full)?;
        if norm == 0.0 {
            return Ok(0.0);
        }
        let mut total = 0.0;
        for d in 0..draws as u64 {
            let pruned = gradient(level.rate, &mut self.phase_rng(VARIANCE_PHASE + 1 + d))?;
            total += squared_norm(&difference(&pruned, &full)?)?;
        }
        Ok(total / draws as f64 / norm)
    }
}
