//! Rotary position embeddings in the HF "rotate half" layout (fused on the CPU, see
//! [`crate::fused`]).

use candle_core::{DType, Device, Result, Tensor};

/// Precomputed cos/sin tables, indexed by position id.
#[derive(Debug, Clone)]
pub struct Rope {
    /// (max_positions, head_dim / 2)
    cos: Tensor,
    /// (max_positions, head_dim / 2)
    sin: Tensor,
}

impl Rope {
    /// Tables for positions `0..max_positions` with `theta` as base.
    pub fn new(head_dim: usize, theta: f64, max_positions: usize, device: &Device) -> Result<Self> {
        let half = head_dim / 2;
        let inv_freq: Vec<f64> = (0..half)
            .map(|i| 1.0 / theta.powf((2 * i) as f64 / head_dim as f64))
            .collect();
        let mut cos = Vec::with_capacity(max_positions * half);
        let mut sin = Vec::with_capacity(max_positions * half);
        for pos in 0..max_positions {
            for f in &inv_freq {
                let angle = pos as f64 * f;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Ok(Self {
            cos: Tensor::from_vec(cos, (max_positions, half), device)?,
            sin: Tensor::from_vec(sin, (max_positions, half), device)?,
        })
    }

    /// Rotates `x` (tokens, heads, head_dim) by the angles of `positions` (tokens,) u32.
    pub fn apply(&self, x: &Tensor, positions: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        let (cos, sin) = self.tables_at(positions)?;
        let (cos, sin) = if dtype == DType::F32 {
            (cos, sin)
        } else {
            (cos.to_dtype(dtype)?, sin.to_dtype(dtype)?)
        };
        crate::fused::rope(x, &cos, &sin)
    }

    /// The f32 tables (tokens, head_dim / 2) at `positions` (tokens,) u32: one angle per
    /// token, shared by all heads.
    pub fn tables_at(&self, positions: &Tensor) -> Result<(Tensor, Tensor)> {
        Ok((
            self.cos.index_select(positions, 0)?,
            self.sin.index_select(positions, 0)?,
        ))
    }
}
