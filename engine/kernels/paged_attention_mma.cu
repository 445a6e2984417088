// Compiled after kernels/paged_attention.cu, in the same NVRTC module (the SOURCE of
// engine/src/cuda_attn/mod.rs joins them), whose types, loads and conversions it uses.
// check-kernels-after: paged_attention.cu
// check-kernels: -DATTENTION_VARIANTS
#line 6 "kernels/paged_attention_mma.cu"

// The attention on tensor cores (variants `mma` and `mma_staged`; bf16 and f16, head_dim D
// of 64 or 128, up to 16 pairs a tile): the grid, partial outputs and epilogue of
// paged_attention. Each warp takes every NWARPS-th run of MMA_KEYS keys of the block's split
// with an online softmax of its own. The scores are m16n8k16 products: the tile's pairs
// (padded with zero queries) are the 16 rows of A, K is B, 8 keys a product. The
// probabilities, rounded to T, stay in registers as the A operand of the value product, whose
// B is V, 8 dimensions a product. The warps' maxima, sums and outputs meet once, after the
// last run, in warp order. `mma` reads each lane's K and V elements from the pool straight
// into its fragments; `mma_staged` copies the run's K and V rows whole into the warp's share
// of shared memory (16-byte asynchronous copies, sent a run ahead) and takes the fragments
// from there with ldmatrix: fewer, wider loads for the same operands, so the same arithmetic.
#define MMA_KEYS 16
#define MMA_ROWS 16
// A warp's outputs in shared memory are rows of D + MMA_PAD floats, so that the lanes'
// 8-byte stores of a half-warp fall in distinct banks.
#define MMA_PAD 8
// A staged K or V row is D + MMA_KPAD elements, so that the eight rows an ldmatrix reads at
// once fall in distinct banks.
#define MMA_KPAD 8

template <typename T> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<bf16> { static constexpr bool value = true; };

// Two elements of T in one register, the first in the low half (PTX's fragment order).
template <typename T>
__device__ __forceinline__ unsigned int pack2(T lo, T hi) {
    return (unsigned int)lo.x | ((unsigned int)hi.x << 16);
}

// d = c + a b over one warp, PTX's m16n8k16 fragments (row-major a as 4 registers of pairs,
// column-major b as 2, c as 4 floats; PTX ISA, "Matrix Fragments for mma.m16n8k16"). The
// host's version gathers the operands by shuffles and sums each output in k order.
template <typename T>
__device__ __forceinline__ void mma16816(float c[4], const unsigned int a[4],
                                         const unsigned int b[2]) {
#ifdef __CUDA_ARCH__
    if constexpr (IsBf16<T>::value)
        asm(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    else
        asm(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
            "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    const unsigned int lane = threadIdx.x % WARP, group = lane / 4, pos = lane % 4;
    const auto half = [](unsigned int r, unsigned int hi) {
        T t;
        t.x = (unsigned short)(hi ? r >> 16 : r & 0xffffu);
        return to_f32(t);
    };
    // a's rows group and group + 8, b's columns 2 pos and 2 pos + 1: lane 4 g + j holds row g's
    // (and g + 8's) k = 2j, 2j + 1 and 8 + 2j, 9 + 2j, and column g's k at the same places.
    float rows[2][MMA_KEYS], cols[2][MMA_KEYS];
    for (unsigned int j = 0; j < 4; ++j) {
        for (unsigned int i = 0; i < 4; ++i) {
            const unsigned int r = __shfl_sync(FULL_MASK, a[i], group * 4 + j);
            const unsigned int k = 2 * j + 8 * (i / 2);
            rows[i % 2][k] = half(r, 0);
            rows[i % 2][k + 1] = half(r, 1);
        }
        for (unsigned int n = 0; n < 2; ++n)
            for (unsigned int i = 0; i < 2; ++i) {
                const unsigned int r = __shfl_sync(FULL_MASK, b[i], (2 * pos + n) * 4 + j);
                cols[n][2 * j + 8 * i] = half(r, 0);
                cols[n][2 * j + 8 * i + 1] = half(r, 1);
            }
    }
    for (unsigned int i = 0; i < 4; ++i)
        for (unsigned int k = 0; k < MMA_KEYS; ++k) c[i] = fmaf(rows[i / 2][k], cols[i % 2][k], c[i]);
#endif
}

// 16 bytes from global `src` to shared `dst` without waiting (zeros where !live: nothing is
// read), in the group the next cp_async_commit closes.
// (sm_80 and later; an older GPU's module has no caller.)
__device__ __forceinline__ void cp_async16(void *dst, const void *src, bool live) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned int to = (unsigned int)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;"
                 :: "r"(to), "l"(__cvta_generic_to_global(src)), "r"(live ? 16 : 0)
                 : "memory");
#elif !defined(__CUDA_ARCH__)
    emu::cp_async16(dst, src, live);
#endif
}

// Closes the group of the copies sent since the last one.
__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#elif !defined(__CUDA_ARCH__)
    emu::cp_async_commit();
#endif
}

// Waits until every group of this lane's copies but the latest is complete.
__device__ __forceinline__ void cp_async_wait_all_but_latest() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group 1;" ::: "memory");
#elif !defined(__CUDA_ARCH__)
    emu::cp_async_wait_group(1);
#endif
}

// Four 8 x 8 matrices of 16-bit elements from shared memory, a register each, in mma's
// fragment order: lane 8 i + j gives row j of matrix i at `base + offset`, and lane l gets row
// l / 4's elements 2 (l % 4) and 2 (l % 4) + 1; with TRANS, column l / 4's elements at rows
// 2 (l % 4) and 2 (l % 4) + 1 (the matrix read transposed). PTX ISA, "ldmatrix". The host's
// version gathers the offsets by shuffles. (sm_75 and later.)
template <bool TRANS, typename T>
__device__ __forceinline__ void ldmatrix_x4(unsigned int r[4], const T *base, unsigned int offset) {
#ifdef __CUDA_ARCH__
    const unsigned int at = (unsigned int)__cvta_generic_to_shared(base + offset);
    if constexpr (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at) : "memory");
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at) : "memory");
#else
    const unsigned int lane = threadIdx.x % WARP;
    for (unsigned int i = 0; i < 4; ++i) {
        T e[2];
        for (unsigned int c = 0; c < 2; ++c) {
            const unsigned int row = TRANS ? 2 * (lane % 4) + c : lane / 4;
            const unsigned int col = TRANS ? lane / 4 : 2 * (lane % 4) + c;
            e[c] = base[__shfl_sync(FULL_MASK, offset, 8 * i + row) + col];
        }
        r[i] = pack2(e[0], e[1]);
    }
#endif
}

// A run's operands: kb[nt][ks] the scores' B (keys 8 nt + quad, dimensions 16 ks + 2 pos and
// + 8), vb[nd] the values' B (keys 2 pos, 2 pos + 1, 8 + 2 pos, 9 + 2 pos of dimension
// 8 nd + quad), zeros for keys at or past `end`. (Where a function takes a run's `my_slot`,
// lane i holds key j0 + i % 16's slot.)
template <typename T, unsigned int D> struct RunOperands {
    unsigned int kb[2][D / 16][2];
    unsigned int vb[D / 8][2];
};

// `mma`: each lane loads its fragments' elements from the pool.
template <typename T, unsigned int D>
__device__ __forceinline__ void load_run(RunOperands<T, D> &o, const T *k_head, const T *v_head,
                                         unsigned int row_len, unsigned int my_slot,
                                         unsigned int j0, unsigned int end) {
    const unsigned int lane = threadIdx.x % WARP, quad = lane / 4, pos = lane % 4;
    T zero;
    zero.x = 0;
#pragma unroll
    for (unsigned int nt = 0; nt < 2; ++nt) {
        const unsigned int key = 8 * nt + quad;
        const unsigned int slot = __shfl_sync(FULL_MASK, my_slot, key);
        const bool live = j0 + key < end;
        const T *k = k_head + (size_t)slot * row_len + 2 * pos;
#pragma unroll
        for (unsigned int ks = 0; ks < D / 16; ++ks) {
            o.kb[nt][ks][0] = live ? Pack<T, 4>(k + 16 * ks).raw.w[0] : 0u;
            o.kb[nt][ks][1] = live ? Pack<T, 4>(k + 16 * ks + 8).raw.w[0] : 0u;
        }
    }
    unsigned int vslot[4];
    bool vlive[4];
#pragma unroll
    for (unsigned int x = 0; x < 4; ++x) {
        const unsigned int key = 2 * pos + x % 2 + 8 * (x / 2);
        vslot[x] = __shfl_sync(FULL_MASK, my_slot, key);
        vlive[x] = j0 + key < end;
    }
#pragma unroll
    for (unsigned int nd = 0; nd < D / 8; ++nd) {
        T e[4];
#pragma unroll
        for (unsigned int x = 0; x < 4; ++x)
            e[x] = vlive[x] ? v_head[(size_t)vslot[x] * row_len + 8 * nd + quad] : zero;
        o.vb[nd][0] = pack2(e[0], e[1]);
        o.vb[nd][1] = pack2(e[2], e[3]);
    }
}

// `mma_staged`: the warp's copies of a run's MMA_KEYS rows of K or V (`head`) into `rows`
// (D + MMA_KPAD elements a row), sent as one group without waiting for it. Without `any`
// (no run left) the group is empty, so that a take can always wait for all groups but the
// latest.
template <typename T, unsigned int D>
__device__ __forceinline__ void stage_copy(T *rows, const T *head, unsigned int row_len,
                                           unsigned int my_slot, unsigned int j0,
                                           unsigned int end, bool any) {
    constexpr unsigned int ROW = D + MMA_KPAD, PIECES = D / 8;
    const unsigned int lane = threadIdx.x % WARP;
    // Every lane has read the previous run's rows (the takes) before they are overwritten.
    __syncwarp();
    if (any) {
#pragma unroll
        for (unsigned int i = 0; i < MMA_KEYS * PIECES / WARP; ++i) {
            const unsigned int c = lane + i * WARP, key = c / PIECES, piece = c % PIECES;
            const unsigned int slot = __shfl_sync(FULL_MASK, my_slot, key);
            const size_t from = (size_t)slot * row_len + 8 * piece;
            cp_async16(rows + key * ROW + 8 * piece, head + from, j0 + key < end);
        }
    }
    cp_async_commit();
}

// `mma_staged`: waits for this lane's copy groups but the latest; the barrier then makes every
// lane's copies the warp's.
__device__ __forceinline__ void stage_wait() {
    cp_async_wait_all_but_latest();
    __syncwarp();
}

// `mma_staged`: the scores' B operands of the run whose K rows are `rows`, once their group
// is in (every group but the latest). Lane 8 i + j points at row j of matrix i: (keys 8 nt..,
// dimensions 16 ks..), (.., 16 ks + 8..), (.., 16 (ks + 1)..), (.., 16 (ks + 1) + 8..).
template <typename T, unsigned int D>
__device__ __forceinline__ void take_k(unsigned int kb[2][D / 16][2], const T *rows) {
    constexpr unsigned int ROW = D + MMA_KPAD;
    const unsigned int lane = threadIdx.x % WARP, mi = lane / 8, mr = lane % 8;
    stage_wait();
    unsigned int r[4];
#pragma unroll
    for (unsigned int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (unsigned int ks = 0; ks < D / 16; ks += 2) {
            ldmatrix_x4<false>(r, rows, (8 * nt + mr) * ROW + 16 * (ks + mi / 2) + 8 * (mi % 2));
            kb[nt][ks][0] = r[0];
            kb[nt][ks][1] = r[1];
            kb[nt][ks + 1][0] = r[2];
            kb[nt][ks + 1][1] = r[3];
        }
}

// `mma_staged`: the values' B operands of the run whose V rows are `rows`, read transposed,
// once their group is in: matrices (keys 0.., dimensions 8 nd..), (keys 8.., 8 nd..),
// (keys 0.., 8 (nd + 1)..), (keys 8.., 8 (nd + 1)..).
template <typename T, unsigned int D>
__device__ __forceinline__ void take_v(unsigned int vb[D / 8][2], const T *rows) {
    constexpr unsigned int ROW = D + MMA_KPAD;
    const unsigned int lane = threadIdx.x % WARP, mi = lane / 8, mr = lane % 8;
    stage_wait();
    unsigned int r[4];
#pragma unroll
    for (unsigned int nd = 0; nd < D / 8; nd += 2) {
        ldmatrix_x4<true>(r, rows, (8 * (mi % 2) + mr) * ROW + 8 * (nd + mi / 2));
        vb[nd][0] = r[0];
        vb[nd][1] = r[1];
        vb[nd + 1][0] = r[2];
        vb[nd + 1][1] = r[3];
    }
}

// Shared memory, floats: each warp's maxima and sums (MMA_ROWS each), its outputs
// (MMA_ROWS rows of D + MMA_PAD), then each pair's maximum and sum over the warps. With
// STAGED, the same bytes first hold each warp's staged rows (2 MMA_KEYS rows of D + MMA_KPAD
// elements a warp, fewer bytes than the outputs').
template <typename T, unsigned int D, bool STAGED>
__device__ void paged_attention_mma(
    const T *q, const T *k_cache, const T *v_cache, const unsigned int *tiles,
    const unsigned int *block_tables, unsigned int heads, unsigned int kv_heads,
    unsigned int block_size, unsigned int table_width, unsigned int split_len, float scale,
    float *part_acc, float *part_max, float *part_sum, T *out) {
    extern __shared__ __align__(16) float smem[];
    const unsigned int tile = blockIdx.x, kh = blockIdx.y, split = blockIdx.z;
    const unsigned int splits = gridDim.z;
    const unsigned int seq = tiles[4 * tile], first_row = tiles[4 * tile + 1];
    const unsigned int rows = tiles[4 * tile + 2], first_pos = tiles[4 * tile + 3];
    const unsigned int group = heads / kv_heads, pairs = rows * group, row_len = kv_heads * D;
    const unsigned int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
    // A lane's fragment rows are pairs `quad` and `quad + 8`, its columns 2 pos and 2 pos + 1.
    const unsigned int quad = lane / 4, pos = lane % 4;
    static_assert(2 * MMA_KEYS * (D + MMA_KPAD) * sizeof(T) <=
                      (2 + D + MMA_PAD) * MMA_ROWS * sizeof(float),
                  "a warp's staged rows fit in its share of the outputs' bytes");
    // `mma_staged`: the warp's staged K rows, then its V rows.
    T *k_stage = reinterpret_cast<T *>(smem) + warp * 2 * MMA_KEYS * (D + MMA_KPAD);
    T *v_stage = k_stage + MMA_KEYS * (D + MMA_KPAD);

    // The queries as A operands, a product's 16 dimensions each.
    unsigned int qa[D / 16][4];
#pragma unroll
    for (unsigned int r = 0; r < 2; ++r) {
        const unsigned int p = quad + 8 * r;
        const unsigned int row = first_row + p / group, h = kh * group + p % group;
        const T *qp = q + ((size_t)row * heads + h) * D + 2 * pos;
#pragma unroll
        for (unsigned int ks = 0; ks < D / 16; ++ks) {
            qa[ks][r] = p < pairs ? Pack<T, 4>(qp + 16 * ks).raw.w[0] : 0u;
            qa[ks][2 + r] = p < pairs ? Pack<T, 4>(qp + 16 * ks + 8).raw.w[0] : 0u;
        }
    }
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};
    float acc[D / 8][4];
#pragma unroll
    for (unsigned int nd = 0; nd < D / 8; ++nd)
#pragma unroll
        for (unsigned int i = 0; i < 4; ++i) acc[nd][i] = 0.0f;

    const unsigned int keys = first_pos + rows;
    const unsigned int start = split * split_len;
    const unsigned int end = min(start + split_len, keys);
    const unsigned int *table = block_tables + (size_t)seq * table_width;
    const T *k_head = k_cache + kh * D, *v_head = v_cache + kh * D;
    // Lane i looks up key j0 + i % 16's slot ahead of its use (a run ahead for `mma`, two for
    // `mma_staged`, whose copies go out a run early); the others come by shuffles. Keys
    // past `end` read nothing and count as zeros. (The lookup itself reads a key before `end`,
    // keys >= 1, so that it needs no branch.)
    const auto slot_of = [&](unsigned int j0) {
        const unsigned int mine = j0 + lane % MMA_KEYS, at = min(mine, end - 1);
        const unsigned int slot = table[at / block_size] * block_size + at % block_size;
        return mine < end ? slot : 0u;
    };
    const unsigned int first = start + warp * MMA_KEYS, step = NWARPS * MMA_KEYS;
    unsigned int next_slot = slot_of(first);
    // `mma_staged` sends the first run's K and V copies (two groups) before the loop. Each run
    // then takes its K operands and sends the next run's K copies, which its scores and
    // softmax overlap; takes its V operands and sends the next run's V copies, which its
    // value products and the next run's scores overlap; and then looks up the slots of the
    // run two ahead.
    if constexpr (STAGED) {
        stage_copy<T, D>(k_stage, k_head, row_len, next_slot, first, end, first < end);
        stage_copy<T, D>(v_stage, v_head, row_len, next_slot, first, end, first < end);
        next_slot = slot_of(first + step);
    }
    for (unsigned int j0 = first; j0 < end; j0 += step) {
        RunOperands<T, D> o;
        const bool more = j0 + step < end;
        if constexpr (STAGED) {
            take_k<T, D>(o.kb, k_stage);
            stage_copy<T, D>(k_stage, k_head, row_len, next_slot, j0 + step, end, more);
        } else {
            // The run's K and V loads go out together.
            const unsigned int my_slot = next_slot;
            next_slot = slot_of(j0 + step);
            load_run<T, D>(o, k_head, v_head, row_len, my_slot, j0, end);
        }
        // Scores: s[nt][i] is pair quad + 8 (i / 2) against key j0 + 8 nt + 2 pos + i % 2.
        float s[2][4];
#pragma unroll
        for (unsigned int nt = 0; nt < 2; ++nt) {
#pragma unroll
            for (unsigned int i = 0; i < 4; ++i) s[nt][i] = 0.0f;
#pragma unroll
            for (unsigned int ks = 0; ks < D / 16; ++ks) mma16816<T>(s[nt], qa[ks], o.kb[nt][ks]);
        }
        // Online softmax of each of the lane's two rows over the run: the quad's maximum, the
        // probabilities rounded to T (the value product's operand, and what the sum adds).
        unsigned int pa[4];
#pragma unroll
        for (unsigned int r = 0; r < 2; ++r) {
            const unsigned int p = quad + 8 * r;
            float mt = NEG_INF;
#pragma unroll
            for (unsigned int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (unsigned int c = 0; c < 2; ++c) {
                    const unsigned int j = j0 + 8 * nt + 2 * pos + c;
                    float &x = s[nt][2 * r + c];
                    x = j < end && j <= first_pos + p / group ? x * scale : NEG_INF;
                    mt = fmaxf(mt, x);
                }
            mt = fmaxf(mt, __shfl_xor_sync(FULL_MASK, mt, 1));
            mt = fmaxf(mt, __shfl_xor_sync(FULL_MASK, mt, 2));
            // Where every key so far is masked, the maximum stays -inf and exp(-inf - 0) gives
            // zero probabilities and a zero rescale, without a branch per element.
            const float m_new = fmaxf(m[r], mt);
            const float m_use = m_new == NEG_INF ? 0.0f : m_new;
            const float alpha = expf(m[r] - m_use);
            T e[2][2];
            float sum = 0.0f;
#pragma unroll
            for (unsigned int nt = 0; nt < 2; ++nt)
#pragma unroll
                for (unsigned int c = 0; c < 2; ++c) {
                    from_f32(e[nt][c], expf(s[nt][2 * r + c] - m_use));
                    sum += to_f32(e[nt][c]);
                }
            sum += __shfl_xor_sync(FULL_MASK, sum, 1);
            sum += __shfl_xor_sync(FULL_MASK, sum, 2);
            l[r] = fmaf(l[r], alpha, sum);
            m[r] = m_new;
            pa[r] = pack2(e[0][0], e[0][1]);
            pa[2 + r] = pack2(e[1][0], e[1][1]);
#pragma unroll
            for (unsigned int nd = 0; nd < D / 8; ++nd) {
                acc[nd][2 * r] *= alpha;
                acc[nd][2 * r + 1] *= alpha;
            }
        }
        if constexpr (STAGED) {
            take_v<T, D>(o.vb, v_stage);
            stage_copy<T, D>(v_stage, v_head, row_len, next_slot, j0 + step, end, more);
            next_slot = slot_of(j0 + 2 * step);
        }
#pragma unroll
        for (unsigned int nd = 0; nd < D / 8; ++nd) mma16816<T>(acc[nd], pa, o.vb[nd]);
    }

    // The warps meet: each one's rows in shared memory, merged in warp order (once every warp
    // is done with its staged rows, which those bytes held).
    if constexpr (STAGED) __syncthreads();
    float *w_max = smem, *w_sum = w_max + NWARPS * MMA_ROWS, *w_acc = w_sum + NWARPS * MMA_ROWS;
#pragma unroll
    for (unsigned int r = 0; r < 2; ++r) {
        const unsigned int at = warp * MMA_ROWS + quad + 8 * r;
        if (pos == 0) {
            w_max[at] = m[r];
            w_sum[at] = l[r];
        }
#pragma unroll
        for (unsigned int nd = 0; nd < D / 8; ++nd) {
            w_acc[at * (D + MMA_PAD) + 8 * nd + 2 * pos] = acc[nd][2 * r];
            w_acc[at * (D + MMA_PAD) + 8 * nd + 2 * pos + 1] = acc[nd][2 * r + 1];
        }
    }
    __syncthreads();
    // A thread a pair: its maximum over the warps, each warp's weight (in place of the warp's
    // maximum) and the pair's sum. Then a thread an output.
    float *p_max = w_acc + NWARPS * MMA_ROWS * (D + MMA_PAD), *p_sum = p_max + MMA_ROWS;
    if (tid < pairs) {
        float mx = NEG_INF;
        for (unsigned int w = 0; w < NWARPS; ++w) mx = fmaxf(mx, w_max[w * MMA_ROWS + tid]);
        float sum = 0.0f;
        for (unsigned int w = 0; w < NWARPS; ++w) {
            const float mw = w_max[w * MMA_ROWS + tid];
            const float weight = mw == NEG_INF ? 0.0f : expf(mw - mx);
            w_max[w * MMA_ROWS + tid] = weight;
            sum = fmaf(w_sum[w * MMA_ROWS + tid], weight, sum);
        }
        p_max[tid] = mx;
        p_sum[tid] = sum;
    }
    __syncthreads();
    for (unsigned int i = tid; i < pairs * D; i += THREADS) {
        const unsigned int p = i / D, e = i % D;
        const unsigned int row = first_row + p / group, h = kh * group + p % group;
        const float mx = p_max[p], sum = p_sum[p];
        float a = 0.0f;
        for (unsigned int w = 0; w < NWARPS; ++w)
            a = fmaf(w_acc[(w * MMA_ROWS + p) * (D + MMA_PAD) + e], w_max[w * MMA_ROWS + p], a);
        if (splits == 1) {
            // As paged_attention's one split: paged_reduce's rounding.
            from_f32(out[((size_t)row * heads + h) * D + e], sum > 0.0f ? __fadd_rn(a, 0.0f) / sum : 0.0f);
            continue;
        }
        const size_t at = ((size_t)row * heads + h) * splits + split;
        part_acc[at * D + e] = a;
        if (e == 0) {
            part_max[at] = mx;
            part_sum[at] = sum;
        }
    }
}

// paged_attention_<dtype>_<VARIANT>_d<D>: the attention on tensor cores for head_dim D, at
// least MIN_BLOCKS blocks a multiprocessor (ptxas 13.0, sm_90, bf16: `mma_staged` fits 4 at
// head_dim 64 in 122 registers and 3 at 128 in 168, 8 bytes spilled; `mma` fits 4 at 64 in
// 128, and at 128 spills 128 bytes if asked for 3, so it is asked for 2, in 218).
#define ATTENTION_MMA(NAME, T, D, VARIANT, STAGED, MIN_BLOCKS)                                 \
    extern "C" __global__ void __launch_bounds__(THREADS, MIN_BLOCKS)                          \
        paged_attention_##NAME##_##VARIANT##_d##D(                                              \
            const T *q, const T *k_cache, const T *v_cache, const unsigned int *tiles,         \
            const unsigned int *block_tables, unsigned int heads, unsigned int kv_heads,       \
            unsigned int head_dim, unsigned int block_size, unsigned int table_width,           \
            unsigned int split_len, float scale, float *part_acc, float *part_max,             \
            float *part_sum, T *out) {                                                          \
        paged_attention_mma<T, D, STAGED>(q, k_cache, v_cache, tiles, block_tables, heads,     \
                                          kv_heads, block_size, table_width, split_len, scale, \
                                          part_acc, part_max, part_sum, out);                   \
    }

// Tensor cores take bf16 from sm_80 (and cp.async and ldmatrix need it): an older GPU's
// modules hold no tensor-core kernels (the engine's default is then the scalar kernel), and
// looking one up fails, naming it. `mma_staged`, the default where it serves, is in the main
// module; `mma` in the variants' module only (`-DATTENTION_VARIANTS`).
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
ATTENTION_MMA(bf16, bf16, 64, mma_staged, true, 4)
ATTENTION_MMA(bf16, bf16, 128, mma_staged, true, 3)
ATTENTION_MMA(f16, f16, 64, mma_staged, true, 4)
ATTENTION_MMA(f16, f16, 128, mma_staged, true, 3)
#ifdef ATTENTION_VARIANTS
ATTENTION_MMA(bf16, bf16, 64, mma, false, 4)
ATTENTION_MMA(bf16, bf16, 128, mma, false, 2)
ATTENTION_MMA(f16, f16, 64, mma, false, 4)
ATTENTION_MMA(f16, f16, 128, mma, false, 2)
#endif
#endif
