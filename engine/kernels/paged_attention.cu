// Paged attention over the engine's KV pool, read in place through the block tables
// (`engine.attention = "cuda"`). Compiled at run time by NVRTC, header-free; the host side and
// its CPU twin (engine/src/cuda_attn) follow the same work split and reduction order.
//
// The pool of a layer is one (slots, kv_heads * head_dim) array per K and V; slot = block *
// block_size + offset. Three kernels per layer:
// - write_slots: a token's K (or V) row into its slot (one block per token); copy_slots, the
//   copies of copy-on-write, one block per copied slot.
// - paged_attention: one block per (tile, KV head, split). A tile is up to a few consecutive
//   query rows of one sequence (one row when decoding); the block serves every query head of
//   its KV head for those rows (a "pair" is a row and a query head), over one split of the
//   context, in chunks of CHUNK keys with an online softmax. It writes each pair's partial
//   output (unnormalised), maximum and sum: FlashDecoding's split-K. Each key's K row is read
//   once for all of the block's pairs, and each V element once for VALUE_PAIRS of them, with
//   several loads in flight per thread, so that the latency of single loads does not bound it.
// - paged_reduce: merges a pair's splits (one block per row and query head). Where the
//   context has one split the attention writes the output itself and no merge is launched.
// The block tables stay on the device between iterations; write_table_entries applies an
// iteration's changed entries. Compiled after this source, in the same module:
// kernels/qkv_rope.cu (`engine.rope_kernel`: the layer's q, k and v from its projection, and
// with `engine.rope_writes_kv` k and v into their slots in place of write_slots),
// kernels/layer_ops.cu (`engine.layer_kernels`: the layer's other elementwise steps) and
// kernels/paged_attention_mma.cu (the attention's tensor-core variant).

#define NEG_INF __int_as_float(0xff800000)
#define WARP 32
#define THREADS 128
#define NWARPS (THREADS / WARP)
#define CHUNK 128
#define FULL_MASK 0xffffffffu

struct bf16 { unsigned short x; };
struct f16 { unsigned short x; };

__device__ __forceinline__ float to_f32(float v) { return v; }
__device__ __forceinline__ float to_f32(bf16 v) { return __uint_as_float(((unsigned int)v.x) << 16); }
// PTX's conversions on a GPU; a host compile (the tests run these kernels on the CPU) brings
// its own, in software.
__device__ __forceinline__ float to_f32(f16 v) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.x));
    return f;
#else
    return host_f16_to_f32(v.x);
#endif
}
__device__ __forceinline__ void from_f32(float &o, float v) { o = v; }
// Round to nearest even, as candle's (the half crate's) conversion.
__device__ __forceinline__ void from_f32(bf16 &o, float v) {
    unsigned int u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) { o.x = 0x7fc0; return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    o.x = (unsigned short)(u >> 16);
}
__device__ __forceinline__ void from_f32(f16 &o, float v) {
#ifdef __CUDA_ARCH__
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(o.x) : "f"(v));
#else
    o.x = host_f32_to_f16(v);
#endif
}

template <typename T>
__device__ void write_slots(const T *src, T *cache, const unsigned int *slots, unsigned int row) {
    const size_t from = (size_t)blockIdx.x * row, to = (size_t)slots[blockIdx.x] * row;
    for (unsigned int i = threadIdx.x; i < row; i += blockDim.x) cache[to + i] = src[from + i];
}

// Copy-on-write: slot pairs[2b] of the pool copied to slot pairs[2b + 1], one block per copied
// slot. A destination is a fresh block's, never another copy's source, so blocks need no order.
template <typename T>
__device__ void copy_slots(T *cache, const unsigned int *pairs, unsigned int row) {
    const size_t from = (size_t)pairs[2 * blockIdx.x] * row;
    const size_t to = (size_t)pairs[2 * blockIdx.x + 1] * row;
    for (unsigned int i = threadIdx.x; i < row; i += blockDim.x) cache[to + i] = cache[from + i];
}

// BYTES of a K or V row as floats: one vector load on a GPU (rows are 16-byte aligned:
// head_dim is a multiple of 32 and the pools start at their allocation; a load of fewer bytes
// starts at a multiple of its size), a copy on the host.
template <typename T, unsigned int BYTES = 16> struct Pack {
    static constexpr unsigned int N = BYTES / sizeof(T);
    struct alignas(BYTES) Raw { unsigned int w[BYTES / 4]; };
    union { Raw raw; T e[N]; };
    Pack() = default;
    __device__ __forceinline__ explicit Pack(const T *p) {
#ifdef __CUDA_ARCH__
        raw = *reinterpret_cast<const Raw *>(p);
#else
        // A GPU faults on a vector load from an address not a multiple of its size.
        if ((size_t)p % BYTES != 0) emu::fail("a %u-byte load from a misaligned address", BYTES);
        memcpy(&raw, p, BYTES);
#endif
    }
    __device__ __forceinline__ float operator[](unsigned int i) const { return to_f32(e[i]); }
};

// Pairs whose scores a thread computes from one read of a key's K row.
#define SCORE_PAIRS 8
// Pairs a thread accumulates together in the value pass, each V load used for all of them.
#define VALUE_PAIRS 4
// The attention's variants (`bench rollout --score-loads --value-keys`), a template each,
// SCORE_LOADS 1 and VALUE_KEYS 8 the default (measured on GPUs; the others are not yet).
// SCORE_LOADS 16-byte loads of a K row in flight at once in the scores, VALUE_KEYS keys' V
// loads in the value pass. More loads in flight, fewer round trips to memory a chunk, for
// more registers a thread (fewer blocks a multiprocessor). The same arithmetic in the same
// order: the twin serves them all.

// SPLIT_VALUES: the value pass's other layout (variants `_split`). A thread owns SPLIT_DIMS
// dimensions of SPLIT_PAIRS pairs (one vector load of V a key feeds all their FMAs, the pairs
// padded to a multiple of SPLIT_PAIRS with zero scores) and sums a key group's share of each
// chunk (keys g, g + G, ...; G = THREADS / its items) in registers across chunks; the groups
// meet once, after the last chunk, added in group order. The scores are stored key-major so
// that a key's eight are one read.
#define SPLIT_DIMS 4
#define SPLIT_PAIRS 8
// Floats of the groups' partial sums when they meet: a thread's SPLIT_PAIRS x SPLIT_DIMS each.
#define SPLIT_PARTIALS (THREADS * SPLIT_PAIRS * SPLIT_DIMS)
// The score pass zeroes the padded pairs' scores group by group of SCORE_PAIRS.
static_assert(SCORE_PAIRS == SPLIT_PAIRS, "the split pass pads pairs to the score groups");

// tiles: 4 words per tile (sequence, first row, rows, position of the first row); a row at
// position p sees keys 0..=p. block_tables: (rows, table_width), a row per sequence. Shared
// memory, floats: q (pairs * head_dim, pre-scaled), acc (pairs * head_dim; with SPLIT_VALUES
// SPLIT_PARTIALS), scores (pairs * CHUNK; with SPLIT_VALUES padded pairs * CHUNK), the
// chunk's slots (CHUNK words), then per pair (padded) its running max, sum and rescale factor.
template <typename T, unsigned int SCORE_LOADS, unsigned int VALUE_KEYS, bool SPLIT_VALUES>
__device__ void paged_attention(
    const T *q, const T *k_cache, const T *v_cache, const unsigned int *tiles,
    const unsigned int *block_tables, unsigned int heads, unsigned int kv_heads,
    unsigned int head_dim, unsigned int block_size, unsigned int table_width,
    unsigned int split_len, float scale, float *part_acc, float *part_max, float *part_sum,
    T *out) {
    extern __shared__ float smem[];
    const unsigned int tile = blockIdx.x, kh = blockIdx.y, split = blockIdx.z;
    const unsigned int splits = gridDim.z;
    const unsigned int seq = tiles[4 * tile], first_row = tiles[4 * tile + 1];
    const unsigned int rows = tiles[4 * tile + 2], first_pos = tiles[4 * tile + 3];
    const unsigned int group = heads / kv_heads, pairs = rows * group;
    const unsigned int d = head_dim, row_len = kv_heads * head_dim;
    const unsigned int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    // Scores of pair p and chunk key jj at s_s[p * PS + jj * KS].
    const unsigned int padded = SPLIT_VALUES ? (pairs + SPLIT_PAIRS - 1) / SPLIT_PAIRS * SPLIT_PAIRS
                                             : pairs;
    const unsigned int PS = SPLIT_VALUES ? 1 : CHUNK, KS = SPLIT_VALUES ? padded : 1;
    float *q_s = smem;
    float *acc_s = q_s + pairs * d;
    float *s_s = acc_s + (SPLIT_VALUES ? SPLIT_PARTIALS : pairs * d);
    unsigned int *slot_s = (unsigned int *)(s_s + padded * CHUNK);
    float *m_s = (float *)(slot_s + CHUNK);
    float *l_s = m_s + padded;
    float *a_s = l_s + padded;

    for (unsigned int i = tid; i < pairs * d; i += THREADS) {
        const unsigned int p = i / d, e = i % d;
        const unsigned int row = first_row + p / group, h = kh * group + p % group;
        q_s[i] = to_f32(q[((size_t)row * heads + h) * d + e]) * scale;
        if (!SPLIT_VALUES) acc_s[i] = 0.0f;
    }
    // (Padded pairs: no max, sum or rescale; their zero scores add nothing.)
    for (unsigned int p = tid; p < padded; p += THREADS) {
        m_s[p] = NEG_INF;
        l_s[p] = 0.0f;
        if (SPLIT_VALUES) a_s[p] = 0.0f;
    }
    // With SPLIT_VALUES: this thread's item (SPLIT_DIMS dimensions from `e_own`, SPLIT_PAIRS
    // pairs from `p_own`), its key group and the groups' count; its sums live in `acc`.
    const unsigned int dgroups = d / SPLIT_DIMS;
    const unsigned int items = SPLIT_VALUES ? dgroups * (padded / SPLIT_PAIRS) : 1;
    const unsigned int groups = THREADS / items;
    const unsigned int item = tid % items, key_group = tid / items;
    const unsigned int e_own = item % dgroups * SPLIT_DIMS, p_own = item / dgroups * SPLIT_PAIRS;
    float acc[SPLIT_PAIRS][SPLIT_DIMS];
#pragma unroll
    for (unsigned int b = 0; b < SPLIT_PAIRS; ++b)
#pragma unroll
        for (unsigned int c = 0; c < SPLIT_DIMS; ++c) acc[b][c] = 0.0f;
    __syncthreads();

    const unsigned int keys = first_pos + rows;  // the tile's last row sees keys < this
    const unsigned int start = split * split_len;
    const unsigned int end = min(start + split_len, keys);
    const unsigned int *table = block_tables + (size_t)seq * table_width;
    const unsigned int value_items = (pairs + VALUE_PAIRS - 1) / VALUE_PAIRS * d;
    for (unsigned int c0 = start; c0 < end; c0 += CHUNK) {
        const unsigned int n = min(CHUNK, end - c0);
        // 1. Scores: a thread per key reads the key's K row in 16-byte loads, SCORE_LOADS at
        // once, and scores it for SCORE_PAIRS pairs at a time, each dot product in dimension
        // order.
        for (unsigned int jj = tid; jj < n; jj += THREADS) {
            const unsigned int j = c0 + jj;
            const unsigned int slot = table[j / block_size] * block_size + j % block_size;
            const T *k = k_cache + (size_t)slot * row_len + kh * d;
            for (unsigned int p0 = 0; p0 < pairs; p0 += SCORE_PAIRS) {
                float dot[SCORE_PAIRS];
#pragma unroll
                for (unsigned int b = 0; b < SCORE_PAIRS; ++b) dot[b] = 0.0f;
                for (unsigned int e00 = 0; e00 < d; e00 += SCORE_LOADS * Pack<T>::N) {
                    Pack<T> kv[SCORE_LOADS];
#pragma unroll
                    for (unsigned int c = 0; c < SCORE_LOADS; ++c)
                        if (e00 + c * Pack<T>::N < d) kv[c] = Pack<T>(k + e00 + c * Pack<T>::N);
#pragma unroll
                    for (unsigned int c = 0; c < SCORE_LOADS; ++c) {
                        const unsigned int e0 = e00 + c * Pack<T>::N;
                        if (e0 >= d) break;
#pragma unroll
                        for (unsigned int b = 0; b < SCORE_PAIRS; ++b) {
                            if (p0 + b < pairs) {
                                const float *qp = q_s + (p0 + b) * d + e0;
#pragma unroll
                                for (unsigned int i = 0; i < Pack<T>::N; ++i)
                                    dot[b] = fmaf(qp[i], kv[c][i], dot[b]);
                            }
                        }
                    }
                }
#pragma unroll
                for (unsigned int b = 0; b < SCORE_PAIRS; ++b) {
                    const unsigned int p = p0 + b;
                    if (p < pairs) s_s[p * PS + jj * KS] = j <= first_pos + p / group ? dot[b] : NEG_INF;
                    else if (SPLIT_VALUES && p < padded) s_s[p * PS + jj * KS] = 0.0f;
                }
            }
            slot_s[jj] = slot;
        }
        __syncthreads();
        // 2. Online softmax: a warp per pair, lane i over keys i, i + 32, ..., then the
        // warp's butterfly max and sum.
        for (unsigned int p = warp; p < pairs; p += NWARPS) {
            float *s = s_s + p * PS;
            float mc = NEG_INF;
            for (unsigned int jj = lane; jj < n; jj += WARP) mc = fmaxf(mc, s[jj * KS]);
            for (unsigned int off = WARP / 2; off > 0; off /= 2)
                mc = fmaxf(mc, __shfl_xor_sync(FULL_MASK, mc, off));
            const float m_old = m_s[p], m_new = fmaxf(m_old, mc);
            float l = l_s[p], alpha = 0.0f;
            if (m_new == NEG_INF) {
                for (unsigned int jj = lane; jj < n; jj += WARP) s[jj * KS] = 0.0f;
            } else {
                alpha = expf(m_old - m_new);
                float sum = 0.0f;
                for (unsigned int jj = lane; jj < n; jj += WARP) {
                    const float e = expf(s[jj * KS] - m_new);
                    s[jj * KS] = e;
                    sum += e;
                }
                for (unsigned int off = WARP / 2; off > 0; off /= 2)
                    sum += __shfl_xor_sync(FULL_MASK, sum, off);
                l = fmaf(l, alpha, sum);
            }
            __syncwarp();
            if (lane == 0) { m_s[p] = m_new; l_s[p] = l; a_s[p] = alpha; }
        }
        __syncthreads();
        // 3. Values. With SPLIT_VALUES: each thread its item's sums over its key group's
        // keys, VALUE_KEYS V loads at once, each in key order after the chunk's rescale.
        if constexpr (SPLIT_VALUES) {
            if (key_group < groups) {
#pragma unroll
                for (unsigned int b = 0; b < SPLIT_PAIRS; ++b) {
                    const float alpha = a_s[p_own + b];
#pragma unroll
                    for (unsigned int c = 0; c < SPLIT_DIMS; ++c) acc[b][c] *= alpha;
                }
                const T *v_own = v_cache + kh * d + e_own;
                for (unsigned int j0 = key_group; j0 < n; j0 += VALUE_KEYS * groups) {
                    Pack<T, SPLIT_DIMS * sizeof(T)> v[VALUE_KEYS];
#pragma unroll
                    for (unsigned int u = 0; u < VALUE_KEYS; ++u) {
                        const unsigned int jj = j0 + u * groups;
                        if (jj < n) v[u] = Pack<T, SPLIT_DIMS * sizeof(T)>(
                                          v_own + (size_t)slot_s[jj] * row_len);
                    }
#pragma unroll
                    for (unsigned int u = 0; u < VALUE_KEYS; ++u) {
                        const unsigned int jj = j0 + u * groups;
                        if (jj >= n) break;
                        const float *s = s_s + jj * KS + p_own;
#pragma unroll
                        for (unsigned int b = 0; b < SPLIT_PAIRS; ++b)
#pragma unroll
                            for (unsigned int c = 0; c < SPLIT_DIMS; ++c)
                                acc[b][c] = fmaf(s[b], v[u][c], acc[b][c]);
                    }
                }
            }
        } else {
            // Otherwise a thread per (dimension, VALUE_PAIRS pairs), VALUE_KEYS keys' V loads at
            // once; each pair's sum in key order.
            for (unsigned int i = tid; i < value_items; i += THREADS) {
                const unsigned int e = i % d, p0 = i / d * VALUE_PAIRS;
                float a[VALUE_PAIRS];
#pragma unroll
                for (unsigned int b = 0; b < VALUE_PAIRS; ++b)
                    a[b] = p0 + b < pairs ? acc_s[(p0 + b) * d + e] * a_s[p0 + b] : 0.0f;
                const T *v_col = v_cache + kh * d + e;
                for (unsigned int j0 = 0; j0 < n; j0 += VALUE_KEYS) {
                    float v[VALUE_KEYS];
#pragma unroll
                    for (unsigned int u = 0; u < VALUE_KEYS; ++u)
                        v[u] = j0 + u < n ? to_f32(v_col[(size_t)slot_s[j0 + u] * row_len]) : 0.0f;
#pragma unroll
                    for (unsigned int u = 0; u < VALUE_KEYS; ++u) {
                        if (j0 + u < n) {
#pragma unroll
                            for (unsigned int b = 0; b < VALUE_PAIRS; ++b)
                                if (p0 + b < pairs)
                                    a[b] = fmaf(s_s[(p0 + b) * PS + (j0 + u) * KS], v[u], a[b]);
                        }
                    }
                }
#pragma unroll
                for (unsigned int b = 0; b < VALUE_PAIRS; ++b)
                    if (p0 + b < pairs) acc_s[(p0 + b) * d + e] = a[b];
            }
        }
        __syncthreads();
    }
    if constexpr (SPLIT_VALUES) {
        // The key groups' sums meet in acc_s and are added in group order into q_s, which the
        // chunks no longer read, as the output the epilogue writes.
        if (key_group < groups) {
#pragma unroll
            for (unsigned int b = 0; b < SPLIT_PAIRS; ++b)
#pragma unroll
                for (unsigned int c = 0; c < SPLIT_DIMS; ++c)
                    acc_s[(key_group * items + item) * SPLIT_PAIRS * SPLIT_DIMS + b * SPLIT_DIMS + c] =
                        acc[b][c];
        }
        __syncthreads();
        for (unsigned int i = tid; i < pairs * d; i += THREADS) {
            const unsigned int p = i / d, e = i % d;
            const unsigned int at = (p / SPLIT_PAIRS * dgroups + e / SPLIT_DIMS) * SPLIT_PAIRS *
                                        SPLIT_DIMS + p % SPLIT_PAIRS * SPLIT_DIMS + e % SPLIT_DIMS;
            float x = acc_s[at];
            for (unsigned int g = 1; g < groups; ++g)
                x = __fadd_rn(x, acc_s[g * items * SPLIT_PAIRS * SPLIT_DIMS + at]);
            q_s[i] = x;
        }
        __syncthreads();
        acc_s = q_s;
    }
    if (splits == 1) {
        // The merge of one split, done here: the output normalised and rounded to T as
        // paged_reduce would round it (the + 0 is its fmaf(acc, 1, 0), -0 made +0).
        for (unsigned int i = tid; i < pairs * d; i += THREADS) {
            const unsigned int p = i / d, e = i % d;
            const unsigned int row = first_row + p / group, h = kh * group + p % group;
            const float l = l_s[p];
            from_f32(out[((size_t)row * heads + h) * d + e],
                     l > 0.0f ? __fadd_rn(acc_s[i], 0.0f) / l : 0.0f);
        }
        return;
    }
    for (unsigned int i = tid; i < pairs * d; i += THREADS) {
        const unsigned int p = i / d, e = i % d;
        const unsigned int row = first_row + p / group, h = kh * group + p % group;
        part_acc[(((size_t)row * heads + h) * splits + split) * d + e] = acc_s[i];
    }
    for (unsigned int p = tid; p < pairs; p += THREADS) {
        const unsigned int row = first_row + p / group, h = kh * group + p % group;
        const size_t at = ((size_t)row * heads + h) * splits + split;
        part_max[at] = m_s[p];
        part_sum[at] = l_s[p];
    }
}

template <typename T>
__device__ void paged_reduce(const float *part_acc, const float *part_max, const float *part_sum,
                             unsigned int heads, unsigned int head_dim, unsigned int splits,
                             T *out) {
    const unsigned int row = blockIdx.x, h = blockIdx.y;
    const size_t base = ((size_t)row * heads + h) * splits;
    float m = NEG_INF;
    for (unsigned int s = 0; s < splits; ++s) m = fmaxf(m, part_max[base + s]);
    float l = 0.0f;
    for (unsigned int s = 0; s < splits; ++s) {
        const float ms = part_max[base + s];
        const float w = ms == NEG_INF ? 0.0f : expf(ms - m);
        l = fmaf(part_sum[base + s], w, l);
    }
    for (unsigned int e = threadIdx.x; e < head_dim; e += blockDim.x) {
        float a = 0.0f;
        for (unsigned int s = 0; s < splits; ++s) {
            const float ms = part_max[base + s];
            const float w = ms == NEG_INF ? 0.0f : expf(ms - m);
            a = fmaf(part_acc[(base + s) * head_dim + e], w, a);
        }
        from_f32(out[((size_t)row * heads + h) * head_dim + e], l > 0.0f ? a / l : 0.0f);
    }
}

// pairs: n (index, block) pairs.
extern "C" __global__ void write_table_entries(unsigned int *table, const unsigned int *pairs,
                                               unsigned int n) {
    const unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) table[pairs[2 * i]] = pairs[2 * i + 1];
}

// paged_attention_<dtype>_s<SCORE_LOADS>_v<VALUE_KEYS>[_split]: a variant of the attention.
#define ATTENTION(NAME, T, S, V) ATTENTION_AS(NAME##_s##S##_v##V, T, S, V, false)
#define ATTENTION_SPLIT(NAME, T, S, V) ATTENTION_AS(NAME##_s##S##_v##V##_split, T, S, V, true)
#define ATTENTION_AS(KERNEL, T, S, V, SPLIT)                                                    \
    extern "C" __global__ void __launch_bounds__(THREADS) paged_attention_##KERNEL(            \
        const T *q, const T *k_cache, const T *v_cache, const unsigned int *tiles,             \
        const unsigned int *block_tables, unsigned int heads, unsigned int kv_heads,           \
        unsigned int head_dim, unsigned int block_size, unsigned int table_width,               \
        unsigned int split_len, float scale, float *part_acc, float *part_max,                 \
        float *part_sum, T *out) {                                                              \
        paged_attention<T, S, V, SPLIT>(q, k_cache, v_cache, tiles, block_tables, heads,        \
                                        kv_heads, head_dim, block_size, table_width,            \
                                        split_len, scale, part_acc, part_max, part_sum, out);   \
    }

#define INSTANTIATE(NAME, T)                                                                    \
    extern "C" __global__ void write_slots_##NAME(const T *src, T *cache,                      \
                                                  const unsigned int *slots, unsigned int row) { \
        write_slots<T>(src, cache, slots, row);                                                 \
    }                                                                                           \
    extern "C" __global__ void copy_slots_##NAME(T *cache, const unsigned int *pairs,          \
                                                 unsigned int row) {                           \
        copy_slots<T>(cache, pairs, row);                                                       \
    }                                                                                           \
    ATTENTION(NAME, T, 1, 8)                                                                    \
    extern "C" __global__ void paged_reduce_##NAME(                                            \
        const float *part_acc, const float *part_max, const float *part_sum,                   \
        unsigned int heads, unsigned int head_dim, unsigned int splits, T *out) {               \
        paged_reduce<T>(part_acc, part_max, part_sum, heads, head_dim, splits, out);            \
    }

INSTANTIATE(f32, float)
INSTANTIATE(bf16, bf16)
INSTANTIATE(f16, f16)

// The other scalar variants, compiled only into the module of that name
// (`-DATTENTION_VARIANTS`), so that the defaults' start-up compile stays small.
// check-kernels: -DATTENTION_VARIANTS
#ifdef ATTENTION_VARIANTS
#define VARIANTS(NAME, T)                                                                       \
    ATTENTION(NAME, T, 1, 16)                                                                   \
    ATTENTION(NAME, T, 1, 32)                                                                   \
    ATTENTION(NAME, T, 8, 8)                                                                    \
    ATTENTION(NAME, T, 8, 32)                                                                   \
    ATTENTION_SPLIT(NAME, T, 8, 4)
VARIANTS(f32, float)
VARIANTS(bf16, bf16)
VARIANTS(f16, f16)
#endif
