//! The supervised warm-up before RL: demonstrations (prompt + solution) trained with the
//! learner's SFT step, drawn from their own data position.

use crate::loss::TrainSeq;
use crate::TrainError;

use super::Trainer;

impl Trainer {
    /// One supervised warm-up step on a batch of demonstrations; returns the mean NLL.
    pub fn warmup_step(&mut self) -> Result<f64, TrainError> {
        let idx = self.demo_order.next(self.cfg.warmup.batch_size);
        let eos = self.eos.first().copied();
        let mut seqs = Vec::with_capacity(idx.len());
        for i in idx {
            let Some(solution) = &self.train[i].solution else {
                continue;
            };
            let mut tokens = self.train_prompts[i].clone();
            let num_prompt_tokens = tokens.len();
            tokens.extend(self.tokenizer.encode(solution, false)?);
            tokens.extend(eos);
            seqs.push(TrainSeq {
                num_prompt_tokens,
                rollout_logprobs: vec![0.0; tokens.len() - num_prompt_tokens],
                tokens,
                advantage: 0.0,
                weight: 1.0,
            });
        }
        let m = self.learner.sft_step(&seqs, self.cfg.warmup.lr)?;
        if self.count_nonfinite(m.is_nonfinite) {
            self.publish()?;
        }
        Ok(m.pg_loss)
    }

    /// Ends the supervised warm-up: the KL term (if on) is measured against this policy.
    pub fn finish_warmup(&mut self) -> Result<(), TrainError> {
        let weights = self.learner.weights()?;
        self.learner.set_reference(&weights)
    }
}
