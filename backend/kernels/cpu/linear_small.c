#include "common.h"

/*
 * linear_small: y = epilogue(x W^T + bias) for the few rows of a decode step; W, x, y and `other` bf16. At a
 * handful of rows a projection is one pass over its weight: each weight element is read once from memory and met
 * with every x row while it is in registers, panels of outputs shared out among the threads: it streams the weights
 * faster than oneDNN's matmul does at these row counts (docs/cpu-kernels.md says why).
 * W is [N, K] row-major, or, where vdpbf16ps exists (linear_weight_packed), packed by pack_linear_weight into the
 * layout linear_amx's tiles read, [N/16][K/32][16 pairs of k][16 n][2]: one copy of each weight serves both kernels.
 * Read with vdpbf16ps, a 64-byte line of it is one pair of k for 16 outputs, met by each x row's pair broadcast to
 * every lane, so the 16 sums come out one output a lane. Packed, any number of rows is taken (8 at a time over each
 * pair of panels, from L1 after the first 8): a CPU without AMX runs every row count here.
 * op: 0 none, 1 silu, 2 times `other`, 3 plus `other` ([T, N], row stride other_st), applied to the float32 sum
 * and rounded once, as oneDNN's fused post-ops do. x: [T, K] row stride x_st; y: [T, N] contiguous; row-major,
 * T <= LINEAR_MAX_T.
 */
#define LINEAR_TILE_T 8 /* x rows met by one pass over a block of W: their sums stay in registers */
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
/* Where the weight's lines 4 KB ahead are prefetched to. The AMX Xeon the kernels were tuned on: L1 (prefetcht0;
 * prefetchnta halved the speed). A CPU without AMX (tuned on Zen 4): L2 (prefetcht1), which streamed the decode
 * step's projections at 1 to 64 rows 6-25 % faster there than into L1 (into L1 was slower than none). */
#if defined(__AMX_TILE__)
#define WEIGHT_PREFETCH_LOCALITY 3
#else
#define WEIGHT_PREFETCH_LOCALITY 2
#endif

/* Two panels of 16 outputs of the packed W (each [K/32][16 pairs][16 n][2], the second right after the first)
 * against T rows of xb: acc[p][t] holds panel p's 16 float32 sums for row t. vdpbf16ps multiplies the bf16 pairs
 * exactly, so the weight is used as it lies in memory, with no widening. Each panel's line 4 KB further on is
 * prefetched (WEIGHT_PREFETCH_LOCALITY). */
static inline __attribute__((always_inline)) void dot_panels_bf16(const uint16_t* wp, int64_t K, const uint16_t* xb,
                                                                   int T, __m512 acc[2][LINEAR_TILE_T]) {
    const int64_t panel = 16 * K;
    for (int p = 0; p < 2; ++p)
        for (int t = 0; t < T; ++t) acc[p][t] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 2, wp += 32) {
        __builtin_prefetch(wp + 2048, 0, WEIGHT_PREFETCH_LOCALITY);
        __builtin_prefetch(wp + panel + 2048, 0, WEIGHT_PREFETCH_LOCALITY);
        const __m512i w0 = _mm512_loadu_si512(wp), w1 = _mm512_loadu_si512(wp + panel);
        for (int t = 0; t < T; ++t) {
            int32_t pair;
            memcpy(&pair, xb + t * K + k, sizeof pair);
            const __m512i xv = _mm512_set1_epi32(pair);
            acc[0][t] = _mm512_dpbf16_ps(acc[0][t], (__m512bh)w0, (__m512bh)xv);
            acc[1][t] = _mm512_dpbf16_ps(acc[1][t], (__m512bh)w1, (__m512bh)xv);
        }
    }
}
#endif

/* Whether this build reads W packed (pack_linear_weight, N % 32 == 0 and K % 32 == 0) or row-major. */
int linear_weight_packed(void) {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

/* W [N, K] row-major -> [N/16][K/32][16 pairs of k][16 n][2]: each 16 x 32 block of W one contiguous 1 KB tile. */
void pack_linear_weight(const void* weight, int64_t N, int64_t K, void* packed) {
    const uint16_t* w = (const uint16_t*)weight;
    uint16_t* p = (uint16_t*)packed;
    for (int64_t nb = 0; nb < N / 16; ++nb)
        for (int64_t kb = 0; kb < K / 32; ++kb)
            for (int64_t kp = 0; kp < 16; ++kp)
                for (int64_t n = 0; n < 16; ++n)
                    for (int64_t e = 0; e < 2; ++e)
                        *p++ = w[(nb * 16 + n) * K + kb * 32 + 2 * kp + e];
}

#if defined(__AVX512BF16__)
/* The packed path: threads share out pairs of panels (32 outputs); each meets its pair with 8 rows of x at a time. */
static void linear_small_packed(const uint16_t* xb, const uint16_t* w, const uint16_t* b, int64_t T, int64_t K,
                                int64_t N, int op, const uint16_t* o, int64_t other_st, uint16_t* out,
                                int num_threads) {
    /* Small projections are not worth waking the other threads for. The pairs go out by OpenMP's run schedule,
     * dynamic,1 (backend/engine/openmp.py): a thread takes the next pair when it finishes one, so a thread that
     * another process keeps off its core for a while holds up one pair, not its fixed half of them. */
#pragma omp parallel for schedule(runtime) num_threads(num_threads) if (N * K >= 65536)
    for (int64_t pair = 0; pair < N / 32; ++pair) {
        const uint16_t* wp = w + pair * 32 * K;
        for (int64_t t0 = 0; t0 < T; t0 += LINEAR_TILE_T) {
            const int tn = T - t0 < LINEAR_TILE_T ? (int)(T - t0) : LINEAR_TILE_T;
            const uint16_t* xt = xb + t0 * K;
            __m512 acc[2][LINEAR_TILE_T];
            /* A constant row count lets the compiler keep every accumulator in a register. */
            switch (tn) {
                case 1: dot_panels_bf16(wp, K, xt, 1, acc); break;
                case 2: dot_panels_bf16(wp, K, xt, 2, acc); break;
                case 3: dot_panels_bf16(wp, K, xt, 3, acc); break;
                case 4: dot_panels_bf16(wp, K, xt, 4, acc); break;
                case 5: dot_panels_bf16(wp, K, xt, 5, acc); break;
                case 6: dot_panels_bf16(wp, K, xt, 6, acc); break;
                case 7: dot_panels_bf16(wp, K, xt, 7, acc); break;
                default: dot_panels_bf16(wp, K, xt, 8, acc); break;
            }
            for (int p = 0; p < 2; ++p) {
                float sums[LINEAR_TILE_T * 16];
                for (int t = 0; t < tn; ++t) _mm512_storeu_ps(sums + 16 * t, acc[p][t]);
                linear_epilogue16(sums, t0, tn, pair * 32 + 16 * p, N, b, op, o, other_st, out);
            }
        }
    }
}
#endif

#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
/* The row-major weight on a CPU with AVX2 and FMA but no bf16 dot product (Zen 2 and 3, most client Xeons and
 * Cores): the way a float32 GEMM runs, with the weight widened a panel at a time. torch's bf16 matmul has no fast
 * path there (10x slower than its float32 one, measured on Zen 2), so this takes every row count above a decode's.
 * x is widened once into blocks of ROWS_PER_BLOCK rows laid out [K][rows]; each panel of PANEL_OUT outputs is
 * widened into a float32 buffer [PANEL_OUT][K] and met with one block at a time: per k, the block's rows in two
 * vectors, each output's weight broadcast, 12 FMAs into 12 accumulators (with the 2 rows and a broadcast, 15 of the
 * 16 ymm registers). The blocks are taken a chunk at a time, about X_CHUNK_BYTES of x, so that the chunk stays in
 * L2 while every panel meets it; a panel is widened again for each chunk (one conversion per 100 or so FMAs). */
#define PANEL_OUT 6
#define ROWS_PER_BLOCK 16
#define X_CHUNK_BYTES (192 * 1024)
/* Panels go to the threads GROUP_PANELS at a time (96 outputs), so that two threads never write the same cache line
 * of y (a line of a row holds 32 outputs) and each thread reads W in runs the prefetcher follows: the LM head at 64
 * rows took 26 ms in six runs of six, and 26-35 ms with the panels shared out one by one. */
#define GROUP_PANELS 16
/* From this many rows the panels run; below, dot_rows' one pass over the weight (a decode step's few rows would
 * leave most of a block's 16 lanes empty). set_linear_panel_rows() changes it: the bench's and the tests' arms. */
static int panel_from_rows = 5;

static inline __attribute__((always_inline)) void panel_block(const float* wf, const float* xb, int64_t K,
                                                               __m256 acc[PANEL_OUT][2]) {
    for (int j = 0; j < PANEL_OUT; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        const __m256 x0 = _mm256_loadu_ps(xb + k * ROWS_PER_BLOCK), x1 = _mm256_loadu_ps(xb + k * ROWS_PER_BLOCK + 8);
        for (int j = 0; j < PANEL_OUT; ++j) {
            const __m256 wv = _mm256_broadcast_ss(wf + j * K + k);
            acc[j][0] = _mm256_fmadd_ps(wv, x0, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(wv, x1, acc[j][1]);
        }
    }
}

/* Rows [j0, j0 + n) of W widened into wf [PANEL_OUT][K]; the rows past n zeros. */
static void widen_panel(const uint16_t* w, int64_t K, int64_t j0, int n, float* wf) {
    for (int j = 0; j < PANEL_OUT; ++j) {
        float* dst = wf + j * K;
        if (j >= n) { memset(dst, 0, sizeof(float) * K); continue; }
        const uint16_t* row = w + (j0 + j) * K;
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) {
            const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(row + k)));
            _mm256_storeu_ps(dst + k, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
        }
        for (; k < K; ++k) dst[k] = bf16_value(row[k]);
    }
}

/* One row's way out: y[t][j0, j0 + width) from its float32 sums s: the bias, the op (see linear_small) and one
 * rounding to bf16 (nearest even, as torch), 8 at a time. */
static inline void epilogue_row(const float* s, int64_t width, int64_t t, int64_t j0, int64_t N, const uint16_t* b,
                                int op, const uint16_t* o, int64_t other_st, uint16_t* out) {
    int64_t c = 0;
    for (; c + 8 <= width; c += 8) {
        __m256 v = _mm256_loadu_ps(s + c);
        if (b) v = _mm256_add_ps(v, widen8_bf16(b + j0 + c));
        if (op == 1) {  /* silu: v / (1 + e^-v), the exponent kept where exp8 holds */
            const __m256 e = _mm256_min_ps(_mm256_max_ps(_mm256_sub_ps(_mm256_setzero_ps(), v),
                                                         _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
            v = _mm256_div_ps(v, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(e)));
        } else if (op == 2) {
            v = _mm256_mul_ps(v, widen8_bf16(o + t * other_st + j0 + c));
        } else if (op == 3) {
            v = _mm256_add_ps(v, widen8_bf16(o + t * other_st + j0 + c));
        }
        store8_bf16(out + t * N + j0 + c, v);
    }
    for (; c < width; ++c) {
        const float bj = b ? bf16_value(b[j0 + c]) : 0.f;
        out[t * N + j0 + c] = to_bf16(apply_op(s[c] + bj, op, o, other_st, (int)t, j0 + c));
    }
}

static int linear_rows_avx2(const uint16_t* x, int64_t x_st, const uint16_t* w, const uint16_t* b, int64_t T,
                            int64_t K, int64_t N, int op, const uint16_t* o, int64_t other_st, uint16_t* out,
                            int num_threads) {
    const int64_t num_blocks = (T + ROWS_PER_BLOCK - 1) / ROWS_PER_BLOCK;
    const int64_t num_panels = (N + PANEL_OUT - 1) / PANEL_OUT;
    /* groups of one where there would be too few to share out among the threads */
    const int64_t group_panels = num_panels >= 2 * GROUP_PANELS * num_threads ? GROUP_PANELS : 1;
    const int64_t num_groups = (num_panels + group_panels - 1) / group_panels;
    int64_t chunk = X_CHUNK_BYTES / (int64_t)(sizeof(float) * ROWS_PER_BLOCK * K);
    if (chunk < 1) chunk = 1;
    float* xp = aligned_alloc(64, sizeof(float) * num_blocks * ROWS_PER_BLOCK * K);
    if (xp == NULL) return -1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (N * K * T >= 65536 * 8)
    {
        /* x widened into its blocks, [K][16 rows] each, the rows past T zeros */
#pragma omp for schedule(static)
        for (int64_t blk = 0; blk < num_blocks; ++blk) {
            float* xb = xp + blk * ROWS_PER_BLOCK * K;
            for (int r = 0; r < ROWS_PER_BLOCK; ++r) {
                const int64_t t = blk * ROWS_PER_BLOCK + r;
                for (int64_t k = 0; k < K; ++k)
                    xb[k * ROWS_PER_BLOCK + r] = t < T ? bf16_value(x[t * x_st + k]) : 0.f;
            }
        }
        /* wf: the panel widened; stage: a group's sums for the chunk's rows, [rows][group's outputs], so that each
         * row of y is written once per group, 96 outputs in a run (stored one by one, the outputs took a tenth of
         * a prefill's projections) */
        const int64_t group_out = group_panels * PANEL_OUT;
        float* wf = malloc(sizeof(float) * PANEL_OUT * K);
        float* stage = malloc(sizeof(float) * (chunk < num_blocks ? chunk : num_blocks) * ROWS_PER_BLOCK * group_out);
        if (wf == NULL || stage == NULL) {
#pragma omp atomic write
            failed = 1;
        }
        for (int64_t c0 = 0; c0 < num_blocks; c0 += chunk) {
            const int64_t c1 = c0 + chunk < num_blocks ? c0 + chunk : num_blocks;
            /* nowait: a chunk's rows are not the next one's, so a thread done with its groups of this chunk goes on to
             * the next (a barrier per chunk cost 2-4 % of a 512-row projection). A thread without its buffers skips
             * the groups it takes, and the whole call fails (-1) rather than return part of y. */
#pragma omp for schedule(runtime) nowait
            for (int64_t group = 0; group < num_groups; ++group) {
                if (wf == NULL || stage == NULL) continue;
                const int64_t first = group * group_panels;
                const int64_t last = first + group_panels < num_panels ? first + group_panels : num_panels;
                for (int64_t panel = first; panel < last; ++panel) {
                    const int64_t j0 = panel * PANEL_OUT;
                    widen_panel(w, K, j0, N - j0 < PANEL_OUT ? (int)(N - j0) : PANEL_OUT, wf);
                    for (int64_t blk = c0; blk < c1; ++blk) {
                        __m256 acc[PANEL_OUT][2];
                        panel_block(wf, xp + blk * ROWS_PER_BLOCK * K, K, acc);
                        float sums[PANEL_OUT][ROWS_PER_BLOCK];
                        for (int j = 0; j < PANEL_OUT; ++j) {
                            _mm256_storeu_ps(sums[j], acc[j][0]);
                            _mm256_storeu_ps(sums[j] + 8, acc[j][1]);
                        }
                        float* rows = stage + (blk - c0) * ROWS_PER_BLOCK * group_out + (panel - first) * PANEL_OUT;
                        for (int r = 0; r < ROWS_PER_BLOCK; ++r)
                            for (int j = 0; j < PANEL_OUT; ++j) rows[r * group_out + j] = sums[j][r];
                    }
                }
                const int64_t j0 = first * PANEL_OUT, width = N - j0 < group_out ? N - j0 : group_out;
                for (int64_t t = c0 * ROWS_PER_BLOCK; t < T && t < c1 * ROWS_PER_BLOCK; ++t)
                    epilogue_row(stage + (t - c0 * ROWS_PER_BLOCK) * group_out, width, t, j0, N, b, op, o, other_st,
                                 out);
            }
        }
        free(stage);
        free(wf);
    }
    free(xp);
    return failed ? -1 : 0;
}
#endif

/* The row count from which linear_rows_avx2 runs (<= 0: from the first row); returns the one it replaced, or -1 in
 * a build without it. */
int set_linear_panel_rows(int rows) {
#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
    const int before = panel_from_rows;
    panel_from_rows = rows < 1 ? 1 : rows;
    return before;
#else
    (void)rows;
    return -1;
#endif
}

/* Whether a row-major W is taken at any row count (linear_rows_avx2), not only up to LINEAR_MAX_T. */
int linear_row_major_any_rows(void) {
#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

int linear_small(const void* x, int64_t x_st, const void* weight, const void* bias, int64_t T, int64_t K, int64_t N,
                 int op, const void* other, int64_t other_st, void* y, int num_threads) {
    const int packed = linear_weight_packed();
    if (T < 1 || K > LINEAR_MAX_K) return -1;
#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
    if (T >= panel_from_rows)
        return linear_rows_avx2((const uint16_t*)x, x_st, (const uint16_t*)weight, (const uint16_t*)bias, T, K, N, op,
                                (const uint16_t*)other, other_st, (uint16_t*)y, num_threads);
#endif
    if (!packed && T > LINEAR_MAX_T) return -1;
    if (packed && (N % 32 != 0 || K % 32 != 0)) return -1;
    /* the rows contiguous, as bf16 (the packed path's), then widened to float32 (the row-major loop's) */
    uint16_t* xb = malloc(sizeof(uint16_t) * T * K + (packed ? 0 : sizeof(float) * (T * K + 1)));
    if (xb == NULL) return -1;
    float* xf = (float*)(xb + T * K + (T * K) % 2);  /* float-aligned after the bf16 rows */
    for (int64_t t = 0; t < T; ++t) {
        memcpy(xb + t * K, (const uint16_t*)x + t * x_st, sizeof(uint16_t) * K);
        if (!packed) load_row(xb + t * K, DTYPE_BF16, K, xf + t * K);
    }
    const uint16_t* w = (const uint16_t*)weight;
    const uint16_t* b = (const uint16_t*)bias;
    const uint16_t* o = (const uint16_t*)other;
    uint16_t* out = (uint16_t*)y;
#if defined(__AVX512BF16__)
    linear_small_packed(xb, w, b, T, K, N, op, o, other_st, out, num_threads);
    (void)xf;
#else
    const int tt = (int)T;
    const int64_t num_blocks = (N + 3) / 4;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (N * K >= 65536)
    for (int64_t blk = 0; blk < num_blocks; ++blk) {
        const int64_t j0 = blk * 4;
        const int R = (int)(N - j0 < 4 ? N - j0 : 4);
        const uint16_t* wr = w + j0 * K;
        for (int t0 = 0; t0 < tt; t0 += LINEAR_TILE_T) {
            const int tn = tt - t0 < LINEAR_TILE_T ? tt - t0 : LINEAR_TILE_T;
            float sums[4][LINEAR_TILE_T];
            const float* xt = xf + t0 * K;
            const int64_t ahead = 8 * K;  /* two blocks on */
            /* A constant row count lets the compiler keep every accumulator in a register. */
            if (R < 4) dot_rows(wr, K, xt, tn, R, ahead, sums);
            else switch (tn) {
                case 1: dot_rows(wr, K, xt, 1, 4, ahead, sums); break;
                case 2: dot_rows(wr, K, xt, 2, 4, ahead, sums); break;
                case 3: dot_rows(wr, K, xt, 3, 4, ahead, sums); break;
                case 4: dot_rows(wr, K, xt, 4, 4, ahead, sums); break;
                default: dot_rows(wr, K, xt, tn, 4, ahead, sums); break;
            }
            for (int r = 0; r < R; ++r) {
                const int64_t j = j0 + r;
                const float bj = b ? bf16_value(b[j]) : 0.f;
                for (int t = t0; t < t0 + tn; ++t)
                    out[t * N + j] = to_bf16(apply_op(sums[r][t - t0] + bj, op, o, other_st, t, j));
            }
        }
    }
#endif
    free(xb);
    return 0;
}

/* The limits the Python side reads (cpu_kernels.limits()): the most rows and columns of x. */
int linear_max_rows(void) { return LINEAR_MAX_T; }
int linear_max_k(void) { return LINEAR_MAX_K; }
