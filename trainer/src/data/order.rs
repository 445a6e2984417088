//! The order problems are drawn in: endless epochs, each shuffled by (seed, stream, epoch)
//! alone, so that a count of draws restores the exact position. Several files mixed with
//! weights (`data.train_weights`) each keep such an order, and each draw picks its file by
//! a weighted choice keyed by (seed, stream, draw number), so a count still restores it.

use rand::{rngs::StdRng, seq::SliceRandom, Rng, SeedableRng};

use super::mix;

/// Keys the file choices of a mixture apart from the epochs' shuffles.
const CHOICE_SALT: u64 = 0x6d69_7874_7572_6521;

/// A position in the order of `n` problems, or of a weighted mixture of parts.
#[derive(Debug, Clone)]
pub struct ProblemOrder {
    seed: u64,
    stream: u64,
    n: usize,
    /// Problems drawn so far.
    drawn: u64,
    /// The shuffled order of the current epoch: (epoch, order).
    epoch: (u64, Vec<usize>),
    /// With several weighted parts: each part's problems and order, and the cumulative
    /// weights (normalised to end at 1).
    parts: Option<(Vec<Part>, Vec<f64>)>,
}

/// One part of a mixture: its problems (indices into all of them) and its own order.
type Part = (Vec<usize>, ProblemOrder);

impl ProblemOrder {
    /// Position 0 of the order of `n` problems.
    pub fn new(seed: u64, stream: u64, n: usize) -> Self {
        Self {
            seed,
            stream,
            n,
            drawn: 0,
            epoch: (0, shuffled(seed, stream, 0, n)),
            parts: None,
        }
    }

    /// Position 0 of a mixture: each draw comes from part `k` (problem indices, not empty)
    /// with probability `weights[k] / sum(weights)`, in that part's own epochs.
    pub fn mixed(seed: u64, stream: u64, parts: Vec<Vec<usize>>, weights: &[f64]) -> Self {
        let total: f64 = weights.iter().sum();
        let cumulative = weights
            .iter()
            .scan(0.0, |acc, w| {
                *acc += w / total;
                Some(*acc)
            })
            .collect();
        let parts = parts
            .into_iter()
            .enumerate()
            .map(|(k, part)| {
                let order = ProblemOrder::new(seed, mix(stream, k as u64, CHOICE_SALT), part.len());
                (part, order)
            })
            .collect();
        Self {
            parts: Some((parts, cumulative)),
            ..Self::new(seed, stream, 0)
        }
    }

    /// Problems drawn so far.
    pub fn drawn(&self) -> u64 {
        self.drawn
    }

    /// The position after `drawn` draws from the start.
    pub fn seek(&mut self, drawn: u64) {
        if let Some((parts, _)) = &self.parts {
            let mut counts = vec![0; parts.len()];
            for d in 0..drawn {
                counts[self.part_of(d)] += 1;
            }
            let (parts, _) = self.parts.as_mut().expect("checked above");
            for ((_, order), count) in parts.iter_mut().zip(counts) {
                order.seek(count);
            }
        }
        self.drawn = drawn;
    }

    /// The next `count` problem indices.
    pub fn next(&mut self, count: usize) -> Vec<usize> {
        (0..count)
            .map(|_| {
                let i = match self.parts.is_some() {
                    true => {
                        let k = self.part_of(self.drawn);
                        let (parts, _) = self.parts.as_mut().expect("checked above");
                        let (problems, order) = &mut parts[k];
                        problems[order.next(1)[0]]
                    }
                    false => {
                        let n = self.n as u64;
                        let epoch = self.drawn / n;
                        if self.epoch.0 != epoch {
                            self.epoch = (epoch, shuffled(self.seed, self.stream, epoch, self.n));
                        }
                        self.epoch.1[(self.drawn % n) as usize]
                    }
                };
                self.drawn += 1;
                i
            })
            .collect()
    }

    /// The part draw number `d` of a mixture comes from.
    fn part_of(&self, d: u64) -> usize {
        let (_, cumulative) = self.parts.as_ref().expect("a mixture");
        let u: f64 = StdRng::seed_from_u64(mix(self.seed, d, self.stream ^ CHOICE_SALT)).random();
        cumulative
            .iter()
            .position(|&c| u < c)
            .unwrap_or(cumulative.len() - 1)
    }
}

/// `0..n` in the order of epoch `epoch` of a stream.
fn shuffled(seed: u64, stream: u64, epoch: u64, n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (0..n).collect();
    order.shuffle(&mut StdRng::seed_from_u64(mix(seed, epoch, stream)));
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::{DEMO_STREAM, TRAIN_STREAM};

    #[test]
    fn problem_orders_are_seeded_epoch_permutations_that_resume_from_a_position() {
        let mut order = ProblemOrder::new(7, TRAIN_STREAM, 10);
        let drawn = order.next(25);
        for epoch in drawn.chunks(10).take(2) {
            let mut sorted = epoch.to_vec();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..10).collect::<Vec<_>>());
        }
        assert_ne!(drawn[..10], drawn[10..20], "epochs reshuffle");
        let mut resumed = ProblemOrder::new(7, TRAIN_STREAM, 10);
        resumed.seek(13);
        assert_eq!(resumed.next(12), drawn[13..25]);
        let other_stream = ProblemOrder::new(7, DEMO_STREAM, 10).next(10);
        let other_seed = ProblemOrder::new(8, TRAIN_STREAM, 10).next(10);
        assert!(other_stream != drawn[..10] && other_seed != drawn[..10]);
    }

    /// A mixture draws each part at its weight (within 4 standard errors over 20,000
    /// draws), each part in whole epochs of its own, and resumes from a count.
    #[test]
    fn mixtures_draw_each_part_at_its_weight_and_resume() {
        let parts = vec![(0..10).collect(), (10..13).collect(), (13..113).collect()];
        let weights = [0.5, 0.3, 0.2];
        let mut order = ProblemOrder::mixed(3, TRAIN_STREAM, parts, &weights);
        let n = 20_000;
        let drawn = order.next(n);
        let part = |i: usize| match i {
            0..10 => 0,
            10..13 => 1,
            _ => 2,
        };
        for (k, w) in weights.iter().enumerate() {
            let got = drawn.iter().filter(|&&i| part(i) == k).count() as f64 / n as f64;
            let se = (w * (1.0 - w) / n as f64).sqrt();
            assert!((got - w).abs() < 4.0 * se, "part {k}: {got} vs {w}");
        }
        // The small part cycles through whole epochs: its first 3 draws are 10, 11, 12.
        let mut small: Vec<usize> = drawn
            .iter()
            .copied()
            .filter(|&i| part(i) == 1)
            .take(3)
            .collect();
        small.sort_unstable();
        assert_eq!(small, [10, 11, 12]);
        let mut resumed = ProblemOrder::mixed(
            3,
            TRAIN_STREAM,
            vec![(0..10).collect(), (10..13).collect(), (13..113).collect()],
            &weights,
        );
        resumed.seek(7_777);
        assert_eq!(resumed.next(500), drawn[7_777..8_277]);
        assert_eq!(resumed.drawn(), 8_277);
    }
}
