#include "common.h"

/*
 * linear_small: y = epilogue(x W^T + bias) for the few rows of a decode step; W, x, y and `other` bf16. At a
 * handful of rows a projection is one pass over its weight: each weight row is read once from memory and met with
 * every x row while it is in registers, blocks of 4 rows shared out among the threads: it streams the weights faster
 * than oneDNN's matmul does at these row counts (docs/cpu-kernels.md has the figures).
 * W is [N, K] row-major, or, where vdpbf16ps exists (linear_weight_packed), packed by pack_linear_weight into blocks
 * of 4 rows interleaved by 32 columns, [N/4][K/32][4][32], so that each block is one contiguous stream.
 * op: 0 none, 1 silu, 2 times `other`, 3 plus `other` ([T, N], row stride other_st), applied to the float32 sum
 * and rounded once, as oneDNN's fused post-ops do. x: [T, K] row stride x_st; y: [T, N] contiguous; T <= 64,
 * taken 8 rows at a time over each block of W (from L1 after the first 8).
 */
#define LINEAR_TILE_T 8 /* x rows met by one pass over a block of W: their sums stay in registers */
typedef uint16_t v16u16 __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline v16f widen_bf16(const uint16_t* p) {  /* 16 bf16 -> 16 floats: bf16 is a truncated float32 */
    v16u16 h; memcpy(&h, p, sizeof h);
    v16u u = __builtin_convertvector(h, v16u) << 16;
    v16f f; memcpy(&f, &u, sizeof f);
    return f;
}

static inline float hsum16(v16f v) {
    v16f s = v;
    for (int i = 0; i < 8; ++i) s[i] += s[i + 8];
    for (int i = 0; i < 4; ++i) s[i] += s[i + 4];
    return (s[0] + s[2]) + (s[1] + s[3]);
}

static inline uint16_t to_bf16(float f) {  /* round to nearest even, as torch */
    union { float f; uint32_t u; } v = {.f = f};
    return (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);
}

static inline float bf16_value(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

/* Rows [j0, j0 + R) of a row-major W against all T rows of xf: the R x T dot products, each a float32 sum. The
 * rows `ahead` elements further on are prefetched into the caches while these are read. */
static inline __attribute__((always_inline)) void dot_rows(const uint16_t* w, int64_t K, const float* xf, int T,
                                                            int R, int64_t ahead, float sums[4][LINEAR_TILE_T]) {
    v16f acc[4][LINEAR_TILE_T];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) acc[r][t] = (v16f){0};
    int64_t k = 0;
    for (; k + 32 <= K; k += 32) {
        for (int r = 0; r < R; ++r) __builtin_prefetch(w + r * K + k + ahead, 0, 3);
        for (int half = 0; half < 32; half += 16) {
            v16f wv[4];
            for (int r = 0; r < R; ++r) wv[r] = widen_bf16(w + r * K + k + half);
            for (int t = 0; t < T; ++t) {
                const v16f xv = load16(xf + t * K + k + half);
                for (int r = 0; r < R; ++r) acc[r][t] += wv[r] * xv;
            }
        }
    }
    for (; k + 16 <= K; k += 16) {
        v16f wv[4];
        for (int r = 0; r < R; ++r) wv[r] = widen_bf16(w + r * K + k);
        for (int t = 0; t < T; ++t) {
            const v16f xv = load16(xf + t * K + k);
            for (int r = 0; r < R; ++r) acc[r][t] += wv[r] * xv;
        }
    }
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) {
            float s = hsum16(acc[r][t]);
            for (int64_t kk = k; kk < K; ++kk) s += bf16_value(w[r * K + kk]) * xf[t * K + kk];
            sums[r][t] = s;
        }
}

#if defined(__AVX512BF16__)
/* The same with AVX512-BF16 over one packed block of 4 rows (see linear_small): vdpbf16ps multiplies 32 bf16 pairs
 * exactly and adds them into 16 float32 sums, so the weight is used as it lies in memory, with no widening. The
 * block 4 KB further on is prefetched into the caches (prefetcht0; prefetchnta halved the speed). */
static inline __attribute__((always_inline)) void dot_block_bf16(const uint16_t* wp, int64_t K, const uint16_t* xb,
                                                                  int T, float sums[4][LINEAR_TILE_T]) {
    __m512 acc[4][LINEAR_TILE_T];
    for (int r = 0; r < 4; ++r)
        for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32, wp += 128) {
        __builtin_prefetch(wp + 2048, 0, 3);
        __builtin_prefetch(wp + 2048 + 32, 0, 3);
        __builtin_prefetch(wp + 2048 + 64, 0, 3);
        __builtin_prefetch(wp + 2048 + 96, 0, 3);
        __m512i wv[4];
        for (int r = 0; r < 4; ++r) wv[r] = _mm512_loadu_si512(wp + 32 * r);
        for (int t = 0; t < T; ++t) {
            const __m512i xv = _mm512_loadu_si512(xb + t * K + k);
            for (int r = 0; r < 4; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], (__m512bh)wv[r], (__m512bh)xv);
        }
    }
    for (int r = 0; r < 4; ++r)
        for (int t = 0; t < T; ++t) sums[r][t] = _mm512_reduce_add_ps(acc[r][t]);
}
#endif

static inline float apply_op(float v, int op, const uint16_t* other, int64_t other_st, int t, int64_t j) {
    switch (op) {
        case 1: return v / (1.f + expf(-v));
        case 2: return v * bf16_value(other[t * other_st + j]);
        case 3: return v + bf16_value(other[t * other_st + j]);
        default: return v;
    }
}

/* Whether this build reads W packed (pack_linear_weight, N % 4 == 0 and K % 32 == 0) or row-major. */
int linear_weight_packed(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

void pack_linear_weight(const void* weight, int64_t N, int64_t K, void* packed) {
    const uint16_t* w = (const uint16_t*)weight;
    uint16_t* p = (uint16_t*)packed;
    for (int64_t blk = 0; blk < N / 4; ++blk)
        for (int64_t kc = 0; kc < K / 32; ++kc)
            for (int r = 0; r < 4; ++r)
                memcpy(p + ((blk * (K / 32) + kc) * 4 + r) * 32, w + (blk * 4 + r) * K + kc * 32, 64);
}

int linear_small(const void* x, int64_t x_st, const void* weight, const void* bias, int64_t T, int64_t K, int64_t N,
                 int op, const void* other, int64_t other_st, void* y, int num_threads) {
    if (T < 1 || T > LINEAR_MAX_T || K > LINEAR_MAX_K) return -1;
    if (linear_weight_packed() && (N % 4 != 0 || K % 32 != 0)) return -1;
    float* xf = malloc(sizeof(float) * T * K + sizeof(uint16_t) * T * K);
    if (xf == NULL) return -1;
    uint16_t* xb = (uint16_t*)(xf + T * K);  /* the rows contiguous, as bf16 */
    for (int64_t t = 0; t < T; ++t) {
        memcpy(xb + t * K, (const uint16_t*)x + t * x_st, sizeof(uint16_t) * K);
        if (!linear_weight_packed()) load_row(xb + t * K, DTYPE_BF16, K, xf + t * K);  /* the row-major loop's */
    }
    const uint16_t* w = (const uint16_t*)weight;
    const uint16_t* b = (const uint16_t*)bias;
    const uint16_t* o = (const uint16_t*)other;
    uint16_t* out = (uint16_t*)y;
    const int tt = (int)T;
    const int64_t num_blocks = (N + 3) / 4;
    /* Small projections are not worth waking the other threads for. */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (N * K >= 65536)
    for (int64_t blk = 0; blk < num_blocks; ++blk) {
        const int64_t j0 = blk * 4;
        const int R = (int)(N - j0 < 4 ? N - j0 : 4);
        const uint16_t* wr = w + j0 * K;  /* packed or not, block blk starts here */
        for (int t0 = 0; t0 < tt; t0 += LINEAR_TILE_T) {
            const int tn = tt - t0 < LINEAR_TILE_T ? tt - t0 : LINEAR_TILE_T;
            float sums[4][LINEAR_TILE_T];
            /* A constant row count lets the compiler keep every accumulator in a register. */
#if defined(__AVX512BF16__)
            const uint16_t* xt = xb + t0 * K;
            switch (tn) {
                case 1: dot_block_bf16(wr, K, xt, 1, sums); break;
                case 2: dot_block_bf16(wr, K, xt, 2, sums); break;
                case 3: dot_block_bf16(wr, K, xt, 3, sums); break;
                case 4: dot_block_bf16(wr, K, xt, 4, sums); break;
                case 5: dot_block_bf16(wr, K, xt, 5, sums); break;
                case 6: dot_block_bf16(wr, K, xt, 6, sums); break;
                case 7: dot_block_bf16(wr, K, xt, 7, sums); break;
                default: dot_block_bf16(wr, K, xt, 8, sums); break;
            }
#else
            const float* xt = xf + t0 * K;
            const int64_t ahead = 8 * K;  /* two blocks on */
            if (R < 4) dot_rows(wr, K, xt, tn, R, ahead, sums);
            else switch (tn) {
                case 1: dot_rows(wr, K, xt, 1, 4, ahead, sums); break;
                case 2: dot_rows(wr, K, xt, 2, 4, ahead, sums); break;
                case 3: dot_rows(wr, K, xt, 3, 4, ahead, sums); break;
                case 4: dot_rows(wr, K, xt, 4, 4, ahead, sums); break;
                default: dot_rows(wr, K, xt, tn, 4, ahead, sums); break;
            }
#endif
            for (int r = 0; r < R; ++r) {
                const int64_t j = j0 + r;
                const float bj = b ? bf16_value(b[j]) : 0.f;
                for (int t = t0; t < t0 + tn; ++t)
                    out[t * N + j] = to_bf16(apply_op(sums[r][t - t0] + bj, op, o, other_st, t, j));
            }
        }
    }
    free(xf);
    return 0;
}

/* The limits the Python side reads (cpu_kernels.limits()): the most rows and columns of x. */
int linear_max_rows(void) { return LINEAR_MAX_T; }
int linear_max_k(void) { return LINEAR_MAX_K; }
