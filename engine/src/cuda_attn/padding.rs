//! A decode step padded to a fixed batch size (`engine.cuda_graphs`), so that one captured
//! CUDA graph serves every step of that size whatever its sequences: the pad rows are real
//! work with nowhere to leak. Each reads token 0 at position 0 and attends the first key of
//! the batch's first sequence, through that sequence's table row; each writes its K and V into
//! a block of the pool that no sequence owns. Rows never mix in a decoder (the projections,
//! norms and attention are row by row), so the real rows' outputs are those of the unpadded
//! step computed at the padded shape.

use super::{KernelPlan, Tile};
use crate::plan::Plan;
use crate::EngineError;

/// The batch sizes a decode step pads to: powers of two up to 16, then steps of at most a
/// half (a row costs little next to the weights a decode step reads, a graph a capture).
pub const BUCKETS: [usize; 17] = [
    1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024,
];

/// The pad of one decode step: its rows up to `bucket`, and where their K and V go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Padding {
    /// Rows of the padded step.
    pub bucket: usize,
    /// The first slot of the block no sequence owns.
    pub scratch_slot: usize,
    pub block_size: usize,
}

impl Padding {
    /// The padding of `plan` where it is a decode step that fits a bucket: every sequence one
    /// new token and a sample, no more rows than the largest bucket. The scratch block is
    /// `scratch_block` of `block_size`-token blocks.
    pub fn of(plan: &Plan, scratch_block: usize, block_size: usize) -> Option<Self> {
        let decode = !plan.seqs.is_empty()
            && plan
                .seqs
                .iter()
                .all(|s| s.num_new_tokens == 1 && s.num_samples > 0);
        let rows = plan.seqs.len();
        let bucket = BUCKETS.into_iter().find(|&b| b >= rows)?;
        decode.then_some(Self {
            bucket,
            scratch_slot: scratch_block * block_size,
            block_size,
        })
    }

    /// `plan` (a decode step's, its real rows first) padded to the bucket, its context
    /// rounded as a captured step's ([`KernelPlan::round_context`]); an error where the
    /// scratch block is not in the pool of `pool_slots` slots, which the kernels write
    /// unchecked.
    pub fn extend(
        &self,
        plan: &mut KernelPlan,
        min_blocks: usize,
        pool_slots: usize,
    ) -> Result<(), EngineError> {
        if self.scratch_slot + self.block_size > pool_slots {
            return Err(EngineError::InvalidConfig(format!(
                "cuda graphs: a scratch block at slot {} outside a pool of {pool_slots}",
                self.scratch_slot
            )));
        }
        let rows = plan.rows;
        if let Some(first) = plan.tiles.first().copied() {
            for pad in 0..self.bucket.saturating_sub(rows) {
                plan.tiles.push(Tile {
                    seq: first.seq,
                    first_row: (rows + pad) as u32,
                    rows: 1,
                    first_pos: 0,
                });
                plan.slots
                    .push((self.scratch_slot + pad % self.block_size) as u32);
            }
            plan.rows = plan.rows.max(self.bucket);
        }
        plan.round_context(min_blocks);
        Ok(())
    }

    /// Token ids and positions padded, in place, with token 0 at position 0.
    pub fn inputs(&self, ids: &mut Vec<u32>, positions: &mut Vec<u32>) {
        ids.resize(self.bucket, 0);
        positions.resize(self.bucket, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cuda_attn::Heads;
    use crate::paged_attn::{CacheShape, SeqAttnMeta};
    use crate::plan::ScheduledSeq;

    fn decode(rows: usize) -> Plan {
        Plan {
            seqs: (0..rows)
                .map(|i| ScheduledSeq {
                    seq_id: i as u64,
                    num_computed_tokens: 10 + i,
                    num_new_tokens: 1,
                    num_samples: 1,
                })
                .collect(),
            ..Plan::default()
        }
    }

    /// Decode steps pad to the smallest bucket that holds them; prefill, a row that samples
    /// nothing and a batch past the largest bucket run as they are.
    #[test]
    fn only_decode_steps_pad_and_to_the_smallest_bucket() {
        let of = |plan: &Plan| Padding::of(plan, 7, 16).map(|p| p.bucket);
        assert_eq!(of(&decode(1)), Some(1));
        assert_eq!(of(&decode(3)), Some(4));
        assert_eq!(of(&decode(253)), Some(256));
        assert_eq!(of(&decode(1024)), Some(1024));
        assert_eq!(of(&decode(1025)), None);
        assert_eq!(of(&decode(0)), None);
        let mut prefill = decode(4);
        prefill.seqs[2].num_new_tokens = 5;
        assert_eq!(of(&prefill), None);
        let mut silent = decode(4);
        silent.seqs[1].num_samples = 0;
        assert_eq!(of(&silent), None);
        assert_eq!(Padding::of(&decode(5), 7, 16).unwrap().scratch_slot, 112);
        assert!(BUCKETS
            .windows(2)
            .all(|w| w[0] < w[1] && (w[1] <= 16 || 2 * w[1] <= 3 * w[0])));
    }

    /// The pad rows follow the real ones, attend the first key of the first sequence through
    /// its table row, and write only into the scratch block, at distinct slots per block; the
    /// padded plan's splits cover every context and stay the same while the longest grows
    /// within its power of two.
    #[test]
    fn pad_rows_read_a_real_key_and_write_only_the_scratch_block() {
        let pad = Padding {
            bucket: 8,
            scratch_slot: 64,
            block_size: 4,
        };
        let heads = Heads {
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 32,
        };
        let plan_at = |cached: usize| {
            let metas: Vec<SeqAttnMeta> = (0..3)
                .map(|i| SeqAttnMeta {
                    first_row: i,
                    num_new_tokens: 1,
                    num_computed_tokens: cached - i,
                    block_table: (0..(cached + 4) / 4).map(|b| (b * 3 + i) as u32).collect(),
                })
                .collect();
            let shape = CacheShape {
                num_layers: 1,
                num_blocks: 17,
                block_size: 4,
                num_kv_heads: 2,
                head_dim: 32,
            };
            let table_rows = [2, 0, 1];
            let mut plan =
                KernelPlan::new(&metas, (&table_rows, 128), &[47, 23, 30], shape, heads, 4)
                    .unwrap();
            pad.extend(&mut plan, 4, 17 * 4).unwrap();
            plan
        };
        let plan = plan_at(200);
        assert_eq!(plan.rows, 8);
        assert_eq!(plan.slots, [47, 23, 30, 64, 65, 66, 67, 64]);
        let pads: Vec<Tile> = plan.tiles[3..].to_vec();
        for (i, t) in pads.iter().enumerate() {
            let want = Tile {
                seq: 2,
                first_row: 3 + i as u32,
                rows: 1,
                first_pos: 0,
            };
            assert_eq!(*t, want);
        }
        assert!(plan.splits * plan.split_len >= 256, "{plan:?}");
        for cached in [129, 200, 255] {
            let p = plan_at(cached);
            assert_eq!((p.splits, p.split_len), (plan.splits, plan.split_len));
        }
        assert_ne!(plan_at(256).split_len * plan_at(256).splits, 256);
        let mut outside = plan_at(200);
        let err = pad.extend(&mut outside, 4, 64).unwrap_err().to_string();
        assert!(
            err.contains("scratch block at slot 64 outside a pool of 64"),
            "{err}"
        );
        let (mut ids, mut positions) = (vec![4, 5, 6], vec![9, 9, 9]);
        pad.inputs(&mut ids, &mut positions);
        assert_eq!(ids, [4, 5, 6, 0, 0, 0, 0, 0]);
        assert_eq!(positions, [9, 9, 9, 0, 0, 0, 0, 0]);
    }
}
