use super::*;
use crate::kv_pool::BlockCopy;

fn request(request_id: RequestId, prompt_len: usize, n: usize, max_tokens: usize) -> SeqRequest {
    SeqRequest {
        request_id,
        prompt_ids: (0..prompt_len as u32).collect(),
        n,
        max_tokens,
        eos_token_ids: Arc::from(vec![999u32]),
        priority: Priority::Normal,
    }
}

fn scheduler(num_blocks: usize, block_size: usize, max_batched_tokens: usize) -> Scheduler {
    let cfg = SchedulerConfig {
        max_num_seqs: 16,
        max_batched_tokens,
        isolate_high_priority: false,
    };
    Scheduler::new(cfg, KvPool::new(num_blocks, block_size))
}

/// Runs `plan` with a fake model that always samples `token`.
fn step(s: &mut Scheduler, token: u32) -> (Plan, Vec<Appended>) {
    let plan = s.schedule();
    let sampled: Vec<Vec<u32>> = plan
        .seqs
        .iter()
        .map(|p| vec![token; p.num_samples])
        .collect();
    let appended = s.postprocess(&plan, &sampled);
    (plan, appended)
}

#[test]
fn group_prefills_once_then_forks_with_copy_on_write() {
    // Prompt of 20 tokens, blocks of 8: two full blocks and one holding 4 tokens.
    let mut s = scheduler(16, 8, 64);
    s.add_request(request(7, 20, 4, 5)).unwrap();
    let (plan, appended) = step(&mut s, 1);
    assert_eq!(plan.seqs.len(), 1, "the prompt is prefilled once");
    assert_eq!(plan.seqs[0].num_new_tokens, 20);
    assert_eq!(plan.seqs[0].num_samples, 4);
    assert_eq!(appended.len(), 4);
    let samples: Vec<usize> = appended.iter().map(|a| a.sample_index).collect();
    assert_eq!(samples, vec![3, 2, 1, 0]);
    // Prompt blocks stored once, referenced by all four samples.
    assert_eq!(s.pool().num_free_blocks(), 16 - 3);
    assert!((0..3).all(|b| s.pool().ref_count(b) == 4));
    // First decode: the shared partial block 2 is copied for three samples; the last
    // one to write owns it alone and writes in place.
    let (plan, _) = step(&mut s, 1);
    assert_eq!(plan.seqs.len(), 4);
    assert!(plan
        .seqs
        .iter()
        .all(|p| p.num_new_tokens == 1 && p.num_samples == 1));
    let copies: Vec<BlockCopy> = plan.block_copies.clone();
    assert_eq!(
        copies,
        vec![
            BlockCopy {
                src: 2,
                dst: 3,
                num_tokens: 4
            },
            BlockCopy {
                src: 2,
                dst: 4,
                num_tokens: 4
            },
            BlockCopy {
                src: 2,
                dst: 5,
                num_tokens: 4
            },
        ]
    );
    assert_eq!((s.pool().ref_count(0), s.pool().ref_count(2)), (4, 1));
    assert_eq!(s.pool().num_free_blocks(), 16 - 6);
}

#[test]
fn finished_and_cancelled_sequences_return_their_blocks() {
    let mut s = scheduler(8, 4, 64);
    s.add_request(request(1, 6, 2, 2)).unwrap();
    s.add_request(request(2, 3, 1, 10)).unwrap();
    step(&mut s, 1);
    step(&mut s, 1);
    // Request 1 hit max_tokens = 2: only request 2 holds blocks, one for its 4
    // computed tokens (3 prompt + 1 output; the newest output is not computed yet).
    assert_eq!(s.num_waiting_running(), (0, 1));
    assert_eq!(s.pool().num_free_blocks(), 8 - 1);
    assert_eq!(s.cancel(2).len(), 1);
    assert_eq!(s.pool().num_free_blocks(), 8);
    assert!(!s.has_work());
}

#[test]
fn eos_retires_a_sample() {
    let mut s = scheduler(8, 4, 64);
    s.add_request(request(1, 3, 1, 10)).unwrap();
    let (_, appended) = step(&mut s, 999);
    assert_eq!(appended[0].finish, Some(FinishReason::Stop));
    assert!(!s.has_work());
    assert_eq!(s.pool().num_free_blocks(), 8);
}

#[test]
fn long_prompts_are_prefilled_in_chunks_within_the_token_budget() {
    let mut s = scheduler(16, 4, 8);
    s.add_request(request(1, 19, 1, 3)).unwrap();
    let chunks: Vec<(usize, usize)> = (0..3)
        .map(|_| {
            let (plan, _) = step(&mut s, 1);
            (plan.seqs[0].num_new_tokens, plan.seqs[0].num_samples)
        })
        .collect();
    assert_eq!(chunks, vec![(8, 0), (8, 0), (3, 1)]);
}

#[test]
fn out_of_blocks_preempts_the_newest_and_recomputes_it() {
    // Two requests of 4 prompt tokens and 8 new tokens in a pool of 5 blocks of 4.
    let mut s = scheduler(5, 4, 64);
    s.add_request(request(1, 4, 1, 8)).unwrap();
    s.add_request(request(2, 4, 1, 8)).unwrap();
    let mut preempted = Vec::new();
    let mut outputs: HashMap<RequestId, usize> = HashMap::new();
    for _ in 0..40 {
        if !s.has_work() {
            break;
        }
        let (plan, appended) = step(&mut s, 1);
        preempted.extend(plan.preempted);
        for a in appended {
            *outputs.entry(a.request_id).or_default() += 1;
        }
    }
    assert!(!preempted.is_empty(), "the pool was meant to run out");
    assert_eq!(outputs[&1], 8);
    assert_eq!(outputs[&2], 8);
    assert_eq!(s.pool().num_free_blocks(), 5);
}

#[test]
fn requests_that_can_never_fit_are_rejected() {
    let mut s = scheduler(4, 4, 64);
    let err = s.add_request(request(1, 10, 1, 7)).unwrap_err().to_string();
    assert!(err.contains("needs 5 KV blocks, the pool has 4"), "{err}");
    assert!(s.add_request(request(2, 0, 1, 1)).is_err());
    assert!(s.add_request(request(3, 2, 0, 1)).is_err());
    assert!(s.add_request(request(4, 2, 17, 1)).is_err());
    assert!(!s.has_work());
}

fn with_priority(mut r: SeqRequest, priority: Priority) -> SeqRequest {
    r.priority = priority;
    r
}

#[test]
fn high_priority_is_admitted_first_and_normal_is_preempted_for_it() {
    // Pool of 4 blocks of 4: the normal request holds 2, the high one needs 3.
    let mut s = scheduler(4, 4, 64);
    s.add_request(request(1, 6, 1, 10)).unwrap();
    step(&mut s, 1);
    s.add_request(request(2, 2, 1, 2)).unwrap();
    s.add_request(with_priority(request(3, 10, 1, 2), Priority::High))
        .unwrap();
    let (plan, appended) = step(&mut s, 1);
    assert_eq!(plan.preempted, vec![0], "the normal sequence makes way");
    assert_eq!(appended.len(), 1);
    assert_eq!(appended[0].request_id, 3, "the high request runs first");
    assert_eq!(s.waiting.len(), 2);
    assert_eq!(s.seqs[&s.waiting[0]].request_id, 1, "preempted go first");
    while s.has_work() {
        step(&mut s, 1);
    }
    assert_eq!(s.pool().num_free_blocks(), 4);
}

#[test]
fn isolation_runs_high_priority_work_alone() {
    let mut s = scheduler(64, 4, 64);
    s.cfg.isolate_high_priority = true;
    s.add_request(request(1, 3, 1, 20)).unwrap();
    step(&mut s, 1);
    s.add_request(with_priority(request(2, 5, 2, 3), Priority::High))
        .unwrap();
    s.add_request(request(3, 3, 1, 2)).unwrap();
    let mut high_done = false;
    while s.has_work() {
        let (plan, appended) = step(&mut s, 1);
        let ids: Vec<RequestId> = appended.iter().map(|a| a.request_id).collect();
        if !high_done {
            assert!(
                ids.iter().all(|&r| r == 2),
                "normal work ran beside high: {ids:?}"
            );
            assert!(plan.seqs.iter().all(|p| s
                .seqs
                .get(&p.seq_id)
                .is_none_or(|q| q.priority == Priority::High)));
        }
        high_done |= appended
            .iter()
            .any(|a| a.request_id == 2 && a.finish.is_some())
            && !s.seqs.values().any(|q| q.priority == Priority::High);
    }
    assert!(high_done);
    assert_eq!(s.pool().num_free_blocks(), 64);
}

/// Small deterministic generator for the random workload.
struct Lcg(u64);
impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) % n as u64) as usize
    }
}

#[test]
fn random_workloads_return_every_block() {
    for seed in 0..30 {
        let mut rng = Lcg(seed);
        let block_size = 1 + rng.below(6);
        let num_blocks = 8 + rng.below(24);
        let mut s = scheduler(num_blocks, block_size, 4 + rng.below(40));
        s.cfg.isolate_high_priority = rng.below(2) == 0;
        let mut next_id = 0;
        for _ in 0..200 {
            // Arrivals, some cancellations, random EOS.
            if rng.below(3) == 0 {
                let prompt = 1 + rng.below(12);
                let priority = [Priority::Normal, Priority::High][rng.below(2)];
                let r = request(next_id, prompt, 1 + rng.below(4), 1 + rng.below(10));
                let _ = s.add_request(with_priority(r, priority));
                next_id += 1;
            }
            if rng.below(10) == 0 && next_id > 0 {
                s.cancel(rng.below(next_id as usize) as RequestId);
            }
            if s.has_work() {
                let token = if rng.below(8) == 0 { 999 } else { 1 };
                step(&mut s, token);
            }
            let used: usize = s.seqs.values().map(|q| q.block_table.len()).sum();
            assert!(
                num_blocks - s.pool().num_free_blocks() <= used,
                "seed {seed}: leaked blocks"
            );
        }
        while s.has_work() {
            step(&mut s, 1);
        }
        assert_eq!(
            s.pool().num_free_blocks(),
            num_blocks,
            "seed {seed}: blocks not returned"
        );
        assert!((0..num_blocks as u32).all(|b| s.pool().ref_count(b) == 0));
    }
}
