//! Fused projections for inference: each layer's q, k and v weights (and biases) as one
//! concatenated tensor, and gate and up likewise, so that a forward pass runs one GEMM where
//! it ran three (two). The parts stay in [`Weights::tensors`] under their HF names as views
//! of the concatenation: writing a part (a publication) writes the fused tensor, and no
//! separate copy is kept.

use candle_core::Tensor;

use super::Weights;
use crate::Result;

/// The parts of each fused tensor: (fused suffix, part suffixes), per layer.
const GROUPS: [(&str, &[&str]); 3] = [
    (
        "self_attn.qkv_proj.weight",
        &[
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
        ],
    ),
    (
        "self_attn.qkv_proj.bias",
        &[
            "self_attn.q_proj.bias",
            "self_attn.k_proj.bias",
            "self_attn.v_proj.bias",
        ],
    ),
    (
        "mlp.gate_up_proj.weight",
        &["mlp.gate_proj.weight", "mlp.up_proj.weight"],
    ),
];

impl Weights {
    /// The same weights with every layer's q/k/v and gate/up concatenated along their
    /// output dimension (one copy, made here), the parts becoming views of it.
    pub fn fuse_projections(&self) -> Result<Self> {
        let mut out = self.clone();
        let layers = self
            .tensors
            .keys()
            .filter_map(|n| n.strip_prefix("model.layers."))
            .filter_map(|rest| rest.split('.').next()?.parse::<usize>().ok())
            .max()
            .map_or(0, |l| l + 1);
        for layer in 0..layers {
            let prefix = format!("model.layers.{layer}");
            for (fused, parts) in GROUPS {
                let names: Vec<String> = parts.iter().map(|p| format!("{prefix}.{p}")).collect();
                let Some(tensors) = names
                    .iter()
                    .map(|n| self.tensors.get(n))
                    .collect::<Option<Vec<&Tensor>>>()
                else {
                    continue;
                };
                let whole = Tensor::cat(&tensors, 0)?;
                let mut offset = 0;
                for (name, t) in names.iter().zip(&tensors) {
                    let len = t.dim(0)?;
                    out.tensors
                        .insert(name.clone(), whole.narrow(0, offset, len)?);
                    offset += len;
                }
                out.fused.insert(format!("{prefix}.{fused}"), whole);
            }
        }
        Ok(out)
    }

    /// The fused tensor `name` (`model.layers.N.self_attn.qkv_proj.weight`,
    /// `...qkv_proj.bias`, `model.layers.N.mlp.gate_up_proj.weight`), if fused.
    pub fn fused(&self, name: &str) -> Option<&Tensor> {
        self.fused.get(name)
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device};

    use crate::presets::load_preset;
    use crate::streams::copy_into;

    #[test]
    fn parts_are_views_of_the_fused_tensor_and_writes_reach_it() {
        let tiny = load_preset("tiny", &Device::Cpu).unwrap();
        let fused = tiny.weights.fuse_projections().unwrap();
        let qkv = fused
            .fused("model.layers.0.self_attn.qkv_proj.weight")
            .unwrap();
        let q = &fused.tensors()["model.layers.0.self_attn.q_proj.weight"];
        let v = &fused.tensors()["model.layers.0.self_attn.v_proj.weight"];
        let (q_rows, v_rows) = (q.dim(0).unwrap(), v.dim(0).unwrap());
        assert_eq!(
            qkv.narrow(0, 0, q_rows).unwrap().to_vec2::<f32>().unwrap(),
            tiny.weights.tensors()["model.layers.0.self_attn.q_proj.weight"]
                .to_vec2::<f32>()
                .unwrap()
        );
        // A publication writes the parts by name: the fused tensor sees it.
        copy_into(v, &v.ones_like().unwrap()).unwrap();
        let tail = qkv.narrow(0, qkv.dim(0).unwrap() - v_rows, v_rows).unwrap();
        assert!(tail
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .all(|&x| x == 1.0));
        // Buffers made from fused weights are fused alike.
        let buffers = fused.to_dtype(DType::F64).unwrap().zeros_like().unwrap();
        assert!(buffers
            .fused("model.layers.1.mlp.gate_up_proj.weight")
            .is_some());
    }
}
