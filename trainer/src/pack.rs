//! Dense Prompt Packing (docs/algorithm.md §3): kept sequences go into fixed-capacity token
//! buffers, first-fit decreasing within windows, so pruned work turns into fewer buffers
//! instead of padding.

/// A sequence longer than a buffer: a configuration error (`pack_tokens` too small).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("sequence {index} has {len} tokens but pack_tokens is {capacity}")]
pub struct TooLong {
    pub index: usize,
    pub len: usize,
    pub capacity: usize,
}

/// Buffers as lists of sequence indices, in the order their sequences sit in the buffer.
///
/// Rule: take the next `window` sequences of the stream, sort them longest first (ties by
/// index), and put each into the first open buffer with room; open a new buffer when none
/// has room. Buffers stay open across windows.
pub fn pack(lengths: &[usize], capacity: usize, window: usize) -> Result<Vec<Vec<usize>>, TooLong> {
    if let Some((index, &len)) = lengths.iter().enumerate().find(|(_, &l)| l > capacity) {
        return Err(TooLong {
            index,
            len,
            capacity,
        });
    }
    let mut buffers: Vec<Vec<usize>> = Vec::new();
    let mut used: Vec<usize> = Vec::new();
    let order: Vec<usize> = (0..lengths.len()).collect();
    for chunk in order.chunks(window.max(1)) {
        let mut chunk = chunk.to_vec();
        chunk.sort_by(|&a, &b| lengths[b].cmp(&lengths[a]).then(a.cmp(&b)));
        for i in chunk {
            match used.iter().position(|&u| u + lengths[i] <= capacity) {
                Some(b) => {
                    buffers[b].push(i);
                    used[b] += lengths[i];
                }
                None => {
                    buffers.push(vec![i]);
                    used.push(lengths[i]);
                }
            }
        }
    }
    Ok(buffers)
}

/// Real tokens over the tokens of `num_buffers` buffers of `capacity`.
pub fn density(lengths: &[usize], num_buffers: usize, capacity: usize) -> f64 {
    if num_buffers == 0 {
        return 1.0;
    }
    lengths.iter().sum::<usize>() as f64 / (num_buffers * capacity) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// The density of a padded batch of the same sequences: one row each, padded to
    /// `row_len` (`max_prompt_len + max_response_len`, as verl pads).
    fn padded_density(lengths: &[usize], row_len: usize) -> f64 {
        density(lengths, lengths.len(), row_len)
    }

    #[test]
    fn first_fit_decreasing_within_a_window() {
        let lengths = [3, 7, 2, 5, 4, 6];
        // Window of 3: [7, 3, 2] -> b0 = {1, 0}, 3 + 7 = 10; 2 fits b0? 12 > 10, new b1 = {2}.
        // Next window [6, 5, 4]: 6 -> b1 (8); 5 -> b2; 4 -> b2 (9).
        let buffers = pack(&lengths, 10, 3).unwrap();
        assert_eq!(buffers, vec![vec![1, 0], vec![2, 5], vec![3, 4]]);
    }

    #[test]
    fn too_long_is_an_error() {
        let err = pack(&[3, 11], 10, 4).unwrap_err();
        assert_eq!(
            err,
            TooLong {
                index: 1,
                len: 11,
                capacity: 10
            }
        );
        assert!(err.to_string().contains("pack_tokens is 10"));
    }

    #[test]
    fn every_sequence_once_no_overflow_and_denser_than_padding() {
        let mut rng = StdRng::seed_from_u64(5);
        for _ in 0..300 {
            let capacity = 16 + rng.random_range(0..200);
            let n = 1 + rng.random_range(0..60);
            let lengths: Vec<usize> = (0..n).map(|_| 1 + rng.random_range(0..capacity)).collect();
            let window = 1 + rng.random_range(0..20);
            let buffers = pack(&lengths, capacity, window).unwrap();
            let mut seen: Vec<usize> = buffers.iter().flatten().copied().collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..n).collect::<Vec<_>>());
            assert!(buffers
                .iter()
                .all(|b| b.iter().map(|&i| lengths[i]).sum::<usize>() <= capacity));
            // Never worse than padding every sequence to a full row; at most one buffer
            // less than half full per window (first fit leaves no two such buffers).
            let packed = density(&lengths, buffers.len(), capacity);
            assert!(packed >= padded_density(&lengths, capacity));
            let half_empty = buffers
                .iter()
                .filter(|b| 2 * b.iter().map(|&i| lengths[i]).sum::<usize>() <= capacity)
                .count();
            assert!(half_empty <= n.div_ceil(window));
        }
    }
}
