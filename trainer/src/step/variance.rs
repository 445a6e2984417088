//! The gradient-variance study (`eval.grad_variance_draws`): how far completion-pruned
//! gradients scatter around the unpruned one, on a step's own groups.

use std::collections::BTreeMap;
use std::ops::Range;

use rand::rngs::StdRng;

use crate::group::Group;
use crate::learner::Learner;
use crate::optim::squared_norm;
use crate::prune::PruningAlgorithm;
use crate::train_batch::prune_and_build;
use crate::TrainError;

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

/// One step's data that the study prunes again and again.
pub(super) struct VarianceInputs<'a> {
    pub algorithm: &'a dyn PruningAlgorithm,
    pub learner: &'a Learner,
    pub groups: &'a [Group],
    /// This rank's groups.
    pub own: Range<usize>,
    /// Prompts drawn for the step.
    pub num_drawn: usize,
    /// Pruning draws to average over.
    pub draws: usize,
}

/// How far the completion-pruned gradient scatters around the unpruned one on a step's
/// groups: the mean over `draws` pruning draws of `|g_draw - g_full|^2 / |g_full|^2`
/// (docs/algorithm.md §5), at the algorithm's completion rate. For the unbiased DPPO this
/// is the estimator's relative variance; for CPPO's deterministic cut it is its squared
/// bias. Prompt-level pruning has already happened and is not part of it. Draws use their
/// own random streams (`rng(phase)`: the step's stream of a phase), so training is
/// unchanged.
///
/// With several ranks each gradient is the whole batch's (every rank's share,
/// all-reduced), so every rank computes the same figure.
pub(super) fn pruning_variance(
    inputs: &VarianceInputs<'_>,
    rng: impl Fn(u64) -> StdRng,
) -> Result<f64, TrainError> {
    let gradient = |rate: f64, rng: &mut StdRng| {
        let (batch, _) = prune_and_build(
            inputs.algorithm,
            inputs.groups,
            inputs.own.clone(),
            inputs.num_drawn,
            rate,
            rng,
        );
        Ok::<_, TrainError>(inputs.learner.reduced_gradients(&batch)?.0)
    };
    let full = gradient(0.0, &mut rng(VARIANCE_PHASE))?;
    let norm = squared_norm(&full)?;
    if norm == 0.0 {
        return Ok(0.0);
    }
    let rate = inputs.algorithm.completion_rate();
    let mut total = 0.0;
    for d in 0..inputs.draws as u64 {
        let pruned = gradient(rate, &mut rng(VARIANCE_PHASE + 1 + d))?;
        total += squared_norm(&difference(&pruned, &full)?)?;
    }
    Ok(total / inputs.draws as f64 / norm)
}
