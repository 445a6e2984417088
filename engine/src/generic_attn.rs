//! The device-generic attention backend, made only of candle tensor ops that every backend
//! (CUDA included) implements: the KV pool is one tensor per layer on the engine's device,
//! new K/V are written by slot index (`scatter_set`, in place), and each query reads its
//! sequence's keys through the block table (`index_select`) in one padded, masked
//! attention. The CPU runs it when forced (tests) or for dtypes its kernel lacks.

use candle_core::{DType, Device, Result, Tensor};
use dppo_model::attention::repeat_kv;
use dppo_model::fused::inference::softmax_last_dim;
use dppo_model::ops::at_least_f32;
use dppo_model::AttentionBackend;

use crate::kv_pool::BlockCopy;
use crate::paged_attn::{CacheShape, SeqAttnMeta};

/// K and V of every layer as device tensors: `k[layer]` is (slots, kv_heads * head_dim).
#[derive(Debug)]
pub struct TensorKvCache {
    shape: CacheShape,
    k: Vec<Tensor>,
    v: Vec<Tensor>,
}

impl TensorKvCache {
    /// Zeroed storage for `shape` in `dtype` on `device`, allocated once.
    pub fn new(shape: CacheShape, dtype: DType, device: &Device) -> Result<Self> {
        let dims = (shape.num_blocks * shape.block_size, shape.slot_len());
        let zeros = || -> Result<Vec<Tensor>> {
            (0..shape.num_layers)
                .map(|_| Tensor::zeros(dims, dtype, device))
                .collect()
        };
        Ok(Self {
            shape,
            k: zeros()?,
            v: zeros()?,
        })
    }

    /// The cache's shape.
    pub fn shape(&self) -> CacheShape {
        self.shape
    }

    /// A one-layer cache holding `k` and `v` ((slots, kv_heads * head_dim) each) in `dtype`.
    #[cfg(feature = "cuda")]
    pub(crate) fn from_host(
        shape: CacheShape,
        (k, v): (&[f32], &[f32]),
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let dims = (shape.num_blocks * shape.block_size, shape.slot_len());
        let tensor = |x: &[f32]| Tensor::from_slice(x, dims, device)?.to_dtype(dtype);
        Ok(Self {
            shape,
            k: vec![tensor(k)?],
            v: vec![tensor(v)?],
        })
    }

    /// Layer `i`'s K and V pool tensors, written in place by the CUDA backend (and by its
    /// emulation in the engine's unit tests).
    #[cfg(any(feature = "cuda", all(test, target_os = "linux")))]
    pub(crate) fn layer(&self, i: usize) -> (&Tensor, &Tensor) {
        (&self.k[i], &self.v[i])
    }

    /// Carries out copy-on-write orders in every layer (a gather of the source slots, then
    /// a scatter into the destination slots; a destination is never another's source).
    pub fn copy_blocks(&mut self, copies: &[BlockCopy]) -> Result<()> {
        let bs = self.shape.block_size;
        let (mut src, mut dst) = (Vec::new(), Vec::new());
        for c in copies {
            for i in 0..c.num_tokens {
                src.push((c.src as usize * bs + i) as u32);
                dst.push((c.dst as usize * bs + i) as u32);
            }
        }
        if src.is_empty() {
            return Ok(());
        }
        let device = self.k[0].device().clone();
        let src = Tensor::from_vec(src, dst.len(), &device)?;
        let dst = slot_index(&dst, self.shape.slot_len(), &device)?;
        for layer in self.k.iter().chain(&self.v) {
            layer.scatter_set(&dst, &layer.index_select(&src, 0)?, 0)?;
        }
        Ok(())
    }
}

/// A scatter index (slots.len(), row) whose row `i` is all `slots[i]`: `scatter_set` wants
/// one index per element written.
fn slot_index(slots: &[u32], row: usize, device: &Device) -> Result<Tensor> {
    Tensor::from_slice(slots, (slots.len(), 1), device)?
        .broadcast_as((slots.len(), row))?
        .contiguous()
}

/// Sequences attended together: `num_seqs` queries blocks of `q_len` rows over `k_len`
/// keys each, padded to the longest.
#[derive(Debug)]
struct Group {
    num_seqs: usize,
    q_len: usize,
    k_len: usize,
    /// (num_seqs * q_len,) batch rows of the queries (padding repeats a real row).
    q_rows: Tensor,
    /// (num_seqs * k_len,) cache slots of the keys (padding repeats a real slot).
    kv_slots: Tensor,
    /// (num_seqs, 1, q_len, k_len) f32: 0 where the query sees the key, -inf elsewhere.
    mask: Tensor,
}

/// The index tensors of one iteration, built once and shared by every layer.
#[derive(Debug)]
pub struct BatchIndex {
    /// (tokens, row) scatter index of the new tokens' slots.
    write: Tensor,
    groups: Vec<Group>,
    /// (tokens,) row of each batch token in the groups' concatenated outputs.
    out_rows: Tensor,
}

impl BatchIndex {
    /// Decoding sequences (one new token) attend as one group; every sequence with several
    /// new tokens attends alone, so that padding never multiplies a long prefill.
    pub fn new(
        seqs: &[SeqAttnMeta],
        slot_mapping: &[usize],
        shape: CacheShape,
        device: &Device,
    ) -> Result<Self> {
        let slots: Vec<u32> = slot_mapping.iter().map(|&s| s as u32).collect();
        let write = slot_index(&slots, shape.slot_len(), device)?;
        let (decodes, prefills): (Vec<&SeqAttnMeta>, Vec<&SeqAttnMeta>) =
            seqs.iter().partition(|m| m.num_new_tokens == 1);
        let mut members: Vec<Vec<&SeqAttnMeta>> = prefills.into_iter().map(|m| vec![m]).collect();
        if !decodes.is_empty() {
            members.push(decodes);
        }
        let mut out_rows = vec![0u32; slot_mapping.len()];
        let mut offset = 0;
        let mut groups = Vec::with_capacity(members.len());
        for group in members {
            let g = Group::new(&group, shape.block_size, device)?;
            for (s, m) in group.iter().enumerate() {
                for i in 0..m.num_new_tokens {
                    out_rows[m.first_row + i] = (offset + s * g.q_len + i) as u32;
                }
            }
            offset += g.num_seqs * g.q_len;
            groups.push(g);
        }
        Ok(Self {
            write,
            groups,
            out_rows: Tensor::from_vec(out_rows, slot_mapping.len(), device)?,
        })
    }
}

impl BatchIndex {
    /// Bytes of the index tensors and masks, uploaded once per iteration.
    pub fn bytes(&self) -> usize {
        let size = |t: &Tensor| t.elem_count() * t.dtype().size_in_bytes();
        let groups: usize = self
            .groups
            .iter()
            .map(|g| size(&g.q_rows) + size(&g.kv_slots) + size(&g.mask))
            .sum();
        size(&self.write) + size(&self.out_rows) + groups
    }
}

impl Group {
    fn new(seqs: &[&SeqAttnMeta], block_size: usize, device: &Device) -> Result<Self> {
        let q_len = seqs.iter().map(|m| m.num_new_tokens).max().unwrap_or(1);
        let k_len = seqs
            .iter()
            .map(|m| m.num_computed_tokens + m.num_new_tokens)
            .max()
            .unwrap_or(1);
        let (mut q_rows, mut kv_slots) = (Vec::new(), Vec::new());
        let mut mask = Vec::with_capacity(seqs.len() * q_len * k_len);
        for m in seqs {
            let len = m.num_computed_tokens + m.num_new_tokens;
            let slot =
                |j: usize| (m.block_table[j / block_size] as usize * block_size) + j % block_size;
            for i in 0..q_len {
                q_rows.push((m.first_row + i.min(m.num_new_tokens - 1)) as u32);
            }
            for j in 0..k_len {
                kv_slots.push(slot(j.min(len - 1)) as u32);
            }
            for i in 0..q_len {
                // A padding query sees the last key only: its row is discarded, but must
                // not be a softmax over nothing (NaN).
                let last = if i < m.num_new_tokens {
                    m.num_computed_tokens + i
                } else {
                    len - 1
                };
                let first = if i < m.num_new_tokens { 0 } else { last };
                mask.extend((0..k_len).map(|j| {
                    if (first..=last).contains(&j) {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                }));
            }
        }
        let n = seqs.len();
        Ok(Self {
            num_seqs: n,
            q_len,
            k_len,
            q_rows: Tensor::from_vec(q_rows, n * q_len, device)?,
            kv_slots: Tensor::from_vec(kv_slots, n * k_len, device)?,
            mask: Tensor::from_vec(mask, (n, 1, q_len, k_len), device)?,
        })
    }

    /// Attention output (num_seqs * q_len, heads, d) of the group's (padded) queries,
    /// counting in `ops` the tensor ops that move data (views are free).
    fn attend(
        &self,
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        kv_heads: usize,
        ops: &mut u64,
    ) -> Result<Tensor> {
        let (_, num_heads, head_dim) = q.dims3()?;
        let (s, lq, lk) = (self.num_seqs, self.q_len, self.k_len);
        let mut op = |t: Result<Tensor>| {
            *ops += 1;
            t
        };
        // 1. Gather: (s * len, heads, d) -> (s, heads, len, d)
        let split = |x: Tensor, len: usize| {
            x.reshape((s, len, num_heads, head_dim))?
                .transpose(1, 2)?
                .contiguous()
        };
        let q = op(q.index_select(&self.q_rows, 0))?;
        let q = op(split(q, lq))?;
        let mut keys = |cache: &Tensor| -> Result<Tensor> {
            let x =
                op(cache.index_select(&self.kv_slots, 0))?.reshape((s * lk, kv_heads, head_dim))?;
            // Expanding the KV heads copies (a broadcast made contiguous).
            let x = if num_heads > kv_heads {
                op(repeat_kv(&x, num_heads))?
            } else {
                x
            };
            op(split(x, lk))
        };
        let (k, v) = (keys(k_cache)?, keys(v_cache)?);
        // 2. Masked softmax in at least f32 whatever the cache's dtype: (s, heads, lq, lk)
        let scale = 1.0 / (head_dim as f64).sqrt();
        let scores = op(q.matmul(&k.t()?))?;
        let scores = op(scores * scale)?;
        // A 16-bit cache's scores are widened, its probabilities narrowed: two casts.
        let widen = matches!(scores.dtype(), DType::BF16 | DType::F16);
        let scores = if widen {
            op(at_least_f32(&scores))?
        } else {
            scores
        };
        let mask = self.mask.to_dtype(scores.dtype())?;
        let probs = op(scores.broadcast_add(&mask))?;
        let probs = op(softmax_last_dim(&probs))?;
        let probs = if widen {
            op(probs.to_dtype(v.dtype()))?
        } else {
            probs
        };
        // 3. (s, heads, lq, d) -> (s * lq, heads, d), the reshape copying the transpose.
        let out = op(probs.matmul(&v))?;
        op(out.transpose(1, 2)?.reshape((s * lq, num_heads, head_dim)))
    }
}

/// The generic backend over a [`TensorKvCache`] for one iteration.
pub struct GenericPagedAttention<'a> {
    pub cache: &'a mut TensorKvCache,
    pub index: &'a BatchIndex,
    /// Tensor ops that moved data, summed over the layers (see `IterationCost`).
    pub ops: u64,
}

impl AttentionBackend for GenericPagedAttention<'_> {
    fn attend(&mut self, layer_idx: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let tokens = q.dim(0)?;
        let row = self.cache.shape.slot_len();
        // 1. Write the new tokens' K/V into their slots, in place.
        let (kc, vc) = (&self.cache.k[layer_idx], &self.cache.v[layer_idx]);
        kc.scatter_set(
            &self.index.write,
            &k.reshape((tokens, row))?.contiguous()?,
            0,
        )?;
        vc.scatter_set(
            &self.index.write,
            &v.reshape((tokens, row))?.contiguous()?,
            0,
        )?;
        // A copy where the model's K or V rows are a strided view.
        self.ops += 2 + !k.is_contiguous() as u64 + !v.is_contiguous() as u64;
        // 2. Attend group by group, reading K/V through the block tables.
        let kv_heads = self.cache.shape.num_kv_heads;
        let mut outs = Vec::with_capacity(self.index.groups.len());
        for g in &self.index.groups {
            outs.push(g.attend(q, kc, vc, kv_heads, &mut self.ops)?);
        }
        self.ops += 2;
        Tensor::cat(&outs, 0)?.index_select(&self.index.out_rows, 0)
    }
}
