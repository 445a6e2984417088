// Gumbel-max sampling of many rows at once: one block per draw, each thread a strided share
// of the vocabulary in groups of four (one Philox call each), then block reductions; a draw
// that truncates nothing reads its row once. Top-k and top-p are a threshold on the tempered
// scores found by a search over the floats' order (block-wide counts or masses at 6
// thresholds a pass over the row, no sort); the top logprobs are found one block argmax
// each. The reference is engine/src/gumbel.rs and engine/src/truncation.rs; compiled at run
// time by NVRTC, with kernels/sample_split.cu after it (one draw over several blocks).

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u
#define THREADS 256
#define WARPS (THREADS / 32)
#define FULL_MASK 0xFFFFFFFFu
// Most top logprobs a draw returns (MAX_TOP_LOGPROBS).
#define MAX_TOP 20
// The largest Gumbel noise a draw can add: -ln(-ln(u)) for the largest u, 1 - 2^-24, is
// 16.64. Rounding is monotone, so a score with s + GUMBEL_BOUND below the best cannot reach it.
#define GUMBEL_BOUND 17.0f
// The lazy noise's margin: the gap between a score and the best, widened by LAZY_ABS plus
// LAZY_REL of their magnitudes, covers logf's, __expf's and the score's rounding many times.
#define LAZY_ABS 1e-3f
#define LAZY_REL 1e-5f
// No headers under NVRTC: -inf from its bits, NaN as the value unequal to itself.
#define NEG_INF __int_as_float(0xff800000)

struct Best { float score; unsigned int index; };
struct Lse { float max; float sum; };

__device__ void philox(unsigned int c[4], unsigned int k0, unsigned int k1) {
    for (int r = 0; r < 10; ++r) {
        unsigned int hi0 = __umulhi(PHILOX_M0, c[0]), lo0 = PHILOX_M0 * c[0];
        unsigned int hi1 = __umulhi(PHILOX_M1, c[2]), lo1 = PHILOX_M1 * c[2];
        unsigned int n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
        c[0] = n0; c[1] = lo1; c[2] = n2; c[3] = lo0;
        k0 += PHILOX_W0; k1 += PHILOX_W1;
    }
}

__device__ void lse_push(Lse &a, float x) {
    if (x == NEG_INF) return;
    if (x > a.max) { a.sum = a.sum * expf(a.max - x) + 1.0f; a.max = x; }
    else { a.sum += expf(x - a.max); }
}

__device__ Lse lse_merge(Lse a, Lse b) {
    if (b.max == NEG_INF) return a;
    if (a.max == NEG_INF) return b;
    float m = fmaxf(a.max, b.max);
    Lse r; r.max = m; r.sum = a.sum * expf(a.max - m) + b.sum * expf(b.max - m);
    return r;
}

__device__ Best best_merge(Best a, Best b) {
    if (b.score > a.score || (b.score == a.score && b.index < a.index)) return b;
    return a;
}


// Whether the noisy score s - ln(-ln(u)) of u, a word's uniform, surely stays below `best`
// (lazy noise): it reaches best only where -ln(u) <= exp(s - best), and -ln(u) >= 1 - u,
// which is exact in f32 for these uniforms. One fast exp where the exact noise takes two
// logs; the margin makes it skip only scores whose exact noise could not reach best either.
// A NaN gap (infinite scores) skips nothing.
__device__ __forceinline__ bool surely_below(float u, float s, float best) {
    const float gap = s - best + LAZY_ABS + LAZY_REL * (fabsf(s) + fabsf(best));
    return 1.0f - u > __expf(gap);
}

// Logit i (`l`, its tempered score `s`) drawn into `best`: the logit itself when greedy, else
// its noisy score from Philox word `word`, skipped where it surely stays below the best so
// far or the warp's `bar` (its noise is at most GUMBEL_BOUND; with `lazy`, [`surely_below`]).
__device__ __forceinline__ void draw_logit(float l, float s, unsigned int word, unsigned int i,
                                           bool greedy, bool lazy, float bar, Best &best) {
    float score = l;
    if (!greedy) {
        const float above = fmaxf(bar, best.score);
        if (s + GUMBEL_BOUND < above) return;
        const float u = ((float)(word >> 9) + 0.5f) * (1.0f / 8388608.0f);
        if (lazy && surely_below(u, s, above)) return;
        score = s - logf(-logf(u));
    }
    Best here; here.score = score; here.index = i;
    best = best_merge(best, here);
}

// Floats as unsigned integers in the same order (-inf lowest).
__device__ __forceinline__ unsigned int order_key(float x) {
    unsigned int b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// The logits in f32, or as the model computed them in bf16 (no cast before the kernel).
struct bf16 { unsigned short x; };

// A logit as f32, NaN read as -inf.
__device__ __forceinline__ float clean(float l) { return l != l ? NEG_INF : l; }
__device__ __forceinline__ float clean(bf16 l) {
    return clean(__uint_as_float(((unsigned int)l.x) << 16));
}

__device__ __forceinline__ float shfl_down(float v, int o) {
    return __shfl_down_sync(FULL_MASK, v, o);
}
__device__ __forceinline__ unsigned int shfl_down(unsigned int v, int o) {
    return __shfl_down_sync(FULL_MASK, v, o);
}
__device__ __forceinline__ Best shfl_down(Best b, int o) {
    Best r; r.score = shfl_down(b.score, o); r.index = shfl_down(b.index, o);
    return r;
}
__device__ __forceinline__ Lse shfl_down(Lse a, int o) {
    Lse r; r.max = shfl_down(a.max, o); r.sum = shfl_down(a.sum, o);
    return r;
}

// The largest of the warp's values, in every lane.
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

struct Add {
    template <typename T> __device__ T operator()(T a, T b) const { return a + b; }
};
struct MergeBest {
    __device__ Best operator()(Best a, Best b) const { return best_merge(a, b); }
};
struct MergeLse {
    __device__ Lse operator()(Lse a, Lse b) const { return lse_merge(a, b); }
};

// A block-wide reduction by `op` (a warp's shuffles, then the warps' partials in order);
// every thread gets the result. Each instantiation has its own shared slots and ends with a
// barrier, so calls may follow each other.
template <typename T, typename Op>
__device__ T block_reduce(T v, Op op) {
    __shared__ T part[WARPS];
    __shared__ T total;
    for (int o = 16; o > 0; o /= 2) v = op(v, shfl_down(v, o));
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        T t = part[0];
        for (int w = 1; w < WARPS; ++w) t = op(t, part[w]);
        total = t;
    }
    __syncthreads();
    T r = total;
    __syncthreads();
    return r;
}

// Parts a pass of the cut's search (SPLITS - 1 thresholds): it narrows its range SPLITS-fold
// a pass, so 12 passes cover the 32-bit keys.
#ifndef SPLITS
#define SPLITS 7
#endif
// Loads of the row a thread keeps in flight in the truncation's passes over it.
#define UNROLL 8

// `block_reduce` of each of `v`'s N values, the same arithmetic in the same order, with one
// pair of barriers for all of them.
template <typename T, int N, typename Op>
__device__ void block_reduce_each(T (&v)[N], Op op) {
    __shared__ T part[WARPS][N];
    for (int j = 0; j < N; ++j)
        for (int o = 16; o > 0; o /= 2) v[j] = op(v[j], shfl_down(v[j], o));
    if (threadIdx.x % 32 == 0)
        for (int j = 0; j < N; ++j) part[threadIdx.x / 32][j] = v[j];
    __syncthreads();
    for (int j = 0; j < N; ++j) {
        T t = part[0][j];
        for (int w = 1; w < WARPS; ++w) t = op(t, part[w][j]);
        v[j] = t;
    }
    __syncthreads();
}

// Calls f(l, s) on each of the thread's logits l of `row` (NaN read as -inf) with its
// tempered score s, in index order, UNROLL loads in flight at once: a pass over the row
// waits on memory once for every UNROLL logits, not once for each. The score is rounded as the
// host reference rounds it, never fused into a later add.
template <typename T, typename F>
__device__ __forceinline__ void each_score(const T *row, unsigned int vocab, float scale, F f) {
    const auto visit = [&](float l) { f(l, __fmul_rn(l, scale)); };
    unsigned int i = threadIdx.x;
    for (; i + (UNROLL - 1) * THREADS < vocab; i += UNROLL * THREADS) {
        T l[UNROLL];
        for (int u = 0; u < UNROLL; ++u) l[u] = row[i + u * THREADS];
        for (int u = 0; u < UNROLL; ++u) visit(clean(l[u]));
    }
    for (; i < vocab; i += THREADS) visit(clean(row[i]));
}

// The count of the scores of the row at or above the key `t` (Count), or their softmax mass
// relative to `smax` (Mass): what the cut's search weighs a score by.
struct Count {
    typedef unsigned int Total;
    __device__ unsigned int operator()(float) const { return 1u; }
};
struct Mass {
    typedef float Total;
    float smax;
    __device__ float operator()(float s) const { return expf(s - smax); }
};

// The largest key c in [lo, hi) whose total (the block's sum of `weight` over the scores
// with keys at or above c, which falls as c rises) reaches `need`, given that lo's does. Each
// pass totals SPLITS - 1 thresholds spread over the range, each thread summing its scores in
// index order and the block as `block_reduce` does: the totals a bisection step at any of
// them would find, so the same answer in 12 passes over the row where bisection takes 32.
template <typename T, typename W>
__device__ unsigned int search_cut(const T *row, unsigned int vocab, float scale,
                                   unsigned int lo, unsigned int hi,
                                   typename W::Total need, W weight) {
    typedef typename W::Total Total;
    while (hi - lo > 1) {
        const unsigned int span = hi - lo;
        const unsigned int step = span / SPLITS + (span % SPLITS != 0);
        Total sum[SPLITS - 1];
        for (int j = 0; j < SPLITS - 1; ++j) sum[j] = 0;
        each_score(row, vocab, scale, [&](float, float s) {
            const unsigned int key = order_key(s);
            // Below the first threshold: in no total.
            if (key < lo + step) return;
            const Total w = weight(s);
            for (int j = 0; j < SPLITS - 1; ++j)
                if (key - lo >= (unsigned int)(j + 1) * step) sum[j] += w;
        });
        block_reduce_each(sum, Add());
        // The totals fall as the thresholds rise: lo moves up to the last threshold reaching
        // `need`, hi down to the first that does not (those at or past hi are not tried).
        unsigned int next_lo = lo, next_hi = hi;
        for (int j = 0; j < SPLITS - 1; ++j) {
            const unsigned int t = (unsigned int)(j + 1) * step;
            if (t >= span) break;
            if (sum[j] >= need) next_lo = lo + t;
            else { next_hi = lo + t; break; }
        }
        lo = next_lo;
        hi = next_hi;
    }
    return lo;
}

// The largest order key `cut` with count(key(score) >= cut) >= top_k (0: none), raised to the
// key of smax + ln(min_p) (0: none), then, among the scores left, the largest with
// mass(key >= cut) >= top_p * mass(key >= that cut), the mass being the scores' exp relative
// to their max ([`search_cut`]: 12 passes at most each).
template <typename T>
__device__ unsigned int truncation_cut(const T *row, unsigned int vocab, float scale,
                                       float smax, unsigned int top_k, float top_p,
                                       float min_p) {
    unsigned int cut = 0;
    const unsigned int top = order_key(smax) + 1;
    if (top_k > 0 && top_k < vocab) cut = search_cut(row, vocab, scale, 0u, top, top_k, Count());
    if (min_p > 0.0f) cut = max(cut, order_key(smax + logf(min_p)));
    if (top_p < 1.0f) {
        Mass mass; mass.smax = smax;
        float m = 0.0f;
        each_score(row, vocab, scale, [&](float, float s) {
            if (order_key(s) >= cut) m += mass(s);
        });
        const float target = top_p * block_reduce(m, Add());
        cut = search_cut(row, vocab, scale, cut, top, target, mass);
    }
    return cut;
}

// Draw d's outputs from its row's best noisy score and log-sum-exps (untempered `raw`, and
// `kept` over the scores kept), the same in every thread: thread 0 writes the token and its
// logprobs, then the block finds the n_tops[d] most likely untempered tokens, one block argmax
// each, every pick ranked after the previous (higher logit first, lower index on ties).
template <typename T>
__device__ void finish_draw(const T *row, unsigned int vocab, unsigned int d, bool greedy,
                            float scale, Best best, Lse raw, Lse kept,
                            const unsigned int *n_tops, unsigned int *tokens, float *logprobs,
                            float *model_logprobs, unsigned int *top_ids,
                            float *top_logprobs) {
    const float raw_lse = raw.max + logf(raw.sum);
    if (threadIdx.x == 0) {
        const unsigned int t = best.index < vocab ? best.index : 0u;
        const float l = clean(row[t]);
        tokens[d] = t;
        model_logprobs[d] = l - raw_lse;
        logprobs[d] = greedy ? l - raw_lse : l * scale - (kept.max + logf(kept.sum));
    }
    const unsigned int n = min(n_tops[d], (unsigned int)MAX_TOP);
    float prev_l = NEG_INF;
    unsigned int prev_i = 0xFFFFFFFFu;
    for (unsigned int j = 0; j < n; ++j) {
        Best b; b.score = NEG_INF; b.index = 0xFFFFFFFFu;
        for (unsigned int i = threadIdx.x; i < vocab; i += THREADS) {
            const float l = clean(row[i]);
            const bool after = j == 0 || l < prev_l || (l == prev_l && i > prev_i);
            if (!after) continue;
            Best here; here.score = l; here.index = i;
            b = best_merge(b, here);
        }
        b = block_reduce(b, MergeBest());
        if (threadIdx.x == 0) {
            top_ids[d * MAX_TOP + j] = b.index;
            top_logprobs[d * MAX_TOP + j] = b.score - raw_lse;
        }
        prev_l = b.score;
        prev_i = b.index;
    }
}

// Whether draw d truncates its distribution: a temperature and top-k, min-p or top-p on.
__device__ __forceinline__ bool truncated(unsigned int d, unsigned int vocab, float inv_t,
                                          const unsigned int *top_ks, const float *top_ps,
                                          const float *min_ps) {
    const unsigned int top_k = top_ks[d];
    return inv_t != 0.0f &&
           ((top_k > 0 && top_k < vocab) || min_ps[d] > 0.0f || top_ps[d] < 1.0f);
}

// logits: (rows, vocab) f32 or bf16. Per draw d: rows[d], keys[2d..2d+2] (low word first),
// counters[2d..2d+2] = (position, sample index), inv_temps[d] (0 for greedy), top_ks[d] (0:
// off), top_ps[d] (1: off), min_ps[d] (0: off), n_tops[d] (top logprobs wanted, <= MAX_TOP);
// lazy_noise (0: off) computes a score's exact noise only where [`surely_below`] cannot rule
// it out, which draws the same tokens (`engine.lazy_noise`). Out per draw: the
// token, its logprob under the tempered, truncated and renormalised distribution (untempered
// when greedy), its untempered logprob, and the n_tops[d] most likely untempered tokens with
// their logprobs (top_ids and top_logprobs, MAX_TOP slots a draw).
// The sampling kernels' parameters (the split kernel adds its scratch), and their names as
// arguments: one list for the device functions and the entry points of both kernels.
#define SAMPLE_PARAMS(T)                                                                        \
    const T *logits, unsigned int vocab, const unsigned int *rows, const unsigned int *keys,    \
        const unsigned int *counters, const float *inv_temps, const unsigned int *top_ks,       \
        const float *top_ps, const float *min_ps, const unsigned int *n_tops,                   \
        unsigned int lazy_noise, unsigned int *tokens, float *logprobs, float *model_logprobs,  \
        unsigned int *top_ids, float *top_logprobs
#define SAMPLE_ARGS                                                                             \
    logits, vocab, rows, keys, counters, inv_temps, top_ks, top_ps, min_ps, n_tops, lazy_noise, \
        tokens, logprobs, model_logprobs, top_ids, top_logprobs
template <typename T>
__device__ void gumbel_sample(SAMPLE_PARAMS(T)) {
    const unsigned int d = blockIdx.x;
    const T *row = logits + (size_t)rows[d] * vocab;
    const float inv_t = inv_temps[d];
    const bool greedy = inv_t == 0.0f;
    const float scale = greedy ? 1.0f : inv_t;
    const unsigned int top_k = top_ks[d];
    const float top_p = top_ps[d], min_p = min_ps[d];
    const bool truncates = truncated(d, vocab, inv_t, top_ks, top_ps, min_ps);
    // 1. Where the draw truncates: the untempered log-sum-exp and the largest score first,
    //    then (2.) top-k, min-p and top-p: the scores kept are those whose key reaches `cut`.
    //    Otherwise every score is kept and the log-sum-exp is taken in the draw's own pass.
    Lse raw; raw.max = NEG_INF; raw.sum = 0.0f;
    unsigned int cut = 0;
    if (truncates) {
        float smax = NEG_INF;
        each_score(row, vocab, scale, [&](float l, float s) {
            lse_push(raw, l);
            smax = fmaxf(smax, s);
        });
        raw = block_reduce(raw, MergeLse());
        Best top; top.score = smax; top.index = 0;
        smax = block_reduce(top, MergeBest()).score;
        cut = truncation_cut(row, vocab, scale, smax, top_k, top_p, min_p);
    }
    // 3. The Gumbel-max draw and the log-sum-exp over the kept scores (the same sum as the
    //    untempered one where nothing is truncated and the temperature is 1 or greedy).
    const bool kept_is_raw = !truncates && scale == 1.0f;
    Best best; best.score = NEG_INF; best.index = 0xFFFFFFFFu;
    Lse kept; kept.max = NEG_INF; kept.sum = 0.0f;
    const unsigned int groups = (vocab + 3) / 4;
    // With lazy noise a warp's threads share their best scores after each round of groups:
    // a score surely below any score already drawn cannot be the draw, so each thread skips
    // below `bar`, the warp's best, and keeps its own best. Without, bar stays -inf.
    const bool share = lazy_noise && !greedy;
    float bar = NEG_INF;
    for (unsigned int g0 = 0; g0 < groups; g0 += THREADS) {
        const unsigned int g = g0 + threadIdx.x;
        if (g < groups) {
            // A score whose noise, at most GUMBEL_BOUND, cannot lift it to the best is not
            // drawn: the draw is the same, and Philox runs only for a group where one might.
            float ls[4], ss[4];
            bool any = false;
            for (unsigned int lane = 0; lane < 4; ++lane) {
                const unsigned int i = 4 * g + lane;
                ls[lane] = i < vocab ? clean(row[i]) : NEG_INF;
                // Rounded as the host reference rounds it, never fused into a later add.
                ss[lane] = __fmul_rn(ls[lane], scale);
                any = any || (i < vocab && order_key(ss[lane]) >= cut &&
                              !(ss[lane] + GUMBEL_BOUND < fmaxf(bar, best.score)));
            }
            unsigned int words[4] = {g, counters[2 * d], counters[2 * d + 1], 0u};
            if (!greedy && any) philox(words, keys[2 * d], keys[2 * d + 1]);
            for (unsigned int lane = 0; lane < 4; ++lane) {
                const unsigned int i = 4 * g + lane;
                if (i >= vocab) break;
                const float l = ls[lane], s = ss[lane];
                if (order_key(s) < cut) continue;
                if (!truncates) lse_push(raw, l);
                if (!kept_is_raw) lse_push(kept, s);
                draw_logit(l, s, words[lane], i, greedy, lazy_noise != 0, bar, best);
            }
        }
        if (share) bar = warp_max(fmaxf(bar, best.score));
    }
    best = block_reduce(best, MergeBest());
    if (!truncates) raw = block_reduce(raw, MergeLse());
    kept = kept_is_raw ? raw : block_reduce(kept, MergeLse());
    finish_draw(row, vocab, d, greedy, scale, best, raw, kept, n_tops, tokens, logprobs,
                model_logprobs, top_ids, top_logprobs);
}

#define INSTANTIATE(NAME, T)                                                                    \
    extern "C" __global__ void __launch_bounds__(THREADS)                                      \
        gumbel_sample_##NAME(SAMPLE_PARAMS(T)) {                                                \
        gumbel_sample<T>(SAMPLE_ARGS);                                                          \
    }

INSTANTIATE(f32, float)
INSTANTIATE(bf16, bf16)
