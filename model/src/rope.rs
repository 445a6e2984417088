//! Rotary position embeddings in the HF "rotate half" layout (fused on the CPU, see
//! [`crate::fused`]).

use std::cell::OnceCell;

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

    /// The angles of `positions` (tokens,) u32, one per token for all heads, looked up once
    /// per forward pass and shared by every layer's q and k (and the training layers): on a
    /// GPU, four ops a pass instead of four per rotation.
    pub fn at(&self, positions: &Tensor) -> Result<RopeAt> {
        Ok(RopeAt {
            cos: self.cos.index_select(positions, 0)?,
            sin: self.sin.index_select(positions, 0)?,
            cast: OnceCell::new(),
        })
    }
}

/// Rotary angles of one forward pass's positions, (tokens, head_dim / 2) each, in f32 and
/// cast once to the first other dtype rotated.
#[derive(Debug, Clone)]
pub struct RopeAt {
    cos: Tensor,
    sin: Tensor,
    cast: OnceCell<(Tensor, Tensor)>,
}

impl RopeAt {
    /// Rotates `x` (tokens, heads, head_dim) by the angles in `x`'s dtype.
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        let (cos, sin) = self.tables(x.dtype())?;
        crate::fused::rope(x, &cos, &sin)
    }

    /// The angles' cos and sin, (tokens, head_dim / 2) each, in `dtype`.
    pub fn tables(&self, dtype: DType) -> Result<(Tensor, Tensor)> {
        if dtype == DType::F32 {
            return Ok((self.cos.clone(), self.sin.clone()));
        }
        let cast = || -> Result<(Tensor, Tensor)> {
            Ok((self.cos.to_dtype(dtype)?, self.sin.to_dtype(dtype)?))
        };
        Ok(match self.cast.get() {
            Some((cos, sin)) if cos.dtype() == dtype => (cos.clone(), sin.clone()),
            Some(_) => cast()?,
            None => {
                let tables = cast()?;
                self.cast.get_or_init(|| tables).clone()
            }
        })
    }
}
