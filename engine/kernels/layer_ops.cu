// The layer's elementwise steps besides the attention's (`engine.layer_kernels`): the residual
// sum with the RMSNorm after it, and the gated MLP's product. Compiled after
// kernels/paged_attention.cu, in the same NVRTC module (the SOURCE of
// engine/src/cuda_attn/mod.rs joins them), whose types and conversions it uses.
// check-kernels-after: paged_attention.cu
#line 7 "kernels/layer_ops.cu"

// Threads of an add_rms_norm block (cuda_attn::norm_geometry).
#define NORM_THREADS 256

// Whether `p` starts a 16-byte vector.
__device__ __forceinline__ bool aligned16(const void *p) { return ((size_t)p & 15) == 0; }

// 16 bytes of T to `p` (16-byte aligned): one vector store on a GPU, a copy on the host.
template <typename T>
__device__ __forceinline__ void store16(T *p, const Pack<T> &v) {
#ifdef __CUDA_ARCH__
    *reinterpret_cast<typename Pack<T>::Raw *>(p) = v.raw;
#else
    if ((size_t)p % 16 != 0) emu::fail("a 16-byte store to a misaligned address");
    memcpy(p, &v.raw, 16);
#endif
}

// dst[i] = f(a[i], b[i]) for the 16 bytes of T from i where `vectors` (i then starts one), in
// element order, else for element i alone.
template <typename T, typename F>
__device__ __forceinline__ void map2(T *dst, const T *a, const T *b, unsigned int i, bool vectors,
                                     F f) {
    if (vectors) {
        const Pack<T> av(a + i), bv(b + i);
        Pack<T> o;
#pragma unroll
        for (unsigned int k = 0; k < Pack<T>::N; ++k) o.e[k] = f(av.e[k], bv.e[k]);
        store16(dst + i, o);
    } else {
        dst[i] = f(a[i], b[i]);
    }
}

// The residual sum and the RMSNorm after it (`engine.layer_kernels`): one block per row.
// `out` is (2, rows, width): first x + r rounded to T, as a separate add rounds it (x itself
// where !has_residual, `r` then x again: it is read either way), then that sum's RMSNorm
// times `weight`, in f32 and rounded once. A thread takes 16 bytes of a row at a time where
// the row's vectors allow (the widths models have), one element otherwise: the same
// arithmetic, its squares summed in another order.
template <typename T>
__device__ void add_rms_norm(const T *x, const T *r, const T *weight, T *out, unsigned int width,
                             unsigned int has_residual, float eps) {
    constexpr unsigned int N = Pack<T>::N;
    // A warp's sum each (a test holds norm_geometry's block to NORM_THREADS).
    __shared__ float warp_sums[NORM_THREADS / WARP];
    const unsigned int row = blockIdx.x, rows = gridDim.x;
    const T *xs = x + (size_t)row * width;
    const T *rs = r + (size_t)row * width;
    T *sum = out + (size_t)row * width;
    T *normed = out + ((size_t)rows + row) * width;
    const bool vectors = width % N == 0 && aligned16(xs) && aligned16(rs) && aligned16(weight) &&
                         aligned16(sum) && aligned16(normed);
    const unsigned int per = vectors ? N : 1, stride = blockDim.x * per;
    // x + r at element i, rounded to T, and its square added to `squares`.
    float squares = 0.0f;
    const auto add = [&](T xv, T rv) {
        T s;
        from_f32(s, has_residual ? __fadd_rn(to_f32(xv), to_f32(rv)) : to_f32(xv));
        const float v = to_f32(s);
        squares = __fadd_rn(squares, __fmul_rn(v, v));
        return s;
    };
    for (unsigned int i = threadIdx.x * per; i < width; i += stride)
        map2(sum, xs, rs, i, vectors, add);
    for (unsigned int off = WARP / 2; off > 0; off /= 2)
        squares = __fadd_rn(squares, __shfl_xor_sync(FULL_MASK, squares, off));
    if (threadIdx.x % WARP == 0) warp_sums[threadIdx.x / WARP] = squares;
    __syncthreads();
    float total = 0.0f;
    for (unsigned int w = 0; w < blockDim.x / WARP; ++w) total = __fadd_rn(total, warp_sums[w]);
    const float scale = __fdiv_rn(1.0f, sqrtf(__fadd_rn(__fdiv_rn(total, (float)width), eps)));
    const auto norm = [&](T s, T w) {
        T o;
        from_f32(o, __fmul_rn(__fmul_rn(to_f32(s), scale), to_f32(w)));
        return o;
    };
    // Each thread reads back the sums it wrote itself.
    for (unsigned int i = threadIdx.x * per; i < width; i += stride)
        map2(normed, sum, weight, i, vectors, norm);
}

// The gated MLP's product (`engine.layer_kernels`): `out` (rows, width) is silu(gate) * up, gate
// and up the two halves of each row of `gate_up` (rows, 2 * width). silu is rounded to T as a
// separate op rounds it, then the product. Blocks stride over columns (x) and rows (y), so
// that no thread divides to find its element; a thread takes 16 bytes of a row at a time
// where the rows' vectors allow (cuda_attn::silu_geometry sizes the grid for that), one
// element otherwise, with the same arithmetic.
template <typename T>
__device__ void silu_mul(const T *gate_up, T *out, unsigned int width, unsigned int rows) {
    constexpr unsigned int N = Pack<T>::N;
    const bool vectors = width % N == 0 && aligned16(gate_up) && aligned16(out);
    const unsigned int per = vectors ? N : 1, stride = gridDim.x * blockDim.x * per;
    const auto gated = [](T g, T u) {
        const float gf = to_f32(g);
        T s, o;
        from_f32(s, __fdiv_rn(gf, __fadd_rn(1.0f, expf(-gf))));
        from_f32(o, __fmul_rn(to_f32(s), to_f32(u)));
        return o;
    };
    for (unsigned int row = blockIdx.y; row < rows; row += gridDim.y) {
        const T *gate = gate_up + (size_t)row * 2 * width, *up = gate + width;
        T *dst = out + (size_t)row * width;
        for (unsigned int j = (blockIdx.x * blockDim.x + threadIdx.x) * per; j < width;
             j += stride)
            map2(dst, gate, up, j, vectors, gated);
    }
}

#define LAYER_OPS(NAME, T)                                                                      \
    extern "C" __global__ void __launch_bounds__(NORM_THREADS) add_rms_norm_##NAME(            \
        const T *x, const T *r, const T *weight, T *out, unsigned int width,                   \
        unsigned int has_residual, float eps) {                                                 \
        add_rms_norm<T>(x, r, weight, out, width, has_residual, eps);                           \
    }                                                                                           \
    extern "C" __global__ void silu_mul_##NAME(const T *gate_up, T *out, unsigned int width,   \
                                               unsigned int rows) {                            \
        silu_mul<T>(gate_up, out, width, rows);                                                 \
    }

LAYER_OPS(f32, float)
LAYER_OPS(bf16, bf16)
LAYER_OPS(f16, f16)
