// Untruncated draws split over several blocks each (`engine.split_draws`), so that a batch of a
// few hundred draws fills the GPU. Compiled after kernels/sample.cu, in the same NVRTC module
// (the SOURCE of engine/src/device_sample/mod.rs joins them), whose draw, merge and finish it
// uses.
// check-kernels-after: sample.cu
#line 7 "kernels/sample_split.cu"

// Four logits of a group as one load: 16 bytes in f32, 8 in bf16.
template <typename T> struct alignas(4 * sizeof(T)) Quad { T x[4]; };

// The Quad at `p` (aligned to one): one vector load on a GPU, a copy on the host, where a
// misaligned address fails as it faults on a GPU.
template <typename T>
__device__ __forceinline__ Quad<T> load_quad(const T *p) {
#ifdef __CUDA_ARCH__
    return *reinterpret_cast<const Quad<T> *>(p);
#else
    if ((size_t)p % sizeof(Quad<T>) != 0)
        emu::fail("a %zu-byte load from a misaligned address", sizeof(Quad<T>));
    Quad<T> q;
    memcpy(&q, p, sizeof q);
    return q;
#endif
}

// Group g's logits 4g..4g+3 as f32 (NaN read as -inf, -inf past the vocabulary): one load for
// the four where the row is `aligned` to a Quad and the group lies within the vocabulary.
template <typename T>
__device__ __forceinline__ void load_group(const T *row, unsigned int g, unsigned int vocab,
                                           bool aligned, float (&ls)[4]) {
    if (aligned && 4 * g + 4 <= vocab) {
        const Quad<T> q = load_quad(row + 4 * g);
        for (int lane = 0; lane < 4; ++lane) ls[lane] = clean(q.x[lane]);
        return;
    }
    for (unsigned int lane = 0; lane < 4; ++lane) {
        const unsigned int i = 4 * g + lane;
        ls[lane] = i < vocab ? clean(row[i]) : NEG_INF;
    }
}

// An untruncated draw over groups [lo, hi) of its row: the best noisy score (the logit itself
// when greedy) and the log-sum-exps of the logits (`raw`) and of the tempered scores (`kept`;
// left empty at temperature 1, where it is `raw`), each thread's own. Every logit gets the
// noise the one-block kernel gives it (group g's Philox words), so the best over all groups is
// that kernel's draw. The draw's key and counters come as values, read once.
template <typename T>
__device__ void draw_groups(const T *row, unsigned int vocab, unsigned int lo, unsigned int hi,
                            float scale, bool greedy, bool lazy, const unsigned int (&key)[2],
                            const unsigned int (&counter)[2], Best &best, Lse &raw,
                            Lse &kept) {
    const bool kept_is_raw = scale == 1.0f;
    const bool aligned = (size_t)row % sizeof(Quad<T>) == 0;
    const bool share = lazy && !greedy;
    float bar = NEG_INF;
    for (unsigned int g0 = lo; g0 < hi; g0 += THREADS) {
        const unsigned int g = g0 + threadIdx.x;
        if (g < hi) {
            float ls[4], ss[4];
            load_group(row, g, vocab, aligned, ls);
            const float reach = fmaxf(bar, best.score);
            bool any = false;
            for (unsigned int lane = 0; lane < 4; ++lane) {
                ss[lane] = __fmul_rn(ls[lane], scale);
                any = any || (4 * g + lane < vocab && !(ss[lane] + GUMBEL_BOUND < reach));
            }
            unsigned int words[4] = {g, counter[0], counter[1], 0u};
            if (!greedy && any) philox(words, key[0], key[1]);
            for (unsigned int lane = 0; lane < 4; ++lane) {
                const unsigned int i = 4 * g + lane;
                if (i >= vocab) break;
                const float l = ls[lane], s = ss[lane];
                lse_push(raw, l);
                if (!kept_is_raw) lse_push(kept, s);
                draw_logit(l, s, words[lane], i, greedy, lazy, bar, best);
            }
        }
        if (share) bar = warp_max(fmaxf(bar, best.score));
    }
}

// Words a part leaves for its draw's merge: best score and index, raw's max and sum, kept's.
#define PART_WORDS 6

// The draws of `gumbel_sample`, each untruncated draw's row split over gridDim.y blocks (its
// parts; `engine.split_draws`), so that a batch of a few hundred draws fills the GPU. Block
// (d, p) draws over the p-th share of d's groups and leaves its result in
// partials[(d * parts + p) * PART_WORDS ..]; the block that finishes d last (by a count a draw
// in `arrived`, zero at launch and left zero) merges the parts in part order and finishes the
// draw. A
// truncated draw, whose cut needs the whole row, is the one-block kernel's in block (d, 0).
template <typename T>
__device__ void gumbel_sample_split(SAMPLE_PARAMS(T), unsigned int *partials,
                                    unsigned int *arrived) {
    const unsigned int d = blockIdx.x, p = blockIdx.y, parts = gridDim.y;
    const float inv_t = inv_temps[d];
    if (truncated(d, vocab, inv_t, top_ks, top_ps, min_ps)) {
        if (p == 0) gumbel_sample(SAMPLE_ARGS);
        return;
    }
    const T *row = logits + (size_t)rows[d] * vocab;
    const bool greedy = inv_t == 0.0f;
    const float scale = greedy ? 1.0f : inv_t;
    const unsigned long long groups = (vocab + 3) / 4;
    const unsigned int key[2] = {keys[2 * d], keys[2 * d + 1]};
    const unsigned int counter[2] = {counters[2 * d], counters[2 * d + 1]};
    Best best; best.score = NEG_INF; best.index = 0xFFFFFFFFu;
    Lse raw; raw.max = NEG_INF; raw.sum = 0.0f;
    Lse kept = raw;
    draw_groups(row, vocab, (unsigned int)(groups * p / parts),
                (unsigned int)(groups * (p + 1) / parts), scale, greedy, lazy_noise != 0, key,
                counter, best, raw, kept);
    best = block_reduce(best, MergeBest());
    raw = block_reduce(raw, MergeLse());
    kept = scale == 1.0f ? raw : block_reduce(kept, MergeLse());
    __shared__ unsigned int ticket;
    if (threadIdx.x == 0) {
        unsigned int *mine = partials + ((size_t)d * parts + p) * PART_WORDS;
        mine[0] = __float_as_uint(best.score);
        mine[1] = best.index;
        mine[2] = __float_as_uint(raw.max);
        mine[3] = __float_as_uint(raw.sum);
        mine[4] = __float_as_uint(kept.max);
        mine[5] = __float_as_uint(kept.sum);
        // The part's words are visible to every block before its count is.
        __threadfence();
        ticket = atomicAdd(arrived + d, 1u);
    }
    __syncthreads();
    if (ticket != parts - 1) return;
    // The last part of d: every part's words are written. Read past the cache (volatile), in
    // part order, the same merge in every thread.
    __threadfence();
    const volatile unsigned int *all = partials + (size_t)d * parts * PART_WORDS;
    best.score = NEG_INF; best.index = 0xFFFFFFFFu;
    raw.max = NEG_INF; raw.sum = 0.0f;
    kept = raw;
    for (unsigned int q = 0; q < parts; ++q) {
        const volatile unsigned int *w = all + q * PART_WORDS;
        Best b; b.score = __uint_as_float(w[0]); b.index = w[1];
        Lse r; r.max = __uint_as_float(w[2]); r.sum = __uint_as_float(w[3]);
        Lse k; k.max = __uint_as_float(w[4]); k.sum = __uint_as_float(w[5]);
        best = best_merge(best, b);
        raw = lse_merge(raw, r);
        kept = lse_merge(kept, k);
    }
    // Every part has counted in: the count is left zero for the next launch on the buffer.
    if (threadIdx.x == 0) arrived[d] = 0;
    finish_draw(row, vocab, d, greedy, scale, best, raw, kept, n_tops, tokens, logprobs,
                model_logprobs, top_ids, top_logprobs);
}

#define INSTANTIATE_SPLIT(NAME, T)                                                              \
    extern "C" __global__ void __launch_bounds__(THREADS) gumbel_sample_split_##NAME(          \
        SAMPLE_PARAMS(T), unsigned int *partials, unsigned int *arrived) {                      \
        gumbel_sample_split<T>(SAMPLE_ARGS, partials, arrived);                                 \
    }

INSTANTIATE_SPLIT(f32, float)
INSTANTIATE_SPLIT(bf16, bf16)
