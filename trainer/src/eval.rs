//! Held-out evaluation through the engine: avg@n and unbiased pass@k (Chen et al. 2021).

use dppo_engine::{Engine, GenerateRequest, Priority, SamplingParams};
use dppo_model::TextTokenizer;

use crate::data::{drop_long_prompts, problem_prompts, Problem};
use crate::reward::{RewardItem, Scorer};
use crate::TrainError;
use dppo_rewards::Rule;

/// Accuracy figures of one evaluation.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalResult {
    /// Mean reward over all `n` samples of all problems (avg@n; with the verifier, the
    /// accuracy when n = 1).
    pub avg: f64,
    /// Unbiased pass@k averaged over problems (a sample passes with a reward of at least 1).
    pub pass_at_k: f64,
    pub k: usize,
    pub n: usize,
}

/// `1 - C(n - c, k) / C(n, k)`: the probability that at least one of `k` samples drawn
/// without replacement from `n` (of which `c` are correct) is correct.
pub fn pass_at_k(n: usize, c: usize, k: usize) -> f64 {
    if n - c < k {
        return 1.0;
    }
    // Product form, stable for large n.
    1.0 - ((n - c + 1)..=n)
        .map(|i| 1.0 - k as f64 / i as f64)
        .product::<f64>()
}

/// How to sample for an evaluation.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalSpec {
    pub sampling: SamplingParams,
    /// Samples per problem.
    pub n: usize,
    /// The k of pass@k (at most n).
    pub k: usize,
    pub max_tokens: usize,
}

/// One scored sample of an evaluation.
#[derive(Debug, Clone, PartialEq)]
pub struct Graded {
    /// The decoded completion.
    pub text: String,
    /// The reward without the overlong penalty (the verifier's: 1 when correct, else 0).
    pub reward: f64,
    /// The rule that found the final answer (`None`: no rule found one).
    pub extracted_by: Option<Rule>,
    /// It ended on the token limit.
    pub is_truncated: bool,
    pub num_tokens: usize,
}

/// Held-out problems with their prompts tokenized once, so that periodic evaluations
/// during a run do not re-apply the chat template and re-tokenize every time.
#[derive(Debug, Clone)]
pub struct EvalSet {
    problems: Vec<Problem>,
    /// The token ids of every problem's prompt (chat template applied), in problem order.
    prompts: Vec<Vec<u32>>,
}

impl EvalSet {
    /// Tokenizes the prompts of `problems` with `tokenizer`, leaving out those longer than
    /// `max_prompt_length` tokens.
    pub fn new(
        tokenizer: &TextTokenizer,
        problems: Vec<Problem>,
        max_prompt_length: Option<usize>,
    ) -> Result<Self, TrainError> {
        let prompts = problem_prompts(tokenizer, &problems)?;
        let (problems, prompts) =
            drop_long_prompts(problems, prompts, max_prompt_length, "held-out");
        Ok(Self { problems, prompts })
    }

    /// The problems, in the order of their prompts.
    pub fn problems(&self) -> &[Problem] {
        &self.problems
    }

    /// The problems in `range` (one rank's share of an evaluation).
    pub fn shard(&self, range: std::ops::Range<usize>) -> Self {
        Self {
            problems: self.problems[range.clone()].to_vec(),
            prompts: self.prompts[range].to_vec(),
        }
    }

    /// The length of the longest prompt in tokens (0 when empty).
    pub fn longest_prompt(&self) -> usize {
        self.prompts.iter().map(Vec::len).max().unwrap_or(0)
    }
}

/// Generates `n` samples per problem and scores them with `scorer` (no overlong penalty:
/// evaluation measures the task's score; `tokenizer` decodes the samples); also returns
/// every problem's samples (in problem order) for inspection.
pub fn evaluate(
    engine: &Engine,
    tokenizer: &TextTokenizer,
    set: &EvalSet,
    spec: &EvalSpec,
    scorer: &Scorer,
) -> Result<(EvalResult, Vec<Vec<Graded>>), TrainError> {
    let reqs = set
        .prompts
        .iter()
        .map(|ids| GenerateRequest {
            sampling: spec.sampling.clone(),
            priority: Priority::High,
            pin_policy_version: true,
            ..GenerateRequest::new(ids.clone(), spec.n, spec.max_tokens)
        })
        .collect();
    let (n, k) = (spec.n, spec.k);
    let outs = engine.generate(reqs)?;
    let (mut total, mut pass) = (0.0, 0.0);
    let mut samples = Vec::with_capacity(set.problems.len());
    for ((p, ids), completions) in set.problems.iter().zip(&set.prompts).zip(outs) {
        let prompt = match scorer.is_external() {
            true => tokenizer.decode(ids, false)?,
            false => String::new(),
        };
        let items = completions
            .iter()
            .map(|c| RewardItem::of_completion(p, &prompt, c, tokenizer))
            .collect::<Result<Vec<_>, TrainError>>()?;
        let what = format!("held-out prompt {}", p.describe());
        let scored = scorer.score(&items, p.answer.as_ref(), &what, false)?;
        let graded: Vec<Graded> = items
            .into_iter()
            .zip(scored.rewards)
            .zip(scored.extracted_by)
            .map(|((item, reward), extracted_by)| Graded {
                text: item.completion,
                reward,
                extracted_by,
                is_truncated: item.is_truncated,
                num_tokens: item.num_tokens,
            })
            .collect();
        total += graded.iter().map(|g| g.reward).sum::<f64>();
        let correct = graded.iter().filter(|g| g.reward >= 1.0).count();
        pass += pass_at_k(n, correct, k.min(n));
        samples.push(graded);
    }
    let m = set.problems.len().max(1) as f64;
    let result = EvalResult {
        avg: total / (m * n as f64),
        pass_at_k: pass / m,
        k: k.min(n),
        n,
    };
    Ok((result, samples))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn binomial(n: u64, k: u64) -> f64 {
        if k > n {
            return 0.0;
        }
        (0..k).map(|i| (n - i) as f64 / (i + 1) as f64).product()
    }

    #[test]
    fn pass_at_k_matches_the_combinatorial_definition() {
        for n in 1..12usize {
            for c in 0..=n {
                for k in 1..=n {
                    let want =
                        1.0 - binomial((n - c) as u64, k as u64) / binomial(n as u64, k as u64);
                    assert!(
                        (pass_at_k(n, c, k) - want).abs() < 1e-12,
                        "n={n} c={c} k={k}"
                    );
                }
            }
        }
        assert_eq!(pass_at_k(10, 0, 1), 0.0);
        assert_eq!(pass_at_k(10, 10, 1), 1.0);
        assert!((pass_at_k(10, 3, 1) - 0.3).abs() < 1e-12);
    }
}
