//! The engine's requests over their lives: cancellation and dropped handles free their
//! blocks, dropping the engine finishes queued work, statistics, isolated high-priority
//! batches, and weight swaps (policy versions, pinned requests).

use super::*;

#[test]
fn cancellation_frees_blocks_at_once() {
    let policy = policy();
    let engine = Engine::new(&policy, config(4, 512, AttentionMode::Auto), Device::Cpu).unwrap();
    // On a loaded machine the worker may finish a sample's 100 tokens before this thread
    // cancels; such an attempt proves nothing and is repeated.
    for _ in 0..10 {
        let mut req = greedy(vec![1, 2, 3, 4, 5], 3, 100);
        req.max_tokens = 100;
        let mut handle = engine.submit(req).unwrap();
        let first = handle.blocking_recv().unwrap();
        assert!(matches!(first, Event::Token { .. }));
        handle.cancel();
        let completions = handle.wait();
        if completions.iter().any(|c| c.token_ids.len() == 100) {
            continue;
        }
        assert!(completions
            .iter()
            .all(|c| c.finish_reason == FinishReason::Cancelled));
        assert!(completions.iter().all(|c| c.token_ids.len() < 100));
        // The next request runs in a pool with every block back.
        let out = engine.generate(vec![greedy(vec![1, 2], 1, 3)]).unwrap();
        assert_eq!(out[0][0].token_ids.len(), 3);
        return;
    }
    panic!("the request always finished before it could be cancelled");
}

#[test]
fn dropping_a_handle_cancels_its_request() {
    let policy = policy();
    let engine = Engine::new(&policy, config(4, 512, AttentionMode::Auto), Device::Cpu).unwrap();
    // On a loaded machine the worker may finish all 200 tokens before this thread looks
    // again; such an attempt proves nothing and is repeated.
    for _ in 0..10 {
        let start_tokens = engine.stats().num_generated_tokens;
        let mut handle = engine.submit(greedy(vec![1, 2, 3], 2, 100)).unwrap();
        handle.blocking_recv().unwrap();
        let before = engine.stats();
        if before.num_running == 0 {
            drop(handle);
            continue;
        }
        assert!(before.blocks_used > 0);
        drop(handle);
        // The worker applies the cancellation before its next iteration; wait for it.
        let start = std::time::Instant::now();
        while engine.stats().blocks_used > 0 || engine.stats().num_running > 0 {
            assert!(start.elapsed().as_secs() < 10, "blocks were not freed");
            std::thread::yield_now();
        }
        let generated = engine.stats().num_generated_tokens - start_tokens;
        assert!(
            generated < 2 * 100,
            "the request ran to the end: {generated}"
        );
        return;
    }
    panic!("the request always finished before its handle could be dropped");
}

#[test]
fn stats_count_an_iteration_before_streaming_its_tokens() {
    let policy = policy();
    let engine = Engine::new(&policy, config(4, 512, AttentionMode::Auto), Device::Cpu).unwrap();
    for round in 1..=3 {
        let before = engine.stats();
        let out = engine.generate(vec![greedy(vec![1, 2, 3], 2, 6)]).unwrap();
        // Read at once after the last token arrived: the iterations that made it are in.
        let after = engine.stats();
        let tokens: usize = out[0].iter().map(|c| c.token_ids.len()).sum();
        assert_eq!(
            after.num_generated_tokens - before.num_generated_tokens,
            tokens
        );
        assert!(after.busy_ns > before.busy_ns, "round {round}");
    }
}

#[test]
fn dropping_the_engine_finishes_queued_work_although_handles_live() {
    let policy = policy();
    let engine = Engine::new(&policy, config(4, 512, AttentionMode::Auto), Device::Cpu).unwrap();
    let handle = engine.submit(greedy(vec![1, 2, 3], 2, 20)).unwrap();
    // The live handle keeps a sender to the worker: the drop must not wait on the channel
    // closing. Dropped on another thread so that a hang fails the test instead of stalling it.
    let (done, dropped) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        drop(engine);
        done.send(()).unwrap();
    });
    dropped
        .recv_timeout(std::time::Duration::from_secs(60))
        .expect("dropping the engine hung while a request handle was alive");
    let completions = handle.wait();
    assert_eq!(completions.len(), 2);
    assert!(completions.iter().all(|c| c.token_ids.len() == 20));
}

/// Rollouts (high priority, isolated) give bit-identical tokens and logprobs whether or
/// not normal traffic shares the engine.
#[test]
fn isolated_high_priority_batches_ignore_other_traffic() {
    let policy = policy();
    let mut rollouts = seeded_workload(6, 4, policy.config.vocab_size, 0);
    for r in &mut rollouts {
        r.priority = Priority::High;
    }
    let cfg = EngineConfig {
        isolate_high_priority: true,
        ..config(16, 4096, AttentionMode::Auto)
    };
    let alone = Engine::new(&policy, cfg, Device::Cpu)
        .unwrap()
        .generate(rollouts.clone())
        .unwrap();
    let engine = Engine::new(&policy, cfg, Device::Cpu).unwrap();
    let traffic: Vec<_> = workload(8, 2, policy.config.vocab_size)
        .into_iter()
        .map(|r| {
            engine
                .submit(GenerateRequest {
                    max_tokens: 60,
                    ..r
                })
                .unwrap()
        })
        .collect();
    let busy = engine.generate(rollouts).unwrap();
    assert_eq!(alone, busy);
    // The normal traffic still completes afterwards.
    for handle in traffic {
        assert!(handle.wait().iter().all(|c| c.token_ids.len() == 60));
    }
}

#[test]
fn outputs_carry_the_policy_version_and_swaps_apply_between_iterations() {
    let policy = policy();
    let reqs = workload(2, 1, policy.config.vocab_size);
    let other = random_policy(&policy.config, 99);
    let want = reference(&other, &reqs);
    for mode in MODES {
        let engine = Engine::new(&policy, config(16, 2048, mode), Device::Cpu).unwrap();
        let before = engine.generate(reqs.clone()).unwrap();
        assert!(before
            .iter()
            .flatten()
            .all(|c| c.policy_version == 0 && c.last_policy_version == 0));
        assert_eq!(engine.publish(&other.weights).unwrap(), 1);
        assert_eq!(engine.policy_version(), 1);
        let after = engine.generate(reqs.clone()).unwrap();
        assert!(after.iter().flatten().all(|c| c.policy_version == 1));
        // After the swap the engine generates with the new weights.
        assert_matches_reference(&after, &want, &format!("{mode:?}"));
    }
}

#[test]
fn a_publication_waits_for_the_pinned_requests_to_finish() {
    let policy = policy();
    let other = random_policy(&policy.config, 99);
    let engine = Engine::new(&policy, config(16, 2048, AttentionMode::Auto), Device::Cpu).unwrap();
    let pinned: Vec<GenerateRequest> = workload(2, 2, policy.config.vocab_size)
        .into_iter()
        .map(|r| GenerateRequest {
            max_tokens: 40,
            ignore_eos: true,
            pin_policy_version: true,
            ..r
        })
        .collect();
    let handles = engine.submit_all(pinned).unwrap();
    // Published while the pinned requests run (the submission is queued first).
    assert_eq!(engine.publish(&other.weights).unwrap(), 1);
    for handle in handles {
        for c in handle.wait() {
            assert_eq!((c.policy_version, c.last_policy_version), (0, 0));
            assert_eq!(c.token_ids.len(), 40);
        }
    }
    let after = engine
        .generate(workload(1, 1, policy.config.vocab_size))
        .unwrap();
    assert!(after.iter().flatten().all(|c| c.policy_version == 1));
    assert_eq!(engine.stats().policy_version, 1);
}
