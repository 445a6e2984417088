//! The paged attention kernels' parameter lists, by name, pushed in the order of their
//! signatures in the kernel sources (kernels/paged_attention.cu and the sources joined to it)
//! for both launchers ([`crate::kernel_args`]).
//! Buffers are what the launcher passes (device slices on a GPU, pointers in the emulation);
//! scalars are borrowed from the iteration's [`Scalars`].

use super::KernelPlan;
use crate::kernel_args::ArgList;

/// The scalar arguments of an iteration's launches, from its plan.
pub(crate) struct Scalars {
    num_heads: u32,
    num_kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    table_width: u32,
    split_len: u32,
    splits: u32,
    /// Values of one K (or V) row: KV heads x head_dim.
    kv_row: u32,
    /// The softmax scale, 1 / sqrt(head_dim).
    scale: f32,
}

impl Scalars {
    pub(crate) fn of(plan: &KernelPlan) -> Self {
        let heads = plan.heads;
        Self {
            num_heads: heads.num_heads as u32,
            num_kv_heads: heads.num_kv_heads as u32,
            head_dim: heads.head_dim as u32,
            block_size: plan.block_size as u32,
            table_width: plan.table_width as u32,
            split_len: plan.split_len as u32,
            splits: plan.splits as u32,
            kv_row: (heads.num_kv_heads * heads.head_dim) as u32,
            scale: 1.0 / (heads.head_dim as f32).sqrt(),
        }
    }
}

/// `write_table_entries(table, pairs, n)`: `n` (index, block) pairs into the tables.
pub(crate) struct TableEntries<'s, T, P> {
    pub table: T,
    pub pairs: P,
    pub n: &'s u32,
}

impl<'s, T, P> TableEntries<'s, T, P> {
    pub(crate) fn push_to<L: ArgList<T> + ArgList<P> + ArgList<&'s u32>>(self, list: &mut L) {
        ArgList::push(list, self.table);
        ArgList::push(list, self.pairs);
        ArgList::push(list, self.n);
    }
}

/// `write_slots_<dtype>(src, cache, slots, row)`: each batch row of `src` into its slot.
pub(crate) struct WriteSlots<'s, S, C, U> {
    pub src: S,
    pub cache: C,
    pub slots: U,
    pub scalars: &'s Scalars,
}

impl<'s, S, C, U> WriteSlots<'s, S, C, U> {
    pub(crate) fn push_to<L>(self, list: &mut L)
    where
        L: ArgList<S> + ArgList<C> + ArgList<U> + ArgList<&'s u32>,
    {
        ArgList::push(list, self.src);
        ArgList::push(list, self.cache);
        ArgList::push(list, self.slots);
        ArgList::push(list, &self.scalars.kv_row);
    }
}

/// `copy_slots_<dtype>(cache, pairs, row)`: each (source, destination) slot pair's row copied.
pub(crate) struct CopySlots<'s, C, U> {
    pub cache: C,
    pub pairs: U,
    pub scalars: &'s Scalars,
}

impl<'s, C, U> CopySlots<'s, C, U> {
    pub(crate) fn push_to<L>(self, list: &mut L)
    where
        L: ArgList<C> + ArgList<U> + ArgList<&'s u32>,
    {
        ArgList::push(list, self.cache);
        ArgList::push(list, self.pairs);
        ArgList::push(list, &self.scalars.kv_row);
    }
}

/// `paged_attention_<dtype>(q, k, v, tiles, tables, num_heads, num_kv_heads, head_dim,
/// block_size, table_width, split_len, scale, acc, max, sum, out)`: each split's partial
/// output, or with one split the output itself.
pub(crate) struct Attention<'s, Q, P, U, O, R> {
    pub q: Q,
    pub k: P,
    pub v: P,
    pub tiles: U,
    pub tables: U,
    pub scalars: &'s Scalars,
    pub acc: O,
    pub max: O,
    pub sum: O,
    /// Written only where the plan has one split (the partials then are not).
    pub out: R,
}

impl<'s, Q, P, U, O, R> Attention<'s, Q, P, U, O, R> {
    pub(crate) fn push_to<L>(self, list: &mut L)
    where
        L: ArgList<Q> + ArgList<P> + ArgList<U> + ArgList<O> + ArgList<R> + ArgList<&'s u32>,
        L: ArgList<&'s f32>,
    {
        let s = self.scalars;
        ArgList::push(list, self.q);
        ArgList::push(list, self.k);
        ArgList::push(list, self.v);
        ArgList::push(list, self.tiles);
        ArgList::push(list, self.tables);
        for scalar in [
            &s.num_heads,
            &s.num_kv_heads,
            &s.head_dim,
            &s.block_size,
            &s.table_width,
            &s.split_len,
        ] {
            ArgList::push(list, scalar);
        }
        ArgList::push(list, &s.scale);
        ArgList::push(list, self.acc);
        ArgList::push(list, self.max);
        ArgList::push(list, self.sum);
        ArgList::push(list, self.out);
    }
}

/// `paged_reduce_<dtype>(acc, max, sum, num_heads, head_dim, splits, out)`: the splits'
/// partial outputs merged.
pub(crate) struct Reduce<'s, I, O> {
    pub acc: I,
    pub max: I,
    pub sum: I,
    pub scalars: &'s Scalars,
    pub out: O,
}

impl<'s, I, O> Reduce<'s, I, O> {
    pub(crate) fn push_to<L>(self, list: &mut L)
    where
        L: ArgList<I> + ArgList<O> + ArgList<&'s u32>,
    {
        let s = self.scalars;
        ArgList::push(list, self.acc);
        ArgList::push(list, self.max);
        ArgList::push(list, self.sum);
        for scalar in [&s.num_heads, &s.head_dim, &s.splits] {
            ArgList::push(list, scalar);
        }
        ArgList::push(list, self.out);
    }
}

/// `qkv_rope_<dtype>(qkv, bias, cos, sin, out, k_cache, v_cache, slots, q_norm, k_norm,
/// num_heads, num_kv_heads, head_dim, has_bias, has_norm, eps)`: the projection biased, its q
/// and k heads normed where `has_norm`, and rotated; q, k and v out as three segments, or with
/// pools (`engine.rope_writes_kv`) q out and k and v into their slots.
pub(crate) struct QkvRope<'s, I, O, P, U> {
    pub qkv: I,
    /// The projection itself where it has no bias (`has_bias` 0; never read then).
    pub bias: I,
    pub cos: I,
    pub sin: I,
    pub out: O,
    /// The layer's K and V pools, or two null pointers for the segments.
    pub pools: [P; 2],
    pub slots: U,
    /// The q and k norms' weights, or the projection twice where `has_norm` is 0.
    pub norms: [I; 2],
    pub scalars: &'s Scalars,
    pub has_bias: &'s u32,
    pub has_norm: &'s u32,
    pub eps: &'s f32,
}

impl<'s, I, O, P, U> QkvRope<'s, I, O, P, U> {
    pub(crate) fn push_to<L>(self, list: &mut L)
    where
        L: ArgList<I> + ArgList<O> + ArgList<P> + ArgList<U> + ArgList<&'s u32> + ArgList<&'s f32>,
    {
        let s = self.scalars;
        ArgList::push(list, self.qkv);
        ArgList::push(list, self.bias);
        ArgList::push(list, self.cos);
        ArgList::push(list, self.sin);
        ArgList::push(list, self.out);
        let [k_cache, v_cache] = self.pools;
        ArgList::push(list, k_cache);
        ArgList::push(list, v_cache);
        ArgList::push(list, self.slots);
        let [q_norm, k_norm] = self.norms;
        ArgList::push(list, q_norm);
        ArgList::push(list, k_norm);
        for scalar in [
            &s.num_heads,
            &s.num_kv_heads,
            &s.head_dim,
            self.has_bias,
            self.has_norm,
        ] {
            ArgList::push(list, scalar);
        }
        ArgList::push(list, self.eps);
    }
}

/// `add_rms_norm_<dtype>(x, r, weight, out, width, has_residual, eps)`: the residual sum and
/// its RMSNorm, out as two (rows, width) halves.
pub(crate) struct AddRmsNorm<'s, I, O> {
    pub x: I,
    /// `x` itself where there is no residual (`has_residual` 0; never read then).
    pub r: I,
    pub weight: I,
    pub out: O,
    pub width: &'s u32,
    pub has_residual: &'s u32,
    pub eps: &'s f32,
}

impl<'s, I, O> AddRmsNorm<'s, I, O> {
    pub(crate) fn push_to<L>(self, list: &mut L)
    where
        L: ArgList<I> + ArgList<O> + ArgList<&'s u32> + ArgList<&'s f32>,
    {
        ArgList::push(list, self.x);
        ArgList::push(list, self.r);
        ArgList::push(list, self.weight);
        ArgList::push(list, self.out);
        ArgList::push(list, self.width);
        ArgList::push(list, self.has_residual);
        ArgList::push(list, self.eps);
    }
}

/// `silu_mul_<dtype>(gate_up, out, width, total)`: silu(gate) * up of each row's halves.
pub(crate) struct SiluMul<'s, I, O> {
    pub gate_up: I,
    pub out: O,
    pub width: &'s u32,
    pub rows: &'s u32,
}

impl<'s, I, O> SiluMul<'s, I, O> {
    pub(crate) fn push_to<L>(self, list: &mut L)
    where
        L: ArgList<I> + ArgList<O> + ArgList<&'s u32>,
    {
        ArgList::push(list, self.gate_up);
        ArgList::push(list, self.out);
        ArgList::push(list, self.width);
        ArgList::push(list, self.rows);
    }
}
