//! A rollout's scoring, on a thread of its own: each prompt's completions are scored as the
//! engine finishes them, up to `reward.concurrency` groups at once, so that a slow reward
//! overlaps generation (and, one step off-policy, training) instead of following it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;

use dppo_engine::RequestHandle;
use dppo_model::TextTokenizer;

use crate::data::Problem;
use crate::group::{Group, Sample};
use crate::reward::{RewardItem, RewardTally, ScoredGroup, Scorer};
use crate::TrainError;

/// One rolled-out prompt: its problem, prompt tokens, `w_q` and the engine's request.
pub(super) struct PromptJob {
    pub problem: Problem,
    pub tokens: Vec<u32>,
    pub w_q: f64,
    pub handle: RequestHandle,
}

/// The scored groups of a rollout, in request order.
pub(super) struct Scored {
    pub groups: Vec<Group>,
    pub gen_tokens: usize,
    pub tally: RewardTally,
}

/// A group waiting for its scores.
struct Unscored {
    problem: Problem,
    w_q: f64,
    samples: Vec<Sample>,
    items: Vec<RewardItem>,
}

/// Starts scoring `jobs`, whose completions must all come from policy `version`.
pub(super) fn spawn(
    jobs: Vec<PromptJob>,
    version: u64,
    tokenizer: TextTokenizer,
    scorer: Arc<Scorer>,
) -> JoinHandle<Result<Scored, TrainError>> {
    std::thread::spawn(move || score_all(jobs, version, &tokenizer, &scorer))
}

fn score_all(
    jobs: Vec<PromptJob>,
    version: u64,
    tokenizer: &TextTokenizer,
    scorer: &Scorer,
) -> Result<Scored, TrainError> {
    let num_groups = jobs.len();
    let failed = AtomicBool::new(false);
    let (send, receive) = mpsc::channel::<(usize, Unscored)>();
    let receive = Mutex::new(receive);
    let mut results: Vec<Option<(Unscored, ScoredGroup)>> = (0..num_groups).map(|_| None).collect();
    let mut gen_tokens = 0;
    let mut first_error = None;
    std::thread::scope(|s| {
        let workers: Vec<_> = (0..scorer.concurrency().clamp(1, num_groups.max(1)))
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let next = receive.lock().unwrap_or_else(|e| e.into_inner()).recv();
                        let Ok((index, group)) = next else { break };
                        let what = format!("prompt {}", group.problem.describe());
                        let scored =
                            scorer.score(&group.items, group.problem.answer.as_ref(), &what, true);
                        failed.fetch_or(scored.is_err(), Ordering::Relaxed);
                        done.push((index, group, scored));
                    }
                    done
                })
            })
            .collect();
        // Groups in request order; once a score failed, the rest are cancelled (dropped).
        for (index, job) in jobs.into_iter().enumerate() {
            if failed.load(Ordering::Relaxed) {
                break;
            }
            match collect(job, version, tokenizer, scorer.is_external()) {
                Ok((group, tokens)) => {
                    gen_tokens += tokens;
                    // The workers outlive the sender: the send cannot fail.
                    let _ = send.send((index, group));
                }
                Err(e) => {
                    first_error = Some(e);
                    failed.store(true, Ordering::Relaxed);
                    break;
                }
            }
        }
        drop(send);
        for worker in workers {
            let done = worker.join().unwrap_or_default();
            for (index, group, scored) in done {
                match scored {
                    Ok(scored) => results[index] = Some((group, scored)),
                    Err(e) => {
                        first_error.get_or_insert(e.into());
                    }
                }
            }
        }
    });
    if let Some(e) = first_error {
        return Err(e);
    }
    let mut tally = RewardTally::default();
    let groups = results
        .into_iter()
        .map(|r| {
            let (group, scored) = r.expect("every group was scored when none failed");
            tally.merge(scored.tally);
            let mut samples = group.samples;
            for (sample, reward) in samples.iter_mut().zip(scored.rewards) {
                sample.reward = reward;
            }
            Group {
                w_q: group.w_q,
                ..Group::new(group.problem.prompt_id, samples)
            }
        })
        .collect();
    Ok(Scored {
        groups,
        gen_tokens,
        tally,
    })
}

/// Waits for one prompt's completions and turns them into samples (rewards still 0) and
/// reward items (the prompt's text decoded only for an external reward); also returns the
/// tokens generated.
fn collect(
    job: PromptJob,
    version: u64,
    tokenizer: &TextTokenizer,
    external: bool,
) -> Result<(Unscored, usize), TrainError> {
    let prompt = match external {
        true => tokenizer.decode(&job.tokens, false)?,
        false => String::new(),
    };
    let mut samples = Vec::with_capacity(job.handle.n);
    let mut items = Vec::with_capacity(job.handle.n);
    let mut tokens = 0;
    for c in job.handle.wait() {
        if c.policy_version != version || c.last_policy_version != version {
            return Err(TrainError::Version {
                expected: version,
                got: c.last_policy_version,
            });
        }
        tokens += c.token_ids.len();
        items.push(RewardItem::of_completion(
            &job.problem,
            &prompt,
            &c,
            tokenizer,
        )?);
        samples.push(Sample {
            prompt_ids: job.tokens.clone(),
            reward: 0.0,
            completion_ids: c.token_ids,
            rollout_logprobs: c.logprobs,
            policy_version: c.policy_version,
        });
    }
    Ok((
        Unscored {
            problem: job.problem,
            w_q: job.w_q,
            samples,
            items,
        },
        tokens,
    ))
}
