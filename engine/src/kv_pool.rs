//! Block bookkeeping of the paged KV cache: free blocks, reference counts, block tables.
//! Never touches a tensor (the runner owns the storage).

pub use dppo_model::block_attn::BlockId;

/// A copy-on-write order: copy the first `num_tokens` slots of block `src` into `dst`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: BlockId,
    pub dst: BlockId,
    pub num_tokens: usize,
}

/// Fixed-size blocks with reference counts (a block shared by the G samples of a prompt
/// has one reference per sample).
///
/// NOTE: block ids never change once given to a sequence (a copy-on-write replaces the
/// shared block in that sequence's table by a fresh one), so block tables are append-only
/// except for that one replacement of their last block.
#[derive(Debug, Clone)]
pub struct KvPool {
    block_size: usize,
    /// Free blocks; the most recently freed are handed out first (a stack), so that a
    /// steady workload reuses the same, cache-warm blocks instead of cycling through the
    /// whole pool (whose untouched pages would also fault in one by one).
    free: Vec<BlockId>,
    ref_counts: Vec<u32>,
}

impl KvPool {
    /// A pool of `num_blocks` blocks of `block_size` token slots each.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(block_size > 0, "block_size must be positive");
        Self {
            block_size,
            free: (0..num_blocks as BlockId).rev().collect(),
            ref_counts: vec![0; num_blocks],
        }
    }

    /// Token slots per block.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    /// Blocks not referenced by any sequence.
    pub fn num_free_blocks(&self) -> usize {
        self.free.len()
    }

    /// References to `block` (0 when free).
    #[cfg(test)]
    pub(crate) fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_counts[block as usize]
    }

    /// Blocks needed to hold `num_tokens` tokens.
    pub fn blocks_for(&self, num_tokens: usize) -> usize {
        num_tokens.div_ceil(self.block_size)
    }

    /// Whether `num_blocks` fresh blocks are available.
    pub fn can_allocate(&self, num_blocks: usize) -> bool {
        self.free.len() >= num_blocks
    }

    /// Takes `num_blocks` fresh blocks, all or nothing.
    pub fn allocate(&mut self, num_blocks: usize) -> Option<Vec<BlockId>> {
        if !self.can_allocate(num_blocks) {
            return None;
        }
        let blocks: Vec<BlockId> = (0..num_blocks).filter_map(|_| self.free.pop()).collect();
        for &b in &blocks {
            self.ref_counts[b as usize] = 1;
        }
        Some(blocks)
    }

    /// Fresh blocks needed to extend a sequence holding `num_tokens` tokens in
    /// `block_table` by `num_new` tokens, counting a copy-on-write of a shared partial block.
    pub fn blocks_to_append(
        &self,
        block_table: &[BlockId],
        num_tokens: usize,
        num_new: usize,
    ) -> usize {
        let grow = self
            .blocks_for(num_tokens + num_new)
            .saturating_sub(block_table.len());
        grow + usize::from(self.needs_cow(block_table, num_tokens))
    }

    /// Whether [`KvPool::append_slots`] would succeed.
    pub fn can_append(&self, block_table: &[BlockId], num_tokens: usize, num_new: usize) -> bool {
        self.can_allocate(self.blocks_to_append(block_table, num_tokens, num_new))
    }

    /// Makes room for `num_new` more tokens after the `num_tokens` already in
    /// `block_table`: replaces a shared, partially filled last block by a private copy and
    /// appends fresh blocks. All or nothing; returns the copy to perform, if any.
    pub fn append_slots(
        &mut self,
        block_table: &mut Vec<BlockId>,
        num_tokens: usize,
        num_new: usize,
    ) -> Option<Option<BlockCopy>> {
        if !self.can_append(block_table, num_tokens, num_new) {
            return None;
        }
        let copy = if self.needs_cow(block_table, num_tokens) {
            let last = block_table.len() - 1;
            let src = block_table[last];
            let dst = self.allocate(1).expect("checked by can_append")[0];
            self.ref_counts[src as usize] -= 1;
            block_table[last] = dst;
            Some(BlockCopy {
                src,
                dst,
                num_tokens: num_tokens % self.block_size,
            })
        } else {
            None
        };
        let grow = self
            .blocks_for(num_tokens + num_new)
            .saturating_sub(block_table.len());
        block_table.extend(self.allocate(grow).expect("checked by can_append"));
        Some(copy)
    }

    /// Shares every block of `block_table` with a new sequence (one more reference each).
    pub fn fork(&mut self, block_table: &[BlockId]) -> Vec<BlockId> {
        for &b in block_table {
            debug_assert!(self.ref_counts[b as usize] > 0, "fork of a free block {b}");
            self.ref_counts[b as usize] += 1;
        }
        block_table.to_vec()
    }

    /// Drops one reference to every block of `block_table` and empties it; blocks nobody
    /// references any more return to the free queue.
    pub fn free(&mut self, block_table: &mut Vec<BlockId>) {
        // Freed in reverse so that a sequence's last (least shared) blocks are reused last.
        for b in block_table.drain(..).rev() {
            let rc = &mut self.ref_counts[b as usize];
            debug_assert!(*rc > 0, "double free of block {b}");
            *rc -= 1;
            if *rc == 0 {
                self.free.push(b);
            }
        }
    }

    /// A shared last block that is only partly filled must be copied before writing to it.
    fn needs_cow(&self, block_table: &[BlockId], num_tokens: usize) -> bool {
        let partial = !num_tokens.is_multiple_of(self.block_size);
        match block_table.last() {
            Some(&last) if partial && block_table.len() == self.blocks_for(num_tokens) => {
                self.ref_counts[last as usize] > 1
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_most_recently_freed_blocks_are_reused_first() {
        let mut pool = KvPool::new(64, 2);
        let mut a = pool.allocate(2).unwrap();
        let mut b = pool.allocate(2).unwrap();
        assert_eq!((a.clone(), b.clone()), (vec![0, 1], vec![2, 3]));
        pool.free(&mut a);
        pool.free(&mut b);
        // A steady workload keeps cycling through blocks 0-3, never touching 4-63.
        let mut reused = pool.allocate(4).unwrap();
        reused.sort_unstable();
        assert_eq!(reused, vec![0, 1, 2, 3]);
    }

    #[test]
    fn allocate_is_all_or_nothing() {
        let mut pool = KvPool::new(4, 2);
        assert_eq!(pool.allocate(3), Some(vec![0, 1, 2]));
        assert_eq!(pool.allocate(2), None);
        assert_eq!(pool.num_free_blocks(), 1);
        assert_eq!(pool.allocate(1), Some(vec![3]));
        assert_eq!(pool.num_free_blocks(), 0);
    }

    #[test]
    fn group_shares_prompt_blocks_and_copies_partial_last_block_on_write() {
        // Prompt of 5 tokens, block size 2: blocks [0, 1, 2], the last holding 1 token.
        let mut pool = KvPool::new(8, 2);
        let mut parent = pool.allocate(pool.blocks_for(5)).unwrap();
        assert_eq!(parent, vec![0, 1, 2]);
        let mut child = pool.fork(&parent);
        assert_eq!((pool.ref_count(0), pool.ref_count(2)), (2, 2));
        assert_eq!(pool.num_free_blocks(), 5);
        // The child writes token 6 into the shared partial block: it gets a copy.
        let copy = pool.append_slots(&mut child, 5, 1).unwrap();
        assert_eq!(
            copy,
            Some(BlockCopy {
                src: 2,
                dst: 3,
                num_tokens: 1
            })
        );
        assert_eq!(child, vec![0, 1, 3]);
        assert_eq!((pool.ref_count(2), pool.ref_count(3)), (1, 1));
        // The parent is now the only owner of block 2: it writes in place.
        assert_eq!(pool.append_slots(&mut parent, 5, 1).unwrap(), None);
        assert_eq!(parent, vec![0, 1, 2]);
        // Token 7 of each needs a fresh block.
        assert_eq!(pool.append_slots(&mut parent, 6, 1).unwrap(), None);
        assert_eq!(parent, vec![0, 1, 2, 4]);
        assert_eq!(pool.num_free_blocks(), 3);
        pool.free(&mut child);
        assert_eq!((pool.ref_count(0), pool.ref_count(3)), (1, 0));
        pool.free(&mut parent);
        assert_eq!(pool.num_free_blocks(), 8);
        assert!((0..8).all(|b| pool.ref_count(b) == 0));
    }

    #[test]
    fn full_shared_last_block_needs_no_copy() {
        let mut pool = KvPool::new(4, 2);
        let parent = pool.allocate(2).unwrap();
        let mut child = pool.fork(&parent);
        assert_eq!(pool.blocks_to_append(&child, 4, 1), 1);
        assert_eq!(pool.append_slots(&mut child, 4, 1).unwrap(), None);
        assert_eq!(child, vec![0, 1, 2]);
    }

    #[test]
    fn append_fails_without_change_when_blocks_run_out() {
        let mut pool = KvPool::new(2, 2);
        let mut table = pool.allocate(2).unwrap();
        assert!(!pool.can_append(&table, 4, 1));
        assert_eq!(pool.append_slots(&mut table, 4, 1), None);
        assert_eq!(table, vec![0, 1]);
        assert_eq!(pool.num_free_blocks(), 0);
    }
}
