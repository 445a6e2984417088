//! The hand-off check: the learner and the engine on streams of their own, as in `dppo run`,
//! the engine generating on one thread while the learner steps and publishes on another.
//! After each publication the engine must hold exactly the learner's weights cast to its
//! dtype, and generate exactly what a fresh engine built from those weights generates: a
//! missing wait between streams shows as a difference (see `dppo_model::streams`).

use candle_core::{DType, Device, Tensor};
use dppo_engine::{Completion, Engine, EngineConfig, GenerateRequest};
use dppo_model::streams::own_stream;
use dppo_model::{Policy, Weights};

use super::compare::diff;
use super::Check;
use crate::learner::{Learner, LearnerConfig};
use crate::train_batch::TrainBatch;
use crate::TrainError;

/// Learner steps, each published while a rollout is in flight.
const STEPS: usize = 3;

/// Runs [`STEPS`] steps of the one-step-off loop on `device` with `policy` (on `device`).
pub(super) fn hand_offs(
    policy: &Policy,
    device: &Device,
    reqs: &[GenerateRequest],
    batch: &TrainBatch,
) -> Result<Check, TrainError> {
    let dtype = DType::BF16;
    let cfg = EngineConfig {
        kv_cache_tokens: Some(4096),
        dtype: Some(dtype),
        ..EngineConfig::default()
    };
    let mut learner = Learner::new(
        &policy.config,
        &policy.weights,
        LearnerConfig::token_mean(1e-2, 1.0, 256, 8),
    )?;
    let engine = Engine::new(policy, cfg, own_stream(device)?)?;
    let mut problems = Vec::new();
    for step in 1..=STEPS {
        let in_flight = std::thread::scope(|scope| {
            let rollout = scope.spawn(|| engine.generate(reqs.to_vec()));
            let published = learner
                .step(batch)
                .and_then(|_| Ok(engine.publish(&learner.weights()?.deep_copy()?)?));
            let rollout = rollout
                .join()
                .map_err(|_| TrainError::Thread("the rollout thread panicked".into()))?;
            published?;
            Ok::<_, TrainError>(rollout?)
        })?;
        if in_flight.iter().flatten().count() != reqs.len() {
            problems.push(format!("step {step}: the rollout in flight lost requests"));
        }
        let weights = learner.weights()?;
        let cast_diff = max_diff(&engine.published_weights(), &weights.to_dtype(dtype)?)?;
        if cast_diff != 0.0 {
            problems.push(format!(
                "step {step}: engine weights differ from the learner's by up to {cast_diff:e}"
            ));
        }
        let fresh_policy = Policy {
            weights: weights.deep_copy()?,
            ..policy.clone()
        };
        let fresh = Engine::new(&fresh_policy, cfg, own_stream(device)?)?;
        let want = flat(fresh.generate(reqs.to_vec())?);
        let got = flat(engine.generate(reqs.to_vec())?);
        if want != got {
            problems.push(format!(
                "step {step}: the published engine generates other tokens or logprobs than a \
                 fresh one"
            ));
        }
    }
    Ok(Check::expect(
        problems.is_empty(),
        "hand-offs",
        if problems.is_empty() {
            format!(
                "{STEPS} steps published while generating: engine weights and greedy output \
                 equal a fresh engine's"
            )
        } else {
            problems.join("; ")
        },
        "work on two streams was not ordered: report it with `dppo doctor --json`",
    ))
}

/// Token ids and logprob bits of each completion.
fn flat(out: Vec<Vec<Completion>>) -> Vec<(Vec<u32>, Vec<u32>)> {
    out.into_iter()
        .flatten()
        .map(|c| {
            (
                c.token_ids,
                c.logprobs.iter().map(|l| l.to_bits()).collect(),
            )
        })
        .collect()
}

/// The largest |difference| between same-named tensors of `a` and `b`, on the CPU in f32
/// (infinite where one holds a NaN the other does not).
fn max_diff(a: &Weights, b: &Weights) -> Result<f32, TrainError> {
    let mut max = 0f32;
    for (name, x) in a.tensors() {
        let y = &b.tensors()[name];
        let host = |t: &Tensor| {
            let t = t.to_device(&Device::Cpu)?.to_dtype(DType::F32)?;
            t.flatten_all()?.to_vec1::<f32>()
        };
        let (x, y) = (host(x)?, host(y)?);
        if x.len() != y.len() {
            return Ok(f32::INFINITY);
        }
        max = x.iter().zip(&y).fold(max, |m, (&p, &q)| m.max(diff(p, q)));
    }
    Ok(max)
}
