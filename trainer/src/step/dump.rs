//! `rollout.dump_dir`: each step's rollout as JSONL, one line per completion (prompt,
//! completion, reward, advantage, whether pruning kept it and its weight), as verl's
//! `trainer.rollout_data_dir` writes them, for reading what a run trained on.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;

use dppo_model::weights::write_atomic;
use dppo_model::TextTokenizer;
use serde_json::json;

use crate::group::Group;
use crate::prune::Kept;
use crate::TrainError;

use super::prompts::Prompts;

/// One step's rollout on this rank: its `own` groups of `groups`, with `kept`, the whole
/// batch's survivors of completion pruning.
pub(super) struct RolloutDump<'a> {
    pub step: u64,
    pub rank: usize,
    pub groups: &'a [Group],
    pub own: Range<usize>,
    pub kept: &'a [Kept],
    /// The training problems (each group's data source, by prompt id).
    pub prompts: &'a Prompts,
}

impl RolloutDump<'_> {
    /// Writes `dir/step-NNNNNN.jsonl` (`step-NNNNNN.rankR.jsonl` on ranks other than 0).
    pub fn write(&self, dir: &Path, tokenizer: &TextTokenizer) -> Result<(), TrainError> {
        let weights: BTreeMap<(usize, usize), f64> = self
            .kept
            .iter()
            .map(|k| ((k.group_idx, k.sample_idx), k.weight))
            .collect();
        let mut text = String::new();
        for g in self.own.clone() {
            let group = &self.groups[g];
            let source = self.prompts.data_source(group.prompt_id);
            let prompt = match group.samples.first() {
                Some(s) => tokenizer.decode(&s.prompt_ids, false)?,
                None => String::new(),
            };
            for (i, (sample, advantage)) in group.samples.iter().zip(&group.advantages).enumerate()
            {
                let weight = weights.get(&(g, i)).copied();
                let line = json!({
                    "step": self.step,
                    "prompt_id": group.prompt_id,
                    "data_source": source,
                    "prompt": prompt,
                    "completion": tokenizer.decode(&sample.completion_ids, true)?,
                    "reward": sample.reward,
                    "advantage": advantage,
                    "kept": weight.is_some(),
                    "weight": weight.unwrap_or(0.0),
                    "w_q": group.w_q,
                    "num_tokens": sample.completion_ids.len(),
                    "policy_version": sample.policy_version,
                });
                text.push_str(&line.to_string());
                text.push('\n');
            }
        }
        let name = match self.rank {
            0 => format!("step-{:06}.jsonl", self.step),
            r => format!("step-{:06}.rank{r}.jsonl", self.step),
        };
        std::fs::create_dir_all(dir).map_err(|source| TrainError::Io {
            path: dir.display().to_string(),
            source,
        })?;
        write_atomic(&dir.join(name), text.as_bytes())?;
        Ok(())
    }
}
