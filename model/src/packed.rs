//! Packed rows for training: several sequences concatenated into one row, attention
//! block-diagonal (causal within each sequence, never across), positions restarting at 0.

use candle_core::{Device, Result, Tensor};

use crate::attention::{
    block_causal_mask, causal_attention_batch, masked_attention_batch, AttentionBackend,
};

/// One packed row: the model inputs plus the sequence boundaries.
#[derive(Debug, Clone)]
pub struct PackedRow {
    /// (tokens,) u32: the sequences' tokens, concatenated.
    pub input_ids: Tensor,
    /// (tokens,) u32: position ids, restarting at 0 at every sequence start.
    pub positions: Tensor,
    /// Sequence boundaries: sequence `s` spans `cu_seqlens[s]..cu_seqlens[s + 1]`.
    pub cu_seqlens: Vec<usize>,
}

impl PackedRow {
    /// Packs `seqs` in the given order. Empty sequences are not allowed.
    pub fn new(seqs: &[&[u32]], device: &Device) -> Result<Self> {
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut cu_seqlens = vec![0];
        for seq in seqs {
            if seq.is_empty() {
                candle_core::bail!("packed row: empty sequence");
            }
            ids.extend_from_slice(seq);
            positions.extend(0..seq.len() as u32);
            cu_seqlens.push(ids.len());
        }
        let n = ids.len();
        Ok(Self {
            input_ids: Tensor::from_vec(ids, n, device)?,
            positions: Tensor::from_vec(positions, n, device)?,
            cu_seqlens,
        })
    }

    /// The attention backend for this row, grouping its sequences as
    /// [`PackedAttention::attend`] decides.
    pub fn attention(&self) -> PackedAttention {
        PackedAttention::new(self.cu_seqlens.clone(), None)
    }
}

/// How [`PackedAttention`] groups a row's sequences into attention calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Grouping {
    /// One call per run of consecutive equal-length sequences, batched.
    Runs,
    /// Runs of two or more equal-length sequences batched as in `Runs`; consecutive
    /// sequences of other lengths gathered into segments of at most [`SEGMENT_TOKENS`]
    /// tokens (or the row's longest sequence, if longer), each one product under a
    /// block-diagonal causal mask. On a GPU, where each op costs a launch, a row of
    /// sequences of many lengths (an RL batch's completions) then takes a few calls instead
    /// of one per sequence, its scores at most those of a row of segment-long sequences
    /// (what the memory budget counts).
    Segments,
}

/// The tokens a [`Grouping::Segments`] segment gathers at most (unless one sequence is
/// longer): a segment's scores are at most a 512 x 512 block per head, so that a buffer's
/// stay within `pack.tokens x max(longest sequence, 512)` per head while sequences of a few
/// hundred tokens share calls.
pub const SEGMENT_TOKENS: usize = 512;

/// One attention call of a packed row: `count` consecutive sequences from sequence `first`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Part {
    pub first: usize,
    pub count: usize,
    /// Whether the sequences are of one length and run as a batch; else (segments) under a
    /// block-diagonal mask.
    pub batched: bool,
}

/// The attention calls of a row whose sequences have lengths `lens`, in order.
pub fn parts(lens: &[usize], grouping: Grouping) -> Vec<Part> {
    let mut runs = Vec::new();
    let mut first = 0;
    while first < lens.len() {
        let count = lens[first..]
            .iter()
            .take_while(|&&l| l == lens[first])
            .count();
        runs.push(Part {
            first,
            count,
            batched: true,
        });
        first += count;
    }
    if grouping == Grouping::Runs {
        return runs;
    }
    let cap = lens.iter().copied().max().unwrap_or(0).max(SEGMENT_TOKENS);
    let mut parts: Vec<Part> = Vec::new();
    let mut tokens = 0;
    for run in runs {
        let len = lens[run.first];
        // A single sequence joins the segment before it, or the single sequence before it,
        // where they fit; a batched run of several is never joined.
        match parts.last_mut() {
            Some(last)
                if run.count == 1 && (!last.batched || last.count == 1) && tokens + len <= cap =>
            {
                last.count += 1;
                last.batched = false;
                tokens += len;
            }
            _ => {
                parts.push(run);
                tokens = len;
            }
        }
    }
    parts
}

/// Block-diagonal causal attention over a packed row; differentiable end to end.
#[derive(Debug, Clone)]
pub struct PackedAttention {
    /// Sequence boundaries, as in [`PackedRow::cu_seqlens`].
    pub cu_seqlens: Vec<usize>,
    /// The grouping asked for; `None`: [`Grouping::Runs`] where the fused ops apply (f32
    /// and f64 on the CPU: a masked product would only add work there), else
    /// [`Grouping::Segments`].
    grouping: Option<Grouping>,
    /// The calls, planned at the first layer and made by every layer.
    plan: Option<Plan>,
}

#[derive(Debug, Clone)]
struct Plan {
    parts: Vec<Part>,
    /// Each part's mask under `Segments` (causal over one sequence where batched, else
    /// block-diagonal), built once for every layer; `None` under `Runs`.
    masks: Option<Vec<Tensor>>,
}

impl PackedAttention {
    pub fn new(cu_seqlens: Vec<usize>, grouping: Option<Grouping>) -> Self {
        Self {
            cu_seqlens,
            grouping,
            plan: None,
        }
    }

    fn lens(&self, first: usize, count: usize) -> Vec<usize> {
        self.cu_seqlens[first..=first + count]
            .windows(2)
            .map(|w| w[1] - w[0])
            .collect()
    }

    /// Plans the calls for inputs like `q` (on its device), once.
    fn plan_for(&mut self, q: &Tensor) -> Result<()> {
        if self.plan.is_some() {
            return Ok(());
        }
        let grouping = self.grouping.unwrap_or(if crate::fused::applies(&[q]) {
            Grouping::Runs
        } else {
            Grouping::Segments
        });
        let parts = parts(&self.lens(0, self.cu_seqlens.len() - 1), grouping);
        let masks = match grouping {
            Grouping::Runs => None,
            Grouping::Segments => Some(
                parts
                    .iter()
                    .map(|p| {
                        let lens = self.lens(p.first, if p.batched { 1 } else { p.count });
                        block_causal_mask(&lens, q.device())
                    })
                    .collect::<Result<_>>()?,
            ),
        };
        self.plan = Some(Plan { parts, masks });
        Ok(())
    }
}

impl AttentionBackend for PackedAttention {
    fn attend(&mut self, _layer_idx: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        // No call spans two sequences but under a mask, so nothing leaks across them.
        self.plan_for(q)?;
        let plan = self.plan.as_ref().expect("planned above");
        let mut outs = Vec::with_capacity(plan.parts.len());
        for (i, part) in plan.parts.iter().enumerate() {
            let start = self.cu_seqlens[part.first];
            let tokens = self.cu_seqlens[part.first + part.count] - start;
            let (q, k, v) = (
                q.narrow(0, start, tokens)?,
                k.narrow(0, start, tokens)?,
                v.narrow(0, start, tokens)?,
            );
            let batch = if part.batched { part.count } else { 1 };
            outs.push(match &plan.masks {
                None => causal_attention_batch(&q, &k, &v, batch, 0)?,
                Some(masks) => masked_attention_batch(&q, &k, &v, batch, &masks[i])?,
            });
        }
        Tensor::cat(&outs, 0)
    }

    fn packed_seqlens(&self) -> Option<&[usize]> {
        Some(&self.cu_seqlens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parts as (first, count, batched).
    fn plan(lens: &[usize], grouping: Grouping) -> Vec<(usize, usize, bool)> {
        parts(lens, grouping)
            .iter()
            .map(|p| (p.first, p.count, p.batched))
            .collect()
    }

    #[test]
    fn runs_batch_equal_lengths_and_segments_gather_the_rest_up_to_the_longest() {
        let lens = [612, 305, 204, 2, 612, 612, 3, 3, 7];
        let runs = vec![
            (0, 1, true),
            (1, 1, true),
            (2, 1, true),
            (3, 1, true),
            (4, 2, true),
            (6, 2, true),
            (8, 1, true),
        ];
        assert_eq!(plan(&lens, Grouping::Runs), runs);
        // 305 + 204 + 2 fit in 612 (the longest; past SEGMENT_TOKENS); a batched run is
        // never merged into; 7 follows one.
        let segments = vec![
            (0, 1, true),
            (1, 3, false),
            (4, 2, true),
            (6, 2, true),
            (8, 1, true),
        ];
        assert_eq!(plan(&lens, Grouping::Segments), segments);
        // An RL buffer's sequences, each of its own length: 8 calls become 2 of at most
        // SEGMENT_TOKENS (300 + 180, then 120 + ... + 20).
        let lens = [300, 180, 120, 90, 80, 70, 40, 20];
        assert_eq!(
            plan(&lens, Grouping::Segments),
            vec![(0, 2, false), (2, 6, false)]
        );
        assert_eq!(plan(&lens, Grouping::Runs).len(), 8);
        assert!(plan(&[], Grouping::Segments).is_empty());
    }

    #[test]
    fn block_causal_mask_lets_each_token_see_its_own_sequence_up_to_itself() {
        let mask = block_causal_mask(&[2, 3], &Device::Cpu).unwrap();
        let got: Vec<Vec<bool>> = mask
            .to_vec2::<f32>()
            .unwrap()
            .iter()
            .map(|row| row.iter().map(|&m| m == 0.0).collect())
            .collect();
        let (o, x) = (true, false);
        assert_eq!(
            got,
            vec![
                vec![o, x, x, x, x],
                vec![o, o, x, x, x],
                vec![x, x, o, x, x],
                vec![x, x, o, o, x],
                vec![x, x, o, o, o],
            ]
        );
        assert!(mask
            .to_vec2::<f32>()
            .unwrap()
            .iter()
            .flatten()
            .all(|&m| m == 0.0 || m == f32::NEG_INFINITY));
    }
}
