//! The training prompts a run draws from: the problems with their prompts tokenized once,
//! the RL and warm-up positions in them, and the pruning algorithm that decides which are
//! rolled out. This part's share of a checkpoint is the RL position and the algorithm's state.

use std::collections::BTreeMap;

use dppo_model::TextTokenizer;
use rand::rngs::StdRng;

use crate::config::RunConfig;
use crate::data::{
    drop_long_prompts, problem_prompts, Problem, ProblemOrder, DEMO_STREAM, TRAIN_STREAM,
};
use crate::group::Group;
use crate::loss::TrainSeq;
use crate::prune::{
    Algorithm, AlgorithmState, BatchShape, Cppo, Dppo, Drawn, Greso, Grpo, PromptPool,
    PruningAlgorithm,
};
use crate::TrainError;

/// The training problems, positions in them and the pruning algorithm.
pub(crate) struct Prompts {
    problems: Vec<Problem>,
    /// Token ids of every problem's prompt (chat-formatted when the model has a template).
    tokens: Vec<Vec<u32>>,
    /// Every problem's prompt id, what prompt histories are keyed by.
    prompt_ids: Vec<u64>,
    /// The RL data position: problems drawn so far, epochs reshuffled by seed.
    order: ProblemOrder,
    /// The warm-up's own position over the demonstrations (`warmup.examples`).
    demo_order: ProblemOrder,
    algorithm: Box<dyn PruningAlgorithm>,
}

/// This part's share of a checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptsState {
    /// Training problems drawn so far.
    pub drawn: u64,
    pub algorithm: AlgorithmState,
}

impl Prompts {
    /// Tokenizes the prompts of `problems` (not empty) and builds the configured algorithm.
    pub fn new(
        cfg: &RunConfig,
        tokenizer: &TextTokenizer,
        problems: Vec<Problem>,
    ) -> Result<Self, TrainError> {
        let tokens = problem_prompts(tokenizer, &problems)?;
        let max = cfg.data.max_prompt_length;
        let (problems, tokens) = drop_long_prompts(problems, tokens, max, "training");
        if problems.is_empty() {
            return Err(TrainError::Config(
                "the training set is empty (data.train, data.num_train, data.max_prompt_length)"
                    .into(),
            ));
        }
        let num_demos = match cfg.warmup.examples {
            0 => problems.len(),
            n => n.min(problems.len()),
        };
        let order = match &cfg.data.train_weights {
            None => ProblemOrder::new(cfg.seed, TRAIN_STREAM, problems.len()),
            Some(weights) => {
                let mut parts = vec![Vec::new(); weights.len()];
                for (i, p) in problems.iter().enumerate() {
                    parts[p.file].push(i);
                }
                if let Some(k) = parts.iter().position(Vec::is_empty) {
                    return Err(TrainError::Config(format!(
                        "data.train file {} has no prompts left (data.max_prompt_length?)",
                        cfg.data.train.paths()[k]
                    )));
                }
                ProblemOrder::mixed(cfg.seed, TRAIN_STREAM, parts, weights)
            }
        };
        Ok(Self {
            prompt_ids: problems.iter().map(|p| p.prompt_id).collect(),
            order,
            demo_order: ProblemOrder::new(cfg.seed, DEMO_STREAM, num_demos),
            algorithm: algorithm(cfg),
            problems,
            tokens,
        })
    }

    /// The length of the longest prompt in tokens.
    pub fn longest(&self) -> usize {
        self.tokens.iter().map(Vec::len).max().unwrap_or(0)
    }

    /// Training problem `i`.
    pub fn problem(&self, i: usize) -> &Problem {
        &self.problems[i]
    }

    /// The data source of the training problem with `prompt_id`.
    pub fn data_source(&self, prompt_id: u64) -> Option<&str> {
        let i = self.prompt_ids.iter().position(|&id| id == prompt_id)?;
        Some(&self.problems[i].data_source)
    }

    /// The token ids of training problem `i`'s prompt.
    pub fn tokens(&self, i: usize) -> &[u32] {
        &self.tokens[i]
    }

    /// The algorithm that prunes this run.
    pub fn algorithm(&self) -> &dyn PruningAlgorithm {
        self.algorithm.as_ref()
    }

    /// Draws a step's prompts and prunes them (`rng`: the step's draw stream).
    pub fn draw(&mut self, rng: &mut StdRng) -> Drawn {
        let mut pool = PromptPool {
            order: &mut self.order,
            prompt_ids: &self.prompt_ids,
        };
        self.algorithm.draw(&mut pool, rng)
    }

    /// Lets the algorithm learn from step `step`'s scored groups.
    pub fn update(&mut self, groups: &[Group], step: u64) {
        self.algorithm.update(groups, step);
    }

    /// The next `batch_size` demonstrations (prompt, solution, `eos`) of the warm-up;
    /// problems without a solution are skipped.
    pub fn demo_batch(
        &mut self,
        batch_size: usize,
        tokenizer: &TextTokenizer,
        eos: Option<u32>,
    ) -> Result<Vec<TrainSeq>, TrainError> {
        let mut seqs = Vec::with_capacity(batch_size);
        for i in self.demo_order.next(batch_size) {
            let Some(solution) = &self.problems[i].solution else {
                continue;
            };
            let mut tokens = self.tokens[i].clone();
            let num_prompt_tokens = tokens.len();
            tokens.extend(tokenizer.encode(solution, false)?);
            tokens.extend(eos);
            seqs.push(TrainSeq {
                num_prompt_tokens,
                rollout_logprobs: vec![0.0; tokens.len() - num_prompt_tokens],
                tokens,
                advantage: 0.0,
                weight: 1.0,
            });
        }
        Ok(seqs)
    }

    /// This part's share of a checkpoint.
    pub fn state(&self) -> PromptsState {
        PromptsState {
            drawn: self.order.drawn(),
            algorithm: self.algorithm.state(),
        }
    }

    /// Re-keys a checkpoint written before stable prompt ids (its prompt history, GRESO's
    /// visits and its waiting rollout's groups) from line numbers to `prompt_id`.
    pub fn upgrade_ids(&self, state: &mut super::TrainerState) {
        let ids: BTreeMap<u64, u64> = self
            .problems
            .iter()
            .map(|p| (p.legacy_id, p.prompt_id))
            .collect();
        let new_id = |old: u64| ids.get(&old).copied().unwrap_or(old);
        if let Some(history) = &mut state.history {
            let entries = std::mem::take(&mut history.entries);
            history.entries = entries.into_iter().map(|(k, v)| (new_id(k), v)).collect();
        }
        if let Some(greso) = &mut state.greso {
            let visits = std::mem::take(&mut greso.visits);
            greso.visits = visits.into_iter().map(|(k, v)| (new_id(k), v)).collect();
        }
        if let Some(rollout) = &mut state.pending {
            for group in &mut rollout.groups {
                group.prompt_id = new_id(group.prompt_id);
            }
        }
        state.stable_prompt_ids = true;
    }

    /// Continues from a checkpoint's share.
    pub fn restore(&mut self, state: PromptsState) {
        self.order.seek(state.drawn);
        self.algorithm.restore(state.algorithm);
    }
}

/// The configured algorithm (`algorithm`, `[dppo]`): the one place the choice is read.
pub(super) fn algorithm(cfg: &RunConfig) -> Box<dyn PruningAlgorithm> {
    let shape = BatchShape {
        prompts_per_step: cfg.rollout.prompts_per_step,
        group_size: cfg.rollout.n,
        max_len: cfg.rollout.max_response_len,
        beta: cfg.actor.beta,
        scope: cfg.dppo.scope,
    };
    match cfg.algorithm {
        Algorithm::Grpo => Box::new(Grpo::new(shape)),
        Algorithm::Dppo => Box::new(Dppo::new(shape, cfg.dppo)),
        Algorithm::Cppo => Box::new(Cppo::new(shape, cfg.dppo.r_o)),
        Algorithm::Greso => Box::new(Greso::new(shape)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::builtin_task;

    #[test]
    fn the_warm_up_draws_only_demonstrations_and_leaves_the_rl_position() {
        let overrides = ["warmup.examples=8".to_string()];
        let cfg = RunConfig::default_with(&overrides).unwrap();
        let tiny = dppo_model::presets::load_preset("tiny", &candle_core::Device::Cpu).unwrap();
        let (train, _) = builtin_task("arithmetic", 64, 4, 0).unwrap();
        let mut prompts = Prompts::new(&cfg, &tiny.tokenizer, train).unwrap();
        let mut demos = prompts.demo_order.clone();
        for _ in 0..3 {
            let batch = prompts.demo_batch(4, &tiny.tokenizer, Some(1)).unwrap();
            assert_eq!(batch.len(), 4, "every built-in problem has a solution");
        }
        assert_eq!(
            prompts.state().drawn,
            0,
            "RL starts at the first training problem"
        );
        assert_eq!(prompts.demo_order.drawn(), 12);
        assert!(demos.next(12).iter().all(|&i| i < 8));
    }
}
