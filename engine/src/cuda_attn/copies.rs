//! Copy-on-write in the pool by `copy_slots` (kernels/paged_attention.cu) on the kernels'
//! path: an iteration's block copies as (source slot, destination slot) pairs, one upload
//! and a launch per layer's K and V, where the generic path gathers and scatters.

#[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
use candle_core::{InplaceOp1, Result};

#[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
use super::{Geometry, WRITE_THREADS};
#[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
use crate::generic_attn::TensorKvCache;
use crate::kv_pool::BlockCopy;

/// The slot pairs of an iteration's copies, two words each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotCopies {
    pub pairs: Vec<u32>,
}

impl SlotCopies {
    /// Every copied token of `copies`, blocks of `block_size` slots. `copy_slots` copies them
    /// all at once, so no destination may be another copy's source (a destination is the
    /// fresh block of a copy-on-write).
    pub fn of(copies: &[BlockCopy], block_size: usize) -> Self {
        debug_assert!(
            copies.iter().all(|c| copies.iter().all(|o| o.src != c.dst)),
            "a copy's destination is another's source: {copies:?}"
        );
        let slot = |block: u32, i: usize| (block as usize * block_size + i) as u32;
        let pairs = copies
            .iter()
            .flat_map(|c| (0..c.num_tokens).flat_map(move |i| [slot(c.src, i), slot(c.dst, i)]))
            .collect();
        Self { pairs }
    }

    pub fn is_empty(&self) -> bool {
        self.pairs.is_empty()
    }

    /// Copied slots.
    #[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
    pub fn len(&self) -> usize {
        self.pairs.len() / 2
    }

    /// `copy_slots`: a block per copied slot.
    #[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
    pub fn geometry(&self) -> Geometry {
        Geometry {
            grid: (self.len() as u32, 1, 1),
            block: (WRITE_THREADS, 1, 1),
            shared_bytes: 0,
        }
    }
}

/// `copy` (a launcher's `copy_slots` op) on every layer's K and V pool.
#[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
pub fn in_every_layer(cache: &TensorKvCache, copy: &impl InplaceOp1) -> Result<()> {
    for layer in 0..cache.shape().num_layers {
        let (k, v) = cache.layer(layer);
        k.inplace_op1(copy)?;
        v.inplace_op1(copy)?;
    }
    Ok(())
}
