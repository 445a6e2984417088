//! The training path: packed rows equal separate runs; gradients reach every parameter and
//! agree with finite differences.

use std::collections::BTreeMap;

use candle_core::{DType, Device, Tensor, Var};

use dppo_model::ops::token_logprobs;
use dppo_model::train_layer::LayerGrads;
use dppo_model::{
    Arch, CausalAttention, CausalLm, Grouping, ModelConfig, PackedAttention, PackedRow, Weights,
};

use crate::util::{flat, random_weights, small_config};

const ARCHS: [Arch; 3] = [Arch::Llama, Arch::Qwen2, Arch::Qwen3];

/// Sequences of several lengths drawn from a fixed pattern, ordered so that packed attention
/// makes every kind of call: alone, a batched run of equal lengths, and (`Segments`) a
/// masked segment of four ([`dppo_model::packed::parts`]).
fn sequences(vocab: usize) -> Vec<Vec<u32>> {
    [12usize, 5, 4, 2, 12, 12, 3, 3, 7]
        .iter()
        .enumerate()
        .map(|(s, &len)| {
            (0..len)
                .map(|i| ((i * 7 + s * 13 + 5) % vocab) as u32)
                .collect()
        })
        .collect()
}

/// How a packed row's layers run: op by op with the attention grouped by `Grouping`, or
/// as the CPU's training layers.
#[derive(Debug, Clone, Copy)]
enum Path {
    Ops(Grouping),
    TrainingLayers,
}

const PATHS: [Path; 3] = [
    Path::Ops(Grouping::Runs),
    Path::Ops(Grouping::Segments),
    Path::TrainingLayers,
];

/// Per-token logprobs of each next token, one sequence alone.
fn alone_logprobs(model: &CausalLm, seq: &[u32]) -> Tensor {
    let n = seq.len();
    let ids = Tensor::new(seq, &Device::Cpu).unwrap();
    let pos = Tensor::arange(0u32, n as u32, &Device::Cpu).unwrap();
    let hidden = model.forward(&ids, &pos, &mut CausalAttention).unwrap();
    let logits = model.logits(&hidden.narrow(0, 0, n - 1).unwrap()).unwrap();
    token_logprobs(&logits, &ids.narrow(0, 1, n - 1).unwrap()).unwrap()
}

/// Per-token logprobs of each next token of every sequence, from one packed row through the
/// training path (the fused lm-head, which never holds the logits whole); `alone_logprobs`
/// takes the composite one.
fn packed_logprobs(model: &CausalLm, seqs: &[Vec<u32>], grouping: Grouping) -> Vec<Tensor> {
    let refs: Vec<&[u32]> = seqs.iter().map(|s| s.as_slice()).collect();
    let row = PackedRow::new(&refs, &Device::Cpu).unwrap();
    let mut attention = PackedAttention::new(row.cu_seqlens.clone(), Some(grouping));
    let hidden = model
        .forward(&row.input_ids, &row.positions, &mut attention)
        .unwrap();
    row.cu_seqlens
        .windows(2)
        .map(|w| {
            let (start, len) = (w[0], w[1] - w[0]);
            let h = hidden.narrow(0, start, len - 1).unwrap();
            let targets = row.input_ids.narrow(0, start + 1, len - 1).unwrap();
            model.token_stats(&h, &targets).unwrap().logprobs
        })
        .collect()
}

fn trainable(cfg: &ModelConfig, seed: u64) -> (BTreeMap<String, Var>, CausalLm) {
    let (vars, weights) = random_weights(cfg, seed).to_vars().unwrap();
    (vars, CausalLm::new(cfg, &weights).unwrap())
}

/// A scalar loss with a distinct coefficient per token, so that no gradient can cancel.
fn weighted_sum(logprobs: &[Tensor]) -> Tensor {
    let mut total = Tensor::new(0f32, &Device::Cpu).unwrap();
    for (s, lp) in logprobs.iter().enumerate() {
        let n = lp.dim(0).unwrap();
        let coef: Vec<f32> = (0..n).map(|i| 1.0 + 0.1 * (i + s) as f32).collect();
        let coef = Tensor::from_vec(coef, n, &Device::Cpu)
            .unwrap()
            .to_dtype(lp.dtype())
            .unwrap();
        total = (total.to_dtype(lp.dtype()).unwrap() + (lp * coef).unwrap().sum_all().unwrap())
            .unwrap();
    }
    total
}

#[test]
fn packed_logprobs_equal_each_sequence_alone() {
    for arch in ARCHS {
        let cfg = small_config(arch);
        let model = CausalLm::new(&cfg, &random_weights(&cfg, 1)).unwrap();
        let seqs = sequences(cfg.vocab_size);
        for grouping in [Grouping::Runs, Grouping::Segments] {
            for (packed, seq) in packed_logprobs(&model, &seqs, grouping).iter().zip(&seqs) {
                assert_close!(flat(packed), flat(&alone_logprobs(&model, seq)), 1e-5);
            }
        }
    }
}

/// The gradient of every var of [`weighted_sum`] over one packed row, through `path` (the
/// training layers' weights' gradients come from their own store); panics naming a var
/// that gets none.
fn packed_gradients(
    vars: &BTreeMap<String, Var>,
    model: &CausalLm,
    seqs: &[Vec<u32>],
    path: Path,
) -> BTreeMap<String, Vec<f32>> {
    let layer_grads = LayerGrads::new();
    let (model, grouping) = match path {
        Path::Ops(grouping) => (model.clone(), grouping),
        Path::TrainingLayers => (model.with_layer_grads(layer_grads.clone()), Grouping::Runs),
    };
    let store = weighted_sum(&packed_logprobs(&model, seqs, grouping))
        .backward()
        .unwrap();
    let grads = vars
        .iter()
        .map(|(name, var)| {
            let g = match layer_grads.take(var.as_tensor()).unwrap() {
                Some(g) => g,
                None => store
                    .get(var)
                    .unwrap_or_else(|| panic!("{name}: no gradient (dropped by an op?)"))
                    .clone(),
            };
            (name.clone(), flat(&g))
        })
        .collect();
    assert!(layer_grads.is_empty(), "a layer gradient belongs to no var");
    grads
}

#[test]
fn packed_gradients_equal_separate_runs() {
    for arch in ARCHS {
        let cfg = small_config(arch);
        let seqs = sequences(cfg.vocab_size);
        let (vars_s, model_s) = trainable(&cfg, 2);
        let alone: Vec<Tensor> = seqs.iter().map(|s| alone_logprobs(&model_s, s)).collect();
        let grads_s = weighted_sum(&alone).backward().unwrap();
        for path in PATHS {
            let (vars_p, model_p) = trainable(&cfg, 2);
            let grads_p = packed_gradients(&vars_p, &model_p, &seqs, path);
            for (name, gp) in grads_p {
                let gs = flat(grads_s.get(&vars_s[&name]).unwrap());
                let scale = gs.iter().fold(1f32, |m, x| m.max(x.abs()));
                assert_close!(gp, gs, 2e-5 * scale);
            }
        }
    }
}

#[test]
fn every_parameter_gets_a_nonzero_gradient() {
    for arch in ARCHS {
        let cfg = small_config(arch);
        let (vars, model) = trainable(&cfg, 3);
        assert_eq!(vars.len(), dppo_model::weights::param_specs(&cfg).len());
        for path in PATHS {
            let seqs = sequences(cfg.vocab_size);
            for (name, g) in packed_gradients(&vars, &model, &seqs, path) {
                let norm: f32 = g.iter().map(|x| x * x).sum();
                assert!(norm > 0.0, "{arch:?} {path:?} {name}: gradient is zero");
            }
        }
    }
}

#[test]
fn gradient_matches_finite_differences() {
    let cases = ARCHS
        .iter()
        .flat_map(|&arch| [(arch, Grouping::Runs), (arch, Grouping::Segments)]);
    for (arch, grouping) in cases {
        let cfg = small_config(arch);
        let seqs = sequences(cfg.vocab_size);
        // f64 throughout, so that central differences are accurate to ~1e-9.
        let base = random_weights(&cfg, 4).to_dtype(DType::F64).unwrap();
        let loss_at = |weights: &Weights| {
            let model = CausalLm::new(&cfg, weights).unwrap();
            weighted_sum(&packed_logprobs(&model, &seqs, grouping))
        };
        let (vars, weights) = base.to_vars().unwrap();
        let grads = loss_at(&weights).backward().unwrap();
        // One coordinate of every parameter tensor, chosen deterministically.
        for (k, (name, var)) in vars.iter().enumerate() {
            let idx = (k * 7919 + 13) % var.elem_count();
            let analytic = grads
                .get(var)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap()[idx];
            let shifted = |delta: f64| {
                let mut tensors = base.tensors().clone();
                let mut v = tensors[name]
                    .flatten_all()
                    .unwrap()
                    .to_vec1::<f64>()
                    .unwrap();
                v[idx] += delta;
                let t = Tensor::from_vec(v, var.shape(), &Device::Cpu).unwrap();
                tensors.insert(name.clone(), t);
                let w = Weights::from_tensors(&cfg, tensors, "fd").unwrap();
                loss_at(&w).to_scalar::<f64>().unwrap()
            };
            let h = 1e-5;
            let numeric = (shifted(h) - shifted(-h)) / (2.0 * h);
            let tol = 1e-7 + 1e-5 * analytic.abs().max(numeric.abs());
            assert!(
                (analytic - numeric).abs() <= tol,
                "{arch:?} {grouping:?} {name}[{idx}]: autograd {analytic}, finite differences {numeric}"
            );
        }
    }
}

/// On a GPU each recorded op is a launch (and its backward more): a row of sequences of
/// distinct lengths takes one masked call a layer under `Segments` instead of one a
/// sequence, so its graph records fewer ops; the values are those of the runs (above).
#[test]
fn segments_record_fewer_ops_than_runs_for_distinct_lengths() {
    let cfg = small_config(Arch::Qwen2);
    let (_, model) = trainable(&cfg, 5);
    let seqs: Vec<Vec<u32>> = [9usize, 7, 5, 3]
        .iter()
        .map(|&len| (0..len as u32).map(|i| i % cfg.vocab_size as u32).collect())
        .collect();
    let nodes = |grouping| {
        weighted_sum(&packed_logprobs(&model, &seqs, grouping))
            .sorted_nodes()
            .len()
    };
    let (runs, segments) = (nodes(Grouping::Runs), nodes(Grouping::Segments));
    assert!(segments < runs, "segments {segments} ops, runs {runs}");
}
