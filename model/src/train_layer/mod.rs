//! The decoder layer as one op with a hand-written backward pass, for training on the CPU.
//!
//! Through candle's autograd a layer is some twenty ops, and every gradient that reaches a
//! tensor is added onto a fresh zero tensor of its size, then onto the sum so far: on
//! SmolLM2-135M the backward pass spent as long allocating, zeroing and adding as in its
//! matmuls. Here a layer is one node of the graph: its forward keeps what its backward
//! needs ([`pass::Saved`]), its backward computes every gradient directly, and the weights'
//! gradients are added in place onto buffers that live for the whole step
//! ([`LayerGrads`]), across the packed buffers of the step. The learner takes them from
//! there; the rest of the model (embedding, final norm, lm-head) keeps candle's autograd.
//!
//! It applies to f32 CPU training on packed rows; other devices and dtypes, and inference,
//! run the layer op by op. The two paths compute the same function: the tests compare
//! their values and gradients, and the gradients with f64 finite differences.

mod attention;
mod matmul;
mod pass;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{bail, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Storage, Tensor};

use crate::config::ModelConfig;
use attention::Heads;
use pass::{Dims, Packed, Saved, Weights};

/// The weights of a decoder layer, in the order of [`LayerParams`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Param {
    InNorm,
    Q,
    K,
    V,
    O,
    PostNorm,
    Gate,
    Up,
    Down,
    QBias,
    KBias,
    VBias,
    OBias,
    QNorm,
    KNorm,
}

impl Param {
    pub const COUNT: usize = 15;
}

/// A layer's weight tensors indexed by [`Param`], `None` where the model has no such
/// weight (biases, Qwen3's q/k norms).
pub(crate) struct LayerParams(pub [Option<Tensor>; Param::COUNT]);

/// Gradients of the decoder layers' weights, summed in place over a step's packed buffers
/// by the training layer's backward pass; keyed by the weight tensor they belong to. Clones
/// share one store.
#[derive(Debug, Default, Clone)]
pub struct LayerGrads {
    grads: Arc<Mutex<HashMap<candle_core::TensorId, Vec<f32>>>>,
}

impl LayerGrads {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Runs `f` on the gradient of `weight` (zeros until something is added).
    fn add(&self, weight: &Tensor, f: &mut dyn FnMut(&mut [f32])) {
        let mut grads = self.grads.lock().unwrap_or_else(|e| e.into_inner());
        let grad = grads
            .entry(weight.id())
            .or_insert_with(|| vec![0f32; weight.elem_count()]);
        f(grad);
    }

    /// How many gradients the store holds.
    pub fn len(&self) -> usize {
        self.grads.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    /// Whether the store holds no gradient.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The gradient summed for `weight`, shaped like it, removed from the store; `None`
    /// when no backward pass reached it.
    pub fn take(&self, weight: &Tensor) -> Result<Option<Tensor>> {
        let grad = self
            .grads
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&weight.id());
        grad.map(|g| Tensor::from_vec(g, weight.shape(), weight.device()))
            .transpose()
    }
}

/// What every layer of one forward pass shares: the layers' sizes, the packed row's
/// sequences, the rotation tables at its positions and where the weights' gradients go.
pub(crate) struct TrainPass {
    dims: Dims,
    cu_seqlens: Vec<usize>,
    /// (tokens, head_dim / 2) each.
    cos: Tensor,
    sin: Tensor,
    grads: LayerGrads,
}

impl TrainPass {
    /// The pass of a model with config `cfg` over a packed row of `cu_seqlens`, with the
    /// rotation tables `cos`, `sin` at its positions.
    pub fn new(
        cfg: &ModelConfig,
        cu_seqlens: Vec<usize>,
        (cos, sin): (Tensor, Tensor),
        grads: LayerGrads,
    ) -> Self {
        let dims = Dims {
            hidden: cfg.hidden_size,
            inter: cfg.intermediate_size,
            heads: Heads {
                heads: cfg.num_attention_heads,
                kv_heads: cfg.num_key_value_heads,
                head_dim: cfg.head_dim,
            },
            eps: cfg.rms_norm_eps,
        };
        Self {
            dims,
            cu_seqlens,
            cos,
            sin,
            grads,
        }
    }

    /// Whether the training layer applies: f32 activations and weights on the CPU, and an
    /// even head dimension (rope rotates halves).
    pub fn applies(&self, x: &Tensor, params: &LayerParams) -> bool {
        let f32_cpu = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32;
        f32_cpu(x)
            && x.rank() == 2
            && self.dims.heads.head_dim.is_multiple_of(2)
            && params.0.iter().flatten().all(f32_cpu)
    }

    /// The layer with weights `params` applied to `x` (tokens, hidden), as one op whose
    /// backward adds the weights' gradients to the pass's [`LayerGrads`].
    pub fn layer(&self, x: &Tensor, params: LayerParams) -> Result<Tensor> {
        let op = LayerOp {
            params: params.0,
            dims: self.dims,
            cu_seqlens: self.cu_seqlens.clone(),
            cos: self.cos.clone(),
            sin: self.sin.clone(),
            grads: self.grads.clone(),
            saved: Mutex::new(None),
        };
        x.contiguous()?.apply_op1(op)
    }
}

/// One layer of one forward pass; holds what its backward pass needs until it runs.
struct LayerOp {
    params: [Option<Tensor>; Param::COUNT],
    dims: Dims,
    cu_seqlens: Vec<usize>,
    cos: Tensor,
    sin: Tensor,
    grads: LayerGrads,
    saved: Mutex<Option<Saved>>,
}

/// Runs `f` on the f32 data of `tensors` (contiguous CPU tensors, each `None` stays
/// `None`), holding their storage for the call.
fn with_data<R>(
    tensors: &[Option<&Tensor>],
    f: impl FnOnce(&[Option<&[f32]>]) -> Result<R>,
) -> Result<R> {
    let guards: Vec<_> = tensors
        .iter()
        .map(|t| t.map(|t| t.storage_and_layout()))
        .collect();
    let mut data = Vec::with_capacity(guards.len());
    for guard in &guards {
        data.push(match guard {
            None => None,
            Some((storage, layout)) => {
                let Storage::Cpu(CpuStorage::F32(values)) = &**storage else {
                    bail!("training layer: operands must be f32 on the CPU");
                };
                let Some((start, end)) = layout.contiguous_offsets() else {
                    bail!("training layer: operands must be contiguous");
                };
                Some(&values[start..end])
            }
        });
    }
    f(&data)
}

impl LayerOp {
    /// The weights, then the rotation tables, as one list for [`with_data`].
    fn operands(&self) -> Vec<Option<&Tensor>> {
        let mut all: Vec<Option<&Tensor>> = self.params.iter().map(Option::as_ref).collect();
        all.extend([Some(&self.cos), Some(&self.sin)]);
        all
    }

    /// Splits [`LayerOp::operands`]' data into the weights and the packed row.
    fn split<'a>(&'a self, data: &[Option<&'a [f32]>]) -> (Weights<'a>, Packed<'a>) {
        let weights = Weights(std::array::from_fn(|i| data[i]));
        let table = |i: usize| data[i].expect("rotation tables are present");
        let row = Packed {
            cu_seqlens: &self.cu_seqlens,
            cos: table(Param::COUNT),
            sin: table(Param::COUNT + 1),
        };
        (weights, row)
    }
}

impl CustomOp1 for LayerOp {
    fn name(&self) -> &'static str {
        "dppo-train-layer"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(values) = storage else {
            bail!("training layer: x must be f32");
        };
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("training layer: x must be contiguous");
        };
        let tokens = layout.shape().dims2()?.0;
        if self.cu_seqlens.last() != Some(&tokens) {
            bail!(
                "training layer: {tokens} tokens but the sequences span {:?}",
                self.cu_seqlens.last()
            );
        }
        let (y, saved) = with_data(&self.operands(), |data| {
            let (weights, row) = self.split(data);
            pass::forward(&self.dims, &weights, &values[start..end], &row)
        })?;
        *self.saved.lock().unwrap_or_else(|e| e.into_inner()) = Some(saved);
        Ok((CpuStorage::F32(y), layout.shape().clone()))
    }

    fn bwd(&self, x: &Tensor, _y: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let Some(saved) = self.saved.lock().unwrap_or_else(|e| e.into_inner()).take() else {
            bail!("training layer: its backward pass ran twice or before its forward");
        };
        let grad = grad.contiguous()?;
        let mut operands = self.operands();
        operands.extend([Some(x), Some(&grad)]);
        let dx = with_data(&operands, |data| {
            let (weights, row) = self.split(data);
            let (x, dy) = (data[Param::COUNT + 2], data[Param::COUNT + 3]);
            let sink = |p: Param, f: &mut dyn FnMut(&mut [f32])| {
                let weight = self.params[p as usize]
                    .as_ref()
                    .expect("gradients go to weights the layer has");
                self.grads.add(weight, f);
            };
            Ok(pass::backward(
                &self.dims,
                &weights,
                x.expect("x is present"),
                saved,
                dy.expect("the gradient is present"),
                &row,
                &sink,
            ))
        })?;
        Ok(Some(Tensor::from_vec(dx, x.shape(), x.device())?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::packed::PackedRow;
    use crate::weights::Weights as ModelWeights;
    use crate::CausalLm;
    use candle_core::{Device, Var};
    use std::collections::BTreeMap;

    /// Small models covering every weight the training layer handles: Qwen3 (q/k norms,
    /// grouped kv heads), Qwen2 (q/k/v biases, here with an o bias too) and Llama (none,
    /// one kv head per query head).
    fn configs() -> Vec<ModelConfig> {
        let tiny = crate::presets::load_preset("tiny", &Device::Cpu)
            .unwrap()
            .config;
        let small = ModelConfig {
            hidden_size: 16,
            intermediate_size: 24,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 4,
            ..tiny
        };
        vec![
            small.clone(),
            ModelConfig {
                qk_norm: false,
                qkv_bias: true,
                o_bias: true,
                ..small.clone()
            },
            ModelConfig {
                qk_norm: false,
                num_key_value_heads: 4,
                ..small
            },
        ]
    }

    /// A packed row of three sequences of different lengths.
    fn row() -> PackedRow {
        let seqs: [&[u32]; 3] = [&[5, 9, 2, 7, 1], &[3, 3, 8], &[4, 1, 6, 2, 9, 5, 7]];
        PackedRow::new(&seqs, &Device::Cpu).unwrap()
    }

    /// `sum(hidden * probe)`, a fixed weighting of every final hidden state.
    fn objective(hidden: &Tensor) -> Tensor {
        let n = hidden.elem_count();
        let probe: Vec<f64> = (0..n)
            .map(|i| ((i * 7919) % 1000) as f64 / 500.0 - 1.0)
            .collect();
        let probe = Tensor::from_vec(probe, hidden.shape(), hidden.device()).unwrap();
        let probe = probe.to_dtype(hidden.dtype()).unwrap();
        (hidden * &probe).unwrap().sum_all().unwrap()
    }

    /// The final hidden states and the gradients of [`objective`] of every var, through
    /// the op-by-op layers (`fused` false) or the training layers.
    fn run(
        config: &ModelConfig,
        vars: &BTreeMap<String, Var>,
        fused: bool,
    ) -> (Vec<f32>, BTreeMap<String, Vec<f32>>) {
        let tensors = vars
            .iter()
            .map(|(n, v)| (n.clone(), v.as_tensor().clone()))
            .collect();
        let weights = ModelWeights::from_tensors(config, tensors, "test").unwrap();
        let model = CausalLm::new(config, &weights).unwrap();
        let layer_grads = LayerGrads::new();
        let model = if fused {
            model.with_layer_grads(layer_grads.clone())
        } else {
            model
        };
        let row = row();
        let hidden = model
            .forward(&row.input_ids, &row.positions, &mut row.attention())
            .unwrap();
        let store = objective(&hidden).backward().unwrap();
        let flat = |t: &Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let grads: BTreeMap<String, Vec<f32>> = vars
            .iter()
            .map(|(name, var)| {
                let in_layer = name.contains(".layers.");
                let g = match (store.get(var), layer_grads.take(var.as_tensor()).unwrap()) {
                    (Some(g), None) => {
                        assert!(!(fused && in_layer), "{name}: left to candle's autograd");
                        g.clone()
                    }
                    (None, Some(g)) => {
                        assert!(fused && in_layer, "{name}: from the training layers");
                        g
                    }
                    (Some(_), Some(_)) => panic!("{name}: gradients from both paths"),
                    (None, None) => panic!("{name}: no gradient"),
                };
                (name.clone(), flat(&g))
            })
            .collect();
        assert!(layer_grads.is_empty(), "every gradient belongs to a var");
        (flat(&hidden), grads)
    }

    /// `|a - b| / |b|` over whole vectors.
    fn relative(a: &[f32], b: &[f32]) -> f64 {
        let diff: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        let norm: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
        (diff / norm).sqrt()
    }

    fn vars_of(config: &ModelConfig, seed: u64) -> BTreeMap<String, Var> {
        let weights = ModelWeights::random(config, 0.3, seed, &Device::Cpu).unwrap();
        weights.to_vars().unwrap().0
    }

    #[test]
    fn training_layers_match_the_op_by_op_layers_in_values_and_gradients() {
        for config in configs() {
            let vars = vars_of(&config, 1);
            let (want_h, want_g) = run(&config, &vars, false);
            let (got_h, got_g) = run(&config, &vars, true);
            assert!(relative(&got_h, &want_h) < 1e-6, "hidden states");
            for (name, want) in &want_g {
                let err = relative(&got_g[name], want);
                assert!(err < 1e-5, "{name}: relative error {err}");
                assert!(want.iter().any(|&g| g != 0.0), "{name}: zero gradient");
            }
        }
    }

    /// Every gradient of the training layers (and, through the embedding, of their input)
    /// against f64 central finite differences of the op-by-op model in f64.
    #[test]
    fn training_layer_gradients_match_f64_finite_differences() {
        for config in configs() {
            let vars = vars_of(&config, 2);
            let (_, grads) = run(&config, &vars, true);
            let base: BTreeMap<String, Tensor> = vars
                .iter()
                .map(|(n, v)| (n.clone(), v.as_tensor().to_dtype(DType::F64).unwrap()))
                .collect();
            let objective_at = |name: &str, index: usize, delta: f64| -> f64 {
                let mut tensors = base.clone();
                let t = &tensors[name];
                let mut values = t.flatten_all().unwrap().to_vec1::<f64>().unwrap();
                values[index] += delta;
                let moved = Tensor::from_vec(values, t.shape(), t.device()).unwrap();
                tensors.insert(name.to_string(), moved);
                let weights = ModelWeights::from_tensors(&config, tensors, "fd").unwrap();
                let model = CausalLm::new(&config, &weights).unwrap();
                let row = row();
                let hidden = model
                    .forward(&row.input_ids, &row.positions, &mut row.attention())
                    .unwrap();
                objective(&hidden).to_scalar::<f64>().unwrap()
            };
            for (name, grad) in &grads {
                let scale = grad.iter().fold(0f64, |m, g| m.max(g.abs() as f64));
                // A spread of elements of every tensor, its first and last included.
                let n = grad.len();
                for index in [0, n / 3, n / 2, 2 * n / 3 + 1, n - 1] {
                    let index = index.min(n - 1);
                    let h = 1e-4;
                    let fd =
                        (objective_at(name, index, h) - objective_at(name, index, -h)) / (2.0 * h);
                    let got = grad[index] as f64;
                    assert!(
                        (got - fd).abs() <= 1e-3 * scale + 1e-6,
                        "{name}[{index}]: {got} vs finite difference {fd} (scale {scale})"
                    );
                }
            }
        }
    }
}
