//! The sampling kernels' arguments, in the order of their signatures, for both launchers: the
//! GPU's and, in tests, the CPU emulation's.

use crate::gumbel::Drawn;
use crate::kernel_args::ArgList;
use crate::sampler::MAX_TOP_LOGPROBS;

use super::DeviceDraw;

/// The kernel's per-draw inputs, a buffer each: host vectors, or their copies on the device
/// (`U` holds u32s, `F` f32s).
pub(crate) struct DrawInputs<U = Vec<u32>, F = Vec<f32>> {
    pub(super) rows: U,
    /// Two words a draw, low first.
    pub(super) keys: U,
    /// (position, sample index) a draw.
    pub(super) counters: U,
    pub(super) inv_temps: F,
    pub(super) top_ks: U,
    pub(super) top_ps: F,
    pub(super) min_ps: F,
    pub(super) n_tops: U,
}

impl DrawInputs {
    pub(crate) fn of(draws: &[DeviceDraw]) -> Self {
        Self {
            rows: draws.iter().map(|d| d.row).collect(),
            keys: draws.iter().flat_map(|d| d.key.key_words()).collect(),
            counters: draws
                .iter()
                .flat_map(|d| [d.key.position, d.key.sample_index])
                .collect(),
            inv_temps: draws.iter().map(|d| d.params.inv_temperature).collect(),
            top_ks: draws.iter().map(|d| d.params.top_k).collect(),
            top_ps: draws.iter().map(|d| d.params.top_p).collect(),
            min_ps: draws.iter().map(|d| d.params.min_p).collect(),
            n_tops: draws.iter().map(|d| d.params.top_logprobs).collect(),
        }
    }
}

/// The kernel's outputs: a token and two logprobs a draw, and `MAX_TOP_LOGPROBS` top ids and
/// logprobs a draw (on the host, empty when no draw asked for them).
pub(crate) struct DrawOutputs<U = Vec<u32>, F = Vec<f32>> {
    pub(crate) tokens: U,
    pub(crate) logprobs: F,
    pub(crate) model_logprobs: F,
    pub(crate) top: (U, F),
}

/// Pushes `gumbel_sample`'s arguments in the order of its signature in kernels/sample.cu:
/// logits, vocab, the inputs, `lazy_noise`, then the outputs ([`crate::kernel_args`]), and
/// for `gumbel_sample_split` (kernels/sample_split.cu) its scratch, the parts' words and the
/// draws' counts.
pub(crate) fn push_args<'s, A, L, U, F, OU, OF>(
    list: &mut A,
    logits: L,
    (vocab, lazy_noise): (&'s u32, &'s u32),
    inputs: &'s DrawInputs<U, F>,
    outputs: &'s mut DrawOutputs<OU, OF>,
    scratch: Option<&'s mut (OU, OU)>,
) where
    A: ArgList<L> + ArgList<&'s u32> + ArgList<&'s U> + ArgList<&'s F>,
    A: ArgList<&'s mut OU> + ArgList<&'s mut OF>,
{
    let i = inputs;
    ArgList::push(list, logits);
    ArgList::push(list, vocab);
    ArgList::push(list, &i.rows);
    ArgList::push(list, &i.keys);
    ArgList::push(list, &i.counters);
    ArgList::push(list, &i.inv_temps);
    ArgList::push(list, &i.top_ks);
    ArgList::push(list, &i.top_ps);
    ArgList::push(list, &i.min_ps);
    ArgList::push(list, &i.n_tops);
    ArgList::push(list, lazy_noise);
    let DrawOutputs {
        tokens,
        logprobs,
        model_logprobs,
        top: (top_ids, top_logprobs),
    } = outputs;
    ArgList::push(list, tokens);
    ArgList::push(list, logprobs);
    ArgList::push(list, model_logprobs);
    ArgList::push(list, top_ids);
    ArgList::push(list, top_logprobs);
    if let Some((partials, arrived)) = scratch {
        ArgList::push(list, partials);
        ArgList::push(list, arrived);
    }
}

impl DrawOutputs {
    /// The draws, `n_tops[i]` top logprobs for draw `i`.
    pub(crate) fn drawn(&self, n_tops: &[u32]) -> Vec<Drawn> {
        let (ids, lps) = &self.top;
        (0..self.tokens.len())
            .map(|i| Drawn {
                token: self.tokens[i],
                logprob: self.logprobs[i],
                model_logprob: self.model_logprobs[i],
                top_logprobs: (0..n_tops[i] as usize)
                    .map(|j| (ids[i * MAX_TOP_LOGPROBS + j], lps[i * MAX_TOP_LOGPROBS + j]))
                    .collect(),
            })
            .collect()
    }
}
