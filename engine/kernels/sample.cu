// Gumbel-max sampling of many rows at once: one block per draw, each thread a strided share
// of the vocabulary in groups of four (one Philox call each), then a block reduction. The
// reference, element for element, is engine/src/gumbel.rs; compiled at run time by NVRTC.

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u
#define THREADS 256
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

// logits: (rows, vocab) f32. Per draw d: rows[d], keys[2d..2d+2] (low word first),
// counters[2d..2d+2] = (position, sample index), inv_temps[d] (0 for greedy). Out per draw:
// the token, its logprob under the tempered softmax (untempered when greedy), and its
// untempered logprob.
extern "C" __global__ void gumbel_sample(
    const float *logits, unsigned int vocab, const unsigned int *rows,
    const unsigned int *keys, const unsigned int *counters, const float *inv_temps,
    unsigned int *tokens, float *logprobs, float *model_logprobs) {
    const unsigned int d = blockIdx.x;
    const float *row = logits + (size_t)rows[d] * vocab;
    const float inv_t = inv_temps[d];
    const bool greedy = inv_t == 0.0f;
    const float scale = greedy ? 1.0f : inv_t;
    Best best; best.score = NEG_INF; best.index = 0xFFFFFFFFu;
    Lse raw; raw.max = NEG_INF; raw.sum = 0.0f;
    Lse tempered = raw;
    const unsigned int groups = (vocab + 3) / 4;
    for (unsigned int g = threadIdx.x; g < groups; g += blockDim.x) {
        unsigned int words[4] = {g, counters[2 * d], counters[2 * d + 1], 0u};
        if (!greedy) philox(words, keys[2 * d], keys[2 * d + 1]);
        for (unsigned int lane = 0; lane < 4; ++lane) {
            unsigned int i = 4 * g + lane;
            if (i >= vocab) break;
            float l = row[i];
            if (l != l) l = NEG_INF;
            lse_push(raw, l);
            lse_push(tempered, l * scale);
            float score = l;
            if (!greedy) {
                float u = ((float)(words[lane] >> 9) + 0.5f) * (1.0f / 8388608.0f);
                score = l * scale - logf(-logf(u));
            }
            Best here; here.score = score; here.index = i;
            best = best_merge(best, here);
        }
    }
    for (int offset = 16; offset > 0; offset /= 2) {
        Best ob; ob.score = __shfl_down_sync(0xFFFFFFFFu, best.score, offset);
        ob.index = __shfl_down_sync(0xFFFFFFFFu, best.index, offset);
        best = best_merge(best, ob);
        Lse o; o.max = __shfl_down_sync(0xFFFFFFFFu, raw.max, offset);
        o.sum = __shfl_down_sync(0xFFFFFFFFu, raw.sum, offset);
        raw = lse_merge(raw, o);
        o.max = __shfl_down_sync(0xFFFFFFFFu, tempered.max, offset);
        o.sum = __shfl_down_sync(0xFFFFFFFFu, tempered.sum, offset);
        tempered = lse_merge(tempered, o);
    }
    __shared__ Best bests[THREADS / 32];
    __shared__ Lse raws[THREADS / 32];
    __shared__ Lse tempereds[THREADS / 32];
    const unsigned int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) { bests[warp] = best; raws[warp] = raw; tempereds[warp] = tempered; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (unsigned int w = 1; w < blockDim.x / 32; ++w) {
            best = best_merge(best, bests[w]);
            raw = lse_merge(raw, raws[w]);
            tempered = lse_merge(tempered, tempereds[w]);
        }
        unsigned int t = best.index < vocab ? best.index : 0u;
        float l = row[t];
        if (l != l) l = NEG_INF;
        float model = l - (raw.max + logf(raw.sum));
        tokens[d] = t;
        model_logprobs[d] = model;
        logprobs[d] = greedy ? model : l * scale - (tempered.max + logf(tempered.sum));
    }
}
