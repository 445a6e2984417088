//! Optimizer steps skipped for a NaN or infinite loss or gradient norm: counted, and the
//! run stopped once too many come in a row.

use crate::TrainError;

/// Skipped steps in all and since the last finite one.
pub(crate) struct NonFinite {
    /// `train.max_nonfinite_steps` (0: never stop).
    max_in_a_row: u64,
    /// Steps skipped so far (`train/nonfinite_steps`).
    num_steps: u64,
    num_in_a_row: u64,
}

impl NonFinite {
    pub fn new(max_in_a_row: u64) -> Self {
        Self {
            max_in_a_row,
            num_steps: 0,
            num_in_a_row: 0,
        }
    }

    /// Steps skipped so far.
    pub fn num_steps(&self) -> u64 {
        self.num_steps
    }

    /// Continues the count of a checkpoint.
    pub fn restore(&mut self, num_steps: u64) {
        self.num_steps = num_steps;
    }

    /// Counts a skipped step or resets the streak; returns whether the weights moved.
    pub fn count(&mut self, is_nonfinite: bool) -> bool {
        if is_nonfinite {
            self.num_steps += 1;
            self.num_in_a_row += 1;
        } else {
            self.num_in_a_row = 0;
        }
        !is_nonfinite
    }

    /// The error that ends the run at `step` once the limit is reached.
    pub fn limit(&self, step: u64) -> Option<TrainError> {
        let max = self.max_in_a_row;
        (max > 0 && self.num_in_a_row >= max).then_some(TrainError::NonFinite {
            in_a_row: self.num_in_a_row,
            step,
        })
    }
}
