//! Block tables that stay on the device between iterations. Each live sequence owns a row
//! of a (rows, width) table; an iteration sends only the entries that changed (a decoding
//! sequence changes one entry every `block_size` tokens), as (index, block) pairs that one
//! kernel scatters, so the per-step upload is O(rows) words, not O(rows x blocks). The table
//! is sent whole only when it grows (rows or width doubled). This is the host's mirror;
//! `launch` holds the device copy.

use std::collections::HashMap;

use crate::kv_pool::BlockId;
use crate::sequence::SeqId;

/// What the device copy needs this iteration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableUpload {
    /// The table was reshaped: send all of [`TableMirror::host`].
    Whole,
    /// Write `pairs[2i + 1]` at index `pairs[2i]` (row * width + column).
    Entries(Vec<u32>),
}

/// A copy of the block tables that the kernels read: on the device, or the emulation's (the
/// engine's unit tests on the CPU).
#[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
pub(super) trait TableCopy: Sized {
    /// The whole `host` table, copied for `device`.
    fn copy_of(host: &[u32], device: &candle_core::Device) -> candle_core::Result<Self>;
    /// Writes (index, block) `pairs` in place: no work without changes.
    fn write_entries(&mut self, pairs: &[u32]) -> candle_core::Result<()>;
}

#[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
impl TableUpload {
    /// `copy` brought up to date with the mirror's `host` table: entry by entry where it
    /// exists and only entries changed, else copied whole.
    pub(super) fn apply<'c, C: TableCopy>(
        &self,
        copy: &'c mut Option<C>,
        host: &[u32],
        device: &candle_core::Device,
    ) -> candle_core::Result<&'c mut C> {
        match (copy, self) {
            (Some(tables), TableUpload::Entries(pairs)) => {
                tables.write_entries(pairs)?;
                Ok(tables)
            }
            (slot, _) => Ok(slot.insert(C::copy_of(host, device)?)),
        }
    }
}

/// The host's copy of the device's block tables and who owns which row.
#[derive(Debug, Clone, Default)]
pub struct TableMirror {
    width: usize,
    num_rows: usize,
    /// (num_rows, width) block ids as the device holds them.
    host: Vec<u32>,
    /// The row of each sequence that has one; every other row is in `free`.
    rows: HashMap<SeqId, u32>,
    free: Vec<u32>,
}

impl TableMirror {
    /// Columns per row.
    pub fn width(&self) -> usize {
        self.width
    }

    /// The table as the device holds it after the last [`TableMirror::update`].
    pub fn host(&self) -> &[u32] {
        &self.host
    }

    /// Brings the mirror up to date with `seqs` (the iteration's sequences and their block
    /// tables), freeing first the rows of sequences for which `live` is false. Returns each
    /// sequence's row and what to send.
    pub fn update(
        &mut self,
        seqs: &[(SeqId, &[BlockId])],
        live: impl Fn(SeqId) -> bool,
    ) -> (Vec<u32>, TableUpload) {
        let gone: Vec<SeqId> = self.rows.keys().copied().filter(|&s| !live(s)).collect();
        for s in gone {
            self.free.push(self.rows.remove(&s).expect("listed"));
        }
        // Grow by doubling, so a growing batch or context reshapes O(log) times.
        let (old_rows, old_width) = (self.num_rows, self.width);
        let new_seqs = seqs
            .iter()
            .filter(|(s, _)| !self.rows.contains_key(s))
            .count();
        if new_seqs > self.free.len() {
            let rows = (2 * old_rows).max(old_rows + new_seqs - self.free.len());
            self.free.extend((old_rows..rows).map(|r| r as u32));
            self.num_rows = rows;
        }
        let needed = seqs.iter().map(|(_, t)| t.len()).max().unwrap_or(0);
        while self.width < needed {
            self.width = (2 * self.width).max(1);
        }
        let reshaped = (self.num_rows, self.width) != (old_rows, old_width);
        if reshaped {
            let mut host = vec![0u32; self.num_rows * self.width];
            for r in 0..old_rows {
                host[r * self.width..][..old_width]
                    .copy_from_slice(&self.host[r * old_width..][..old_width]);
            }
            self.host = host;
        }
        let rows: Vec<u32> = seqs
            .iter()
            .map(|&(seq, _)| match self.rows.get(&seq) {
                Some(&r) => r,
                None => {
                    let r = self.free.pop().expect("grown to fit");
                    self.rows.insert(seq, r);
                    r
                }
            })
            .collect();
        let mut pairs = Vec::new();
        for (&(_, table), &row) in seqs.iter().zip(&rows) {
            let start = row as usize * self.width;
            for (j, &block) in table.iter().enumerate() {
                if self.host[start + j] != block {
                    self.host[start + j] = block;
                    pairs.extend([(start + j) as u32, block]);
                }
            }
        }
        let upload = if reshaped {
            TableUpload::Whole
        } else {
            TableUpload::Entries(pairs)
        };
        (rows, upload)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Applies an upload to a simulated device copy.
    fn apply(device: &mut Vec<u32>, mirror: &TableMirror, upload: &TableUpload) {
        match upload {
            TableUpload::Whole => *device = mirror.host().to_vec(),
            TableUpload::Entries(pairs) => {
                for p in pairs.chunks(2) {
                    device[p[0] as usize] = p[1];
                }
            }
        }
    }

    /// Decoding, a fork sharing blocks, preemption (a table rebuilt), a finished sequence
    /// whose row is reused, and growth: the device copy always holds every scheduled
    /// sequence's table in its row, and a step sends only what changed.
    #[test]
    fn the_device_copy_follows_every_step_with_only_the_changes() {
        let mut mirror = TableMirror::default();
        let mut device = Vec::new();
        let mut tables: Vec<(SeqId, Vec<BlockId>)> = vec![(1, vec![4]), (2, vec![9, 3])];
        let mut live: Vec<SeqId> = vec![1, 2];
        let mut step = |tables: &[(SeqId, Vec<BlockId>)], live: &[SeqId]| {
            let seqs: Vec<(SeqId, &[BlockId])> =
                tables.iter().map(|(s, t)| (*s, t.as_slice())).collect();
            let (rows, upload) = mirror.update(&seqs, |s| live.contains(&s));
            apply(&mut device, &mirror, &upload);
            let w = mirror.width();
            for ((_, t), &r) in tables.iter().zip(&rows) {
                assert_eq!(&device[r as usize * w..][..t.len()], t.as_slice());
            }
            let mut distinct = rows.clone();
            distinct.sort_unstable();
            distinct.dedup();
            assert_eq!(distinct.len(), rows.len(), "one row per sequence");
            (rows, upload)
        };
        let (first, upload) = step(&tables, &live);
        assert_eq!(upload, TableUpload::Whole);
        // A decode step inside the blocks: nothing to send.
        let (rows, upload) = step(&tables, &live);
        assert_eq!(
            (rows, upload),
            (first.clone(), TableUpload::Entries(vec![]))
        );
        // Sequence 1 takes a second block: one entry.
        tables[0].1.push(7);
        let (_, upload) = step(&tables, &live);
        assert_eq!(upload, TableUpload::Entries(vec![first[0] * 2 + 1, 7]));
        // A fork of sequence 2 sharing its blocks, then sequence 2 preempted and rebuilt.
        tables.push((3, vec![9, 3]));
        live.push(3);
        let (_, upload) = step(&tables, &live);
        assert_eq!(upload, TableUpload::Whole, "a third row doubles the rows");
        tables[1].1 = vec![11, 12];
        let (_, upload) = step(&tables, &live);
        assert_eq!(
            upload,
            TableUpload::Entries(vec![first[1] * 2, 11, first[1] * 2 + 1, 12])
        );
        // Sequence 1 finishes; a new sequence reuses its row.
        tables.remove(0);
        live.retain(|&s| s != 1);
        tables.push((4, vec![5]));
        live.push(4);
        let (rows, _) = step(&tables, &live);
        assert!(rows.contains(&first[0]), "{rows:?} reuse row {}", first[0]);
        // A long context widens every row.
        tables[0].1.extend([13, 14, 15]);
        let (_, upload) = step(&tables, &live);
        assert_eq!(upload, TableUpload::Whole);
        assert_eq!(mirror.width(), 8);
    }
}
