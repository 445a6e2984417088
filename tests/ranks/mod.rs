//! Data parallelism on CPU ranks: W ranks with a global batch of B prompts train as one rank
//! with B prompts (in process: ranks as threads over loopback TCP), and the `dppo run
//! --devices cpu,cpu` launcher (processes): same weights as one rank, a killed or hung rank
//! fails the run naming it, resume is bit-exact, torchrun's variables start ranks directly.

use std::collections::BTreeMap;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use candle_core::Device;
use dppo_model::Policy;
use dppo_trainer::config::RunConfig;
use dppo_trainer::data::builtin_task;
use dppo_trainer::dist::{Collective, Single, TcpCollective};
use dppo_trainer::step::Trainer;
use serde_json::{Map, Value};

mod launcher;

/// Every value of every tensor, by name.
fn values(weights: &dppo_model::Weights) -> BTreeMap<String, Vec<f32>> {
    weights
        .tensors()
        .iter()
        .map(|(n, t)| (n.clone(), crate::util::flat(t)))
        .collect()
}

/// What a run of the step loop leaves: rank 0's weights, metrics lines and final accuracy.
struct Outcome {
    weights: BTreeMap<String, Vec<f32>>,
    lines: Vec<Map<String, Value>>,
    accuracy: f64,
}

/// `warmup` warm-up and `steps` RL steps of the built-in task from `policy` with `sets`, on
/// `world` ranks (threads joined by loopback TCP). Asserts that every rank ends with rank
/// 0's weights, bit for bit, and returns rank 0's outcome.
fn train(world: usize, policy: &Policy, sets: &[&str], warmup: u64, steps: u64) -> Outcome {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let cfg = RunConfig::default_with(&sets).unwrap();
    let (train, eval) = builtin_task(
        "arithmetic",
        cfg.data.num_train,
        cfg.data.num_eval,
        cfg.seed,
    )
    .unwrap();
    let body = |collective: Arc<dyn Collective>| {
        let mut trainer = Trainer::with_collective(
            cfg.clone(),
            policy,
            &Device::Cpu,
            train.clone(),
            eval.clone(),
            collective,
        )
        .unwrap();
        for _ in 0..warmup {
            trainer.warmup_step().unwrap();
        }
        trainer.finish_warmup().unwrap();
        let lines = (0..steps).map(|_| trainer.step().unwrap()).collect();
        let accuracy = trainer.evaluate().unwrap();
        trainer.check_replicas().unwrap();
        Outcome {
            weights: values(&trainer.learner.weights().unwrap()),
            lines,
            accuracy,
        }
    };
    if world == 1 {
        return body(Arc::new(Single));
    }
    let mut outcomes = on_ranks(world, &body);
    for (rank, o) in outcomes.iter().enumerate().skip(1) {
        assert!(
            o.weights == outcomes[0].weights,
            "rank {rank}'s replica differs from rank 0's"
        );
        assert_eq!(o.accuracy, outcomes[0].accuracy);
    }
    outcomes.swap_remove(0)
}

/// Runs `body` on `world` ranks, threads joined by loopback TCP; results in rank order.
fn on_ranks<T: Send>(world: usize, body: &(dyn Fn(Arc<dyn Collective>) -> T + Sync)) -> Vec<T> {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let timeout = Duration::from_secs(120);
    std::thread::scope(|s| {
        let mut handles = vec![s.spawn(move || {
            body(Arc::new(
                TcpCollective::root(listener, world, timeout).unwrap(),
            ))
        })];
        for rank in 1..world {
            handles.push(s.spawn(move || {
                let tcp = TcpCollective::join("127.0.0.1", port, rank, world, timeout).unwrap();
                body(Arc::new(tcp))
            }));
        }
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The largest relative difference `|a - b| / |b|` (L2, per tensor) between two sets of
/// weights.
fn worst_relative(a: &BTreeMap<String, Vec<f32>>, b: &BTreeMap<String, Vec<f32>>) -> f64 {
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    a.iter()
        .map(|(name, x)| {
            let y = &b[name];
            let diff: f64 = x
                .iter()
                .zip(y)
                .map(|(p, q)| (*p as f64 - *q as f64).powi(2))
                .sum();
            let norm: f64 = y.iter().map(|q| (*q as f64).powi(2)).sum();
            (diff / norm.max(1e-30)).sqrt()
        })
        .fold(
            0.0,
            |m, d| if d.is_nan() { f64::INFINITY } else { m.max(d) },
        )
}

/// The task's small setting: 16 training problems (prompts come back within two steps, so
/// the prompt history prunes), 8 prompts a step of 8 samples.
const SMALL: [&str; 6] = [
    "data.num_train=16",
    "data.num_eval=12",
    "warmup.examples=16",
    "rollout.prompts_per_step=8",
    "warmup.batch_size=16",
    "eval.every=0",
];

/// A policy after 30 one-rank warm-up steps at rate 3e-3 on the small task: right often
/// enough (about one sample in ten) that groups have mixed rewards and both pruning levels
/// act (at the default's gentler rate 30 steps leave it too rarely right).
fn warmed_up() -> Policy {
    static POLICY: std::sync::OnceLock<Policy> = std::sync::OnceLock::new();
    POLICY
        .get_or_init(|| {
            let tiny = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
            let sets: Vec<String> = SMALL
                .iter()
                .chain(&["warmup.lr=3e-3"])
                .map(|s| s.to_string())
                .collect();
            let cfg = RunConfig::default_with(&sets).unwrap();
            let (train, eval) = builtin_task("arithmetic", 16, 12, 0).unwrap();
            let mut trainer = Trainer::new(cfg, &tiny, &Device::Cpu, train, eval).unwrap();
            for _ in 0..30 {
                trainer.warmup_step().unwrap();
            }
            let weights = trainer.learner.weights().unwrap().deep_copy().unwrap();
            Policy::new(tiny.config.clone(), weights, tiny.tokenizer.clone()).unwrap()
        })
        .clone()
}

/// Asserts that `one` (one rank) and `many` (several) trained the same: weights within
/// 1e-5 relative, the same rollouts, pruning and accuracy (exactly), losses within 1e-4
/// (packing differs: each rank packs its own sequences).
fn assert_same_training(what: &str, one: &Outcome, many: &Outcome) {
    let worst = worst_relative(&many.weights, &one.weights);
    eprintln!("{what}: worst relative weight difference {worst:.2e}");
    assert!(
        worst <= 1e-5,
        "{what}: weights differ by {worst:e} (relative)"
    );
    assert_eq!(one.accuracy, many.accuracy, "{what}: held-out accuracy");
    assert_eq!(one.lines.len(), many.lines.len());
    for (a, b) in one.lines.iter().zip(&many.lines) {
        for (key, x) in a {
            let y = &b[key];
            // Each rank packs its own sequences: buffers and density are the ranks' sums.
            if key.starts_with("timing_s/") || key.starts_with("perf/") || key.starts_with("pack/")
            {
                continue;
            }
            // Sums over ranks in another order: equal up to rounding. The mismatch is itself
            // rounding (about 1e-6 in logprob), which other packings change by as much.
            let summed =
                (key.starts_with("actor/") && key != "actor/lr") || key == "prune/grad_rel_mse";
            let rounding = key.starts_with("mismatch/");
            if summed || rounding {
                let (x, y) = (x.as_f64().unwrap(), y.as_f64().unwrap());
                let tol = if rounding {
                    1e-5
                } else {
                    1e-4 * x.abs().max(1e-3)
                };
                assert!(
                    (x - y).abs() <= tol,
                    "{what}: step {} {key}: one rank {x}, several {y}",
                    a["step"]
                );
                continue;
            }
            assert_eq!(x, y, "{what}: step {} {key}", a["step"]);
        }
        assert_eq!(a.len(), b.len(), "{what}: the same metrics");
    }
}

/// The proof: 2 CPU ranks with a global batch of 8 prompts end with the weights of 1 rank
/// with 8 prompts, for GRPO and for DPPO with both pruning levels (group and batch scope,
/// one step off-policy and synchronous), and the biased baselines; 3 ranks too, one of
/// them with a single prompt a step. Prompt pruning and completion pruning both act.
#[test]
fn ranks_train_as_one_rank_with_the_whole_batch() {
    let policy = warmed_up();
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        SMALL.iter().copied().chain(extra.iter().copied()).collect()
    };
    let cases: [(&str, usize, Vec<&str>); 6] = [
        ("grpo", 2, with(&["algorithm=grpo"])),
        ("dppo", 2, with(&[])),
        (
            "dppo, batch scope, batch-std advantages, synchronous, gradient-variance study",
            2,
            with(&[
                "dppo.scope=batch",
                "actor.scale_rewards=batch",
                "rollout.one_step_off_policy=false",
                "eval.every=2",
                "eval.grad_variance_draws=2",
            ]),
        ),
        ("cppo", 2, with(&["algorithm=cppo"])),
        ("greso", 2, with(&["algorithm=greso"])),
        (
            "dppo on 3 ranks, 4 prompts a step",
            3,
            with(&["rollout.prompts_per_step=4"]),
        ),
    ];
    for (what, world, sets) in cases {
        let one = train(1, &policy, &sets, 0, 6);
        let many = train(world, &policy, &sets, 0, 6);
        assert_same_training(what, &one, &many);
        if what.contains("variance") {
            let measured = one
                .lines
                .iter()
                .filter(|l| l.contains_key("prune/grad_rel_mse"));
            assert_eq!(measured.count(), 3, "the study ran at steps 2, 4 and 6");
        }
        if what == "dppo" {
            let kept = |key: &str| one.lines.iter().any(|l| l[key].as_f64().unwrap() < 1.0);
            assert!(kept("prune/prompts_kept"), "prompt pruning never acted");
            assert!(
                kept("prune/completions_kept"),
                "completion pruning never acted"
            );
            let reward: f64 = one
                .lines
                .iter()
                .map(|l| l["reward/mean"].as_f64().unwrap())
                .sum();
            assert!(reward > 0.0, "no sample was right: nothing trained");
        }
    }
}

/// The supervised warm-up shards its batch too: 2 ranks' warm-up equals 1 rank's.
#[test]
fn the_warm_up_shards_its_batch_over_ranks() {
    let tiny = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
    let one = train(1, &tiny, &SMALL, 6, 0);
    let two = train(2, &tiny, &SMALL, 6, 0);
    let worst = worst_relative(&two.weights, &one.weights);
    assert!(worst <= 1e-5, "warm-up weights differ by {worst:e}");
    assert_ne!(
        values(&tiny.weights),
        one.weights,
        "the warm-up trained nothing"
    );
}

/// A replica whose weights drifted (here: changed by hand on rank 1) is caught by the
/// checksum check on every rank, with each rank's checksum in the error.
#[test]
fn diverged_replicas_are_an_error_naming_every_rank() {
    let tiny = dppo_model::presets::load_preset("tiny", &Device::Cpu).unwrap();
    let sets: Vec<String> = SMALL.iter().map(|s| s.to_string()).collect();
    let cfg = RunConfig::default_with(&sets).unwrap();
    let (train, eval) = builtin_task("arithmetic", 16, 12, 0).unwrap();
    let errors = on_ranks(2, &|collective| {
        let trainer = Trainer::with_collective(
            cfg.clone(),
            &tiny,
            &Device::Cpu,
            train.clone(),
            eval.clone(),
            collective,
        )
        .unwrap();
        trainer.check_replicas().unwrap();
        if trainer.rank().0 == 1 {
            let var = trainer.learner.vars.values().next().unwrap();
            var.set(&(var.as_tensor() * 1.0001).unwrap()).unwrap();
        }
        trainer.check_replicas().unwrap_err().to_string()
    });
    for err in errors {
        assert!(
            err.contains("replicas diverged")
                && err.contains("rank 0: ")
                && err.contains("rank 1: "),
            "{err}"
        );
    }
}
