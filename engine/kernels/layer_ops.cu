// The layer's elementwise steps besides the attention's (`engine.layer_kernels`): the residual
// sum with the RMSNorm after it, and the gated MLP's product. Compiled after
// kernels/paged_attention.cu, in the same NVRTC module (the SOURCE of
// engine/src/cuda_attn/mod.rs joins them), whose types and conversions it uses.
// check-kernels-after: paged_attention.cu
#line 7 "kernels/layer_ops.cu"

// Threads of an add_rms_norm block (cuda_attn::norm_geometry).
#define NORM_THREADS 256

// The residual sum and the RMSNorm after it (`engine.layer_kernels`): one block per row.
// `out` is (2, rows, width): first x + r rounded to T, as a separate add rounds it (x itself
// where !has_residual), then that sum's RMSNorm times `weight`, in f32 and rounded once.
template <typename T>
__device__ void add_rms_norm(const T *x, const T *r, const T *weight, T *out, unsigned int width,
                             unsigned int has_residual, float eps) {
    // A warp's sum each (a test holds norm_geometry's block to NORM_THREADS).
    __shared__ float warp_sums[NORM_THREADS / WARP];
    const unsigned int row = blockIdx.x, rows = gridDim.x;
    const T *xs = x + (size_t)row * width;
    const T *rs = r + (size_t)row * width;
    T *sum = out + (size_t)row * width;
    T *normed = out + ((size_t)rows + row) * width;
    float squares = 0.0f;
    for (unsigned int i = threadIdx.x; i < width; i += blockDim.x) {
        T s;
        from_f32(s, has_residual ? __fadd_rn(to_f32(xs[i]), to_f32(rs[i])) : to_f32(xs[i]));
        sum[i] = s;
        const float v = to_f32(s);
        squares = __fadd_rn(squares, __fmul_rn(v, v));
    }
    for (unsigned int off = WARP / 2; off > 0; off /= 2)
        squares = __fadd_rn(squares, __shfl_xor_sync(FULL_MASK, squares, off));
    if (threadIdx.x % WARP == 0) warp_sums[threadIdx.x / WARP] = squares;
    __syncthreads();
    float total = 0.0f;
    for (unsigned int w = 0; w < blockDim.x / WARP; ++w) total = __fadd_rn(total, warp_sums[w]);
    const float scale = __fdiv_rn(1.0f, sqrtf(__fadd_rn(__fdiv_rn(total, (float)width), eps)));
    // Each thread reads back the sums it wrote itself.
    for (unsigned int i = threadIdx.x; i < width; i += blockDim.x)
        from_f32(normed[i], __fmul_rn(__fmul_rn(to_f32(sum[i]), scale), to_f32(weight[i])));
}

// The gated MLP's product (`engine.layer_kernels`): `out` (rows, width) is silu(gate) * up, gate
// and up the two halves of each row of `gate_up` (rows, 2 * width). silu is rounded to T as a
// separate op rounds it, then the product. Blocks stride over columns (x) and rows (y), so
// that no thread divides to find its element.
template <typename T>
__device__ void silu_mul(const T *gate_up, T *out, unsigned int width, unsigned int rows) {
    for (unsigned int row = blockIdx.y; row < rows; row += gridDim.y) {
        const T *gate = gate_up + (size_t)row * 2 * width, *up = gate + width;
        for (unsigned int j = blockIdx.x * blockDim.x + threadIdx.x; j < width;
             j += gridDim.x * blockDim.x) {
            const float g = to_f32(gate[j]), u = to_f32(up[j]);
            T s;
            from_f32(s, __fdiv_rn(g, __fadd_rn(1.0f, expf(-g))));
            from_f32(out[(size_t)row * width + j], __fmul_rn(to_f32(s), u));
        }
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
