// The q/k/v projection's epilogue (`engine.rope_kernel`), one launch a layer where candle
// takes several ops. Compiled after kernels/paged_attention.cu, in the same NVRTC module (the
// SOURCE of engine/src/cuda_attn/mod.rs joins them), whose types and conversions it uses.
// check-kernels-after: paged_attention.cu
#line 6 "kernels/qkv_rope.cu"

// Element `col` of a projection row, plus its bias where `has_bias`, the sum rounded to T as a
// separate add would round it.
template <typename T>
__device__ __forceinline__ float biased(const T *row, const T *bias, unsigned int col,
                                        unsigned int has_bias) {
    const float x = to_f32(row[col]);
    if (!has_bias) return x;
    T r;
    from_f32(r, __fadd_rn(x, to_f32(bias[col])));
    return to_f32(r);
}

// The pair (x1, x2) of a head's elements j and j + half rotated by (c, s) into dst, in f32 and
// rounded once.
template <typename T>
__device__ __forceinline__ void rotate_pair(T *dst, unsigned int j, unsigned int half, float x1,
                                            float x2, float c, float s) {
    from_f32(dst[j], __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
    from_f32(dst[j + half], __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
}

// The q/k/v projection's epilogue (`engine.rope_kernel`): one block per token adds the bias
// (where `has_bias`) and rotates q and k by the token's angles ("rotate half"; cos and sin are
// (tokens, head_dim / 2) in T). Where `has_norm` (`engine.rope_qk_norm`: Qwen3's q/k norms) it
// first takes each q and k head's RMSNorm with `q_norm` or `k_norm` (head_dim each), a warp a
// head: the squares of the biased values summed by each lane in order and then across the
// warp by a butterfly, the normed value x * scale * weight in f32 rounded to T, as the model's
// norm rounds its output, then rotated. Without pools (`k_cache` null) it writes q, k and v as
// three contiguous segments of `out`, (tokens, heads, head_dim) then (tokens, kv_heads,
// head_dim) twice, which the attention and write_slots read as they are; with them
// (`engine.rope_writes_kv`) it writes q alone to `out` and k and v straight into the token's
// slot of each pool, as write_slots would. The rotation is computed in f32 and rounded once
// (in f32, the CPU's operations).
template <typename T>
__device__ void qkv_rope(const T *qkv, const T *bias, const T *cos, const T *sin, T *out,
                         T *k_cache, T *v_cache, const unsigned int *slots, const T *q_norm,
                         const T *k_norm, unsigned int heads, unsigned int kv_heads,
                         unsigned int head_dim, unsigned int has_bias, unsigned int has_norm,
                         float eps) {
    const unsigned int t = blockIdx.x, tokens = gridDim.x, half = head_dim / 2;
    const unsigned int q_dim = heads * head_dim, kv_dim = kv_heads * head_dim;
    const T *row = qkv + (size_t)t * (q_dim + 2 * kv_dim);
    const T *angles_c = cos + (size_t)t * half, *angles_s = sin + (size_t)t * half;
    T *q_out = out + (size_t)t * q_dim;
    T *k_out, *v_out;
    if (k_cache) {
        k_out = k_cache + (size_t)slots[t] * kv_dim;
        v_out = v_cache + (size_t)slots[t] * kv_dim;
    } else {
        k_out = out + (size_t)tokens * q_dim + (size_t)t * kv_dim;
        v_out = out + (size_t)tokens * (q_dim + kv_dim) + (size_t)t * kv_dim;
    }
    // q's and k's heads are consecutive in the row: rotate them together.
    if (has_norm) {
        const unsigned int lane = threadIdx.x % WARP;
        for (unsigned int h = threadIdx.x / WARP; h < heads + kv_heads; h += blockDim.x / WARP) {
            const unsigned int base = h * head_dim;
            float squares = 0.0f;
            for (unsigned int j = lane; j < half; j += WARP) {
                const float x1 = biased(row, bias, base + j, has_bias);
                const float x2 = biased(row, bias, base + j + half, has_bias);
                squares = __fadd_rn(squares, __fmul_rn(x1, x1));
                squares = __fadd_rn(squares, __fmul_rn(x2, x2));
            }
            for (unsigned int off = WARP / 2; off > 0; off /= 2)
                squares = __fadd_rn(squares, __shfl_xor_sync(FULL_MASK, squares, off));
            const float scale =
                __fdiv_rn(1.0f, sqrtf(__fadd_rn(__fdiv_rn(squares, (float)head_dim), eps)));
            const T *weight = h < heads ? q_norm : k_norm;
            T *dst = h < heads ? q_out + base : k_out + (h - heads) * head_dim;
            for (unsigned int j = lane; j < half; j += WARP) {
                T n1, n2;
                from_f32(n1, __fmul_rn(__fmul_rn(biased(row, bias, base + j, has_bias), scale),
                                       to_f32(weight[j])));
                from_f32(n2, __fmul_rn(__fmul_rn(biased(row, bias, base + j + half, has_bias),
                                                 scale),
                                       to_f32(weight[j + half])));
                rotate_pair(dst, j, half, to_f32(n1), to_f32(n2), to_f32(angles_c[j]),
                            to_f32(angles_s[j]));
            }
        }
    } else {
        for (unsigned int i = threadIdx.x; i < (heads + kv_heads) * half; i += blockDim.x) {
            const unsigned int h = i / half, j = i % half, col = h * head_dim + j;
            T *dst = h < heads ? q_out + h * head_dim : k_out + (h - heads) * head_dim;
            rotate_pair(dst, j, half, biased(row, bias, col, has_bias),
                        biased(row, bias, col + half, has_bias), to_f32(angles_c[j]),
                        to_f32(angles_s[j]));
        }
    }
    for (unsigned int e = threadIdx.x; e < kv_dim; e += blockDim.x)
        from_f32(v_out[e], biased(row, bias, q_dim + kv_dim + e, has_bias));
}

#define QKV_ROPE(NAME, T)                                                                       \
    extern "C" __global__ void qkv_rope_##NAME(                                                \
        const T *qkv, const T *bias, const T *cos, const T *sin, T *out, T *k_cache,           \
        T *v_cache, const unsigned int *slots, const T *q_norm, const T *k_norm,               \
        unsigned int heads, unsigned int kv_heads, unsigned int head_dim,                      \
        unsigned int has_bias, unsigned int has_norm, float eps) {                              \
        qkv_rope<T>(qkv, bias, cos, sin, out, k_cache, v_cache, slots, q_norm, k_norm, heads,  \
                    kv_heads, head_dim, has_bias, has_norm, eps);                               \
    }

QKV_ROPE(f32, float)
QKV_ROPE(bf16, bf16)
QKV_ROPE(f16, f16)
