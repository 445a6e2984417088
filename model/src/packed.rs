//! Packed rows for training: several sequences concatenated into one row, attention
//! block-diagonal (causal within each sequence, never across), positions restarting at 0.

use candle_core::{Device, Result, Tensor};

use crate::attention::{causal_attention_batch, AttentionBackend};

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

    /// The attention backend for this row.
    pub fn attention(&self) -> PackedAttention {
        PackedAttention {
            cu_seqlens: self.cu_seqlens.clone(),
        }
    }
}

/// Block-diagonal causal attention over a packed row; differentiable end to end.
#[derive(Debug, Clone)]
pub struct PackedAttention {
    /// Sequence boundaries, as in [`PackedRow::cu_seqlens`].
    pub cu_seqlens: Vec<usize>,
}

impl AttentionBackend for PackedAttention {
    fn attend(&mut self, _layer_idx: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        // Attention runs per sequence, O(sum L_i^2), so no mask can leak across sequences;
        // each run of consecutive equal-length sequences goes through as one batch.
        let lens: Vec<usize> = self.cu_seqlens.windows(2).map(|w| w[1] - w[0]).collect();
        let mut outs = Vec::new();
        let mut first = 0;
        while first < lens.len() {
            let len = lens[first];
            let batch = lens[first..].iter().take_while(|&&l| l == len).count();
            let (start, tokens) = (self.cu_seqlens[first], batch * len);
            outs.push(causal_attention_batch(
                &q.narrow(0, start, tokens)?,
                &k.narrow(0, start, tokens)?,
                &v.narrow(0, start, tokens)?,
                batch,
                0,
            )?);
            first += batch;
        }
        Tensor::cat(&outs, 0)
    }

    fn packed_seqlens(&self) -> Option<&[usize]> {
        Some(&self.cu_seqlens)
    }
}
