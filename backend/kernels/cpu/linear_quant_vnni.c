#include "quant_formats.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
/*
 * The integer dot products (x_int8), as llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0: each block of 32 x is quantized to
 * int8 (dx = amax / 127, q = round-to-nearest-even(x / dx)) and its sum kept (sx = dx * sum(q)); a block's dot
 * product is then d dx sum(q_w q_x) (+ m sx for Q4_1), the integer sum from vpdpbusd (the weights unsigned, x
 * signed). A group of 16 rows at a time, one row a 32-bit lane: each 64-byte vector of a block holds 4 bytes of
 * every row's, met by x's 4 matching bytes broadcast to every lane, and a block's scales (and mins) are one vector
 * each. The integers are exact; what differs from the twin is the float order of the per-block terms.
 * NOTE: VNNI_TILE_T rows of x meet each block while it is in registers: at 4 (the earlier tile) the 8 to 64 rows
 * of a batched decode step on AMD Zen 4 re-read and re-unpacked every block so often that Q4_1 ran slower than
 * bf16's vdpbf16ps (linear_small); at 8 each row's sums are one register, 8 + 10 of the 32.
 */
#define VNNI_TILE_T 8
/* NOTE: where AMX is not, the weights are requested into L2 (prefetcht1) further ahead than the Intel-tuned
 * QUANT_PREFETCH into L1 (kept where AMX is): on AMD Zen 4 (2 cores) a step's Q4_1 projections at one row then took
 * ~12 % less and the Q8_0 LM head (three groups of rows ahead) ~30 % less, near the cores' streaming bandwidth. */
#define VNNI_PREFETCH_L2 8192
#define Q8_0_PREFETCH_GROUPS 3

/* Q4_1: a group's block is a Q4_1 unit (its nibbles' low halves meet x's bytes 4v .., the high halves 16 + 4v ..). */
static inline __attribute__((always_inline)) void q4_1_group_vnni(const uint8_t* u, int64_t nb, int64_t K,
                                                                   const int8_t* xq, const float* xd, const float* xs,
                                                                   int to_l2, __m512 sums[VNNI_TILE_T], int T) {
    for (int t = 0; t < T; ++t) sums[t] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(15);
    for (int64_t b = 0; b < nb; ++b, u += Q4_1_UNIT) {
        for (int line = 0; line < Q4_1_UNIT; line += 64) {
            if (to_l2) _mm_prefetch((const char*)u + VNNI_PREFETCH_L2 + line, _MM_HINT_T1);
            else _mm_prefetch((const char*)u + QUANT_PREFETCH + line, _MM_HINT_T0);
        }
        const __m512i dm = _mm512_loadu_si512(u);  /* row j's fp16 d in the low half of lane j, its m in the high */
        const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
        const __m512 m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
        __m512i lo[4], hi[4];
        for (int v = 0; v < 4; ++v) {
            const __m512i q = _mm512_loadu_si512(u + 64 + 64 * v);
            lo[v] = _mm512_and_si512(q, low4);
            hi[v] = _mm512_and_si512(_mm512_srli_epi16(q, 4), low4);
        }
        for (int t = 0; t < T; ++t) {
            const int8_t* xb = xq + t * K + 32 * b;
            __m512i s_lo = _mm512_setzero_si512(), s_hi = _mm512_setzero_si512();
            for (int v = 0; v < 4; ++v) {
                int32_t x_lo, x_hi;
                memcpy(&x_lo, xb + 4 * v, 4);
                memcpy(&x_hi, xb + 16 + 4 * v, 4);
                s_lo = _mm512_dpbusd_epi32(s_lo, lo[v], _mm512_set1_epi32(x_lo));
                s_hi = _mm512_dpbusd_epi32(s_hi, hi[v], _mm512_set1_epi32(x_hi));
            }
            const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(xd[t * nb + b]));
            sums[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s_lo, s_hi)), scale, sums[t]);
            sums[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[t * nb + b]), sums[t]);
        }
    }
}

/*
 * Q8_0 is held a row at a time (GGUF's; the AMX path and the embedding's lookup read it so), so each block of a group
 * of 16 rows is transposed into the lane layout: the rows' d as 16 float32, and 8 vectors of 64 bytes, lane j of
 * vector v row j's bytes 4v .. 4v + 3, each plus 128 (vpdpbusd takes the weights unsigned; the sum then holds
 * 128 sum(q_x) too, which starts it negated). Up to VNNI_TILE_T rows of x meet each block as it is transposed; more
 * meet a thread's buffer of the group's blocks (Q8_0_UNIT bytes each, in L1 at the LM head's K), so that the
 * transposition is paid once for every tile of rows.
 */
#define Q8_0_UNIT 576
static inline __attribute__((always_inline)) void q8_0_block_lanes(const uint8_t* w, int64_t row_bytes, int64_t b,
                                                                    __m512* d, __m512i q[8]) {
    const __m512i rows_at = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                               _mm512_set1_epi32((int)row_bytes));
    const __m512i offset = _mm512_set1_epi8((char)0x80);
    const uint8_t* blk = w + 34 * b;
    for (int line = 0; line < 16 * 34; line += 64)  /* a group (contiguous) some groups on, as far along */
        _mm_prefetch((const char*)w + Q8_0_PREFETCH_GROUPS * 16 * row_bytes + 16 * 34 * b + line, _MM_HINT_T1);
    const __m512i dh = _mm512_i32gather_epi32(rows_at, blk, 1);  /* row j's fp16 d in the low half of lane j */
    *d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dh));
    /* z[i]: rows r and r + 4 (r = i, or i + 4 from i = 4), so that the 8 x 8 dword transposes of the two 256-bit
     * halves, shuffled at the end, come out one row a lane in order */
    __m512i z[8], t[8], u[8];
    for (int i = 0; i < 8; ++i) {
        const int64_t r = i < 4 ? i : i + 4;
        z[i] = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(blk + r * row_bytes + 2))),
            _mm256_loadu_si256((const __m256i*)(blk + (r + 4) * row_bytes + 2)), 1);
    }
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm512_unpacklo_epi32(z[i], z[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(z[i], z[i + 1]);
    }
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; ++h) {
            u[i + h] = _mm512_unpacklo_epi64(t[i + h], t[i + h + 2]);
            u[i + h + 2] = _mm512_unpackhi_epi64(t[i + h], t[i + h + 2]);
        }
    /* u[0..3]: dwords 0, 2, 1, 3 (and + 4 in each chunk's other half) of rows from z[0..3]; u[4..7] of z[4..7] */
    static const int dword_of[4] = {0, 2, 1, 3};
    for (int i = 0; i < 4; ++i) {
        q[dword_of[i]] = _mm512_xor_si512(_mm512_shuffle_i64x2(u[i], u[i + 4], 0x88), offset);  /* chunks 0, 2 */
        q[dword_of[i] + 4] = _mm512_xor_si512(_mm512_shuffle_i64x2(u[i], u[i + 4], 0xDD), offset);  /* 1, 3 */
    }
}

static void q8_0_transpose_group(const uint8_t* w, int64_t row_bytes, int64_t nb, uint8_t* units) {
    for (int64_t b = 0; b < nb; ++b, units += Q8_0_UNIT) {
        __m512 d;
        __m512i q[8];
        q8_0_block_lanes(w, row_bytes, b, &d, q);
        _mm512_storeu_ps(units, d);
        for (int v = 0; v < 8; ++v) _mm512_storeu_si512(units + 64 + 64 * v, q[v]);
    }
}

/* The group's blocks from `units` (q8_0_transpose_group's), or transposed here from its rows (w) where NULL. */
static inline __attribute__((always_inline)) void q8_0_group_vnni(const uint8_t* units, const uint8_t* w,
                                                                   int64_t row_bytes, int64_t nb, int64_t K,
                                                                   const int8_t* xq, const float* xd,
                                                                   const int32_t* xsum, __m512 sums[VNNI_TILE_T],
                                                                   int T) {
    for (int t = 0; t < T; ++t) sums[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512 d;
        __m512i q[8];
        if (units == NULL) {
            q8_0_block_lanes(w, row_bytes, b, &d, q);
        } else {
            d = _mm512_loadu_ps(units + b * Q8_0_UNIT);
            for (int v = 0; v < 8; ++v) q[v] = _mm512_loadu_si512(units + b * Q8_0_UNIT + 64 + 64 * v);
        }
        for (int t = 0; t < T; ++t) {
            const int8_t* xb = xq + t * K + 32 * b;
            __m512i s = _mm512_set1_epi32(-128 * xsum[t * nb + b]);
            for (int v = 0; v < 8; ++v) {
                int32_t xv;
                memcpy(&xv, xb + 4 * v, 4);
                s = _mm512_dpbusd_epi32(s, q[v], _mm512_set1_epi32(xv));
            }
            sums[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(xd[t * nb + b])),
                                      sums[t]);
        }
    }
}

/* Row t of x [T, K] bf16 -> xq [T, K] int8, and per block dx (xd [T, K / 32]), dx * sum(q) (xs) and sum(q) (xsum).
 * NOTE: without -ffast-math, so that dx, 1 / dx and each q are the float operations the torch twin does (fast-math
 * folds 1 / (amax / 127) into 127 / amax); vectorised by hand (a 64-row step's x, quantized one value at a time,
 * cost about as much as the matmuls). */
__attribute__((optimize("no-fast-math"))) static void quantize_x_q8_row(const void* x, int64_t x_st, int64_t t,
                                                                         int64_t K, int8_t* xq, float* xd, float* xs,
                                                                         int32_t* xsum) {
    const int64_t nb = K / 32;
    const uint16_t* src = (const uint16_t*)x + t * x_st;
    for (int64_t b = 0; b < nb; ++b) {
        const __m256i raw0 = _mm256_loadu_si256((const __m256i*)(src + 32 * b));  /* bf16: a truncated float32 */
        const __m256i raw1 = _mm256_loadu_si256((const __m256i*)(src + 32 * b + 16));
        const __m512 x0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw0), 16));
        const __m512 x1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw1), 16));
        const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float d = amax * (1.f / 127.f);
        const __m512 id = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
        /* nearest even, as torch.round; |q| <= 127, so the narrowing to int8 is exact */
        const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, id)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, id));
        _mm_storeu_si128((__m128i*)(xq + t * K + 32 * b), _mm512_cvtepi32_epi8(q0));
        _mm_storeu_si128((__m128i*)(xq + t * K + 32 * b + 16), _mm512_cvtepi32_epi8(q1));
        const int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
        xd[t * nb + b] = d;
        xs[t * nb + b] = d * (float)sum;
        xsum[t * nb + b] = sum;
    }
}

/* Row t of x against a row past the last whole group of 16 (as it is held: GGUF's). NOTE: not vectorised: GCC 12
 * turned Q8_0's int8 x int8 sum into vpdpbusd, which reads one side unsigned. */
__attribute__((optimize("no-tree-vectorize"))) static float row_vnni(int format, const uint8_t* row, int64_t K,
                                                                     const int8_t* xq, const float* xd,
                                                                     const float* xs) {
    float acc = 0.f;
    for (int64_t b = 0; b < K / 32; ++b) {
        const uint8_t* p = row + (format == WEIGHT_Q4_1 ? 20 : 34) * b;
        uint16_t dh, mh;
        memcpy(&dh, p, 2);
        memcpy(&mh, p + 2, 2);
        int32_t dot = 0;
        if (format == WEIGHT_Q4_1) {
            for (int i = 0; i < 16; ++i)
                dot += (p[4 + i] & 15) * xq[32 * b + i] + (p[4 + i] >> 4) * xq[32 * b + 16 + i];
            acc += half_value(dh) * xd[b] * (float)dot + half_value(mh) * xs[b];
        } else {
            for (int i = 0; i < 32; ++i) dot += (int8_t)p[2 + i] * xq[32 * b + i];
            acc += half_value(dh) * xd[b] * (float)dot;
        }
    }
    return acc;
}

/* Q4_1 or Q8_0 with x quantized to int8: threads share out the groups of 16 rows (and the rows past the last). */
int linear_quant_vnni(int format, const void* x, int64_t x_st, const uint8_t* w, const uint16_t* b, int64_t T,
                      int64_t K, int64_t N, int op, const uint16_t* o, int64_t other_st, uint16_t* out,
                      int num_threads) {
    const int64_t nb = K / 32, num_groups = N / 16, row_bytes = quant_row_bytes(format, K);
    const int to_l2 = !linear_amx_available();
    int8_t* xq = malloc(T * K + (sizeof(float) * 2 + sizeof(int32_t)) * T * nb + 64);
    if (xq == NULL) return -1;
    float* xd = (float*)(xq + ((T * K + 63) & ~(int64_t)63));
    float* xs = xd + T * nb;
    int32_t* xsum = (int32_t*)(xs + T * nb);
    /* NOTE: on the calling thread, before the threads start: shared out, it cost a barrier (the threads waited for
     * each other's rows of x), and on 2 cores shared with other processes a barrier waits for a descheduled thread */
    for (int64_t t = 0; t < T; ++t) quantize_x_q8_row(x, x_st, t, K, xq, xd, xs, xsum);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (N * K >= 65536)
    {
    /* one item per group, and one for the rows past the last group where there are any. NOTE: an empty last item
     * still counted in the static share-out: at the model's 36 groups (576 outputs) one thread took 19, the other 17 */
#pragma omp for schedule(static)
    for (int64_t g = 0; g < num_groups + (N % 16 != 0); ++g) {
        if (g == num_groups) {
            for (int64_t n = 16 * num_groups; n < N; ++n)
                for (int64_t t = 0; t < T; ++t) {
                    const float sum = row_vnni(format, w + n * row_bytes, K, xq + t * K, xd + t * nb, xs + t * nb);
                    out[t * N + n] = to_bf16(apply_op(sum + (b ? bf16_value(b[n]) : 0.f), op, o, other_st, (int)t, n));
                }
            continue;
        }
        const uint8_t* u = q4_1_unit(w, K, g, 0);
        const uint8_t* rows = w + 16 * g * row_bytes;  /* Q8_0's */
        uint8_t* units = NULL;
        if (format == WEIGHT_Q8_0 && T > VNNI_TILE_T) {
            units = scratch(0, (size_t)(nb * Q8_0_UNIT));
            if (units == NULL) {
#pragma omp atomic write
                failed = 1;
                continue;
            }
            q8_0_transpose_group(rows, row_bytes, nb, units);
        }
        for (int64_t t0 = 0; t0 < T; t0 += VNNI_TILE_T) {
            const int tn = T - t0 < VNNI_TILE_T ? (int)(T - t0) : VNNI_TILE_T;
            const int8_t* xt = xq + t0 * K;
            const float *dt = xd + t0 * nb, *st = xs + t0 * nb;
            __m512 sums[VNNI_TILE_T];
            /* constant row counts keep every accumulator in a register */
#define VNNI_GROUP(T_)                                                                                  \
    if (format == WEIGHT_Q8_0) q8_0_group_vnni(units, rows, row_bytes, nb, K, xt, dt, xsum + t0 * nb, sums, T_); \
    else q4_1_group_vnni(u, nb, K, xt, dt, st, to_l2, sums, T_);                                        \
    break;
            switch (tn) {
                case 1: VNNI_GROUP(1)
                case 2: VNNI_GROUP(2)
                case 3: VNNI_GROUP(3)
                case 4: VNNI_GROUP(4)
                case 5: VNNI_GROUP(5)
                case 6: VNNI_GROUP(6)
                case 7: VNNI_GROUP(7)
                default: VNNI_GROUP(VNNI_TILE_T)
            }
#undef VNNI_GROUP
            float acc[16 * VNNI_TILE_T];
            for (int t = 0; t < tn; ++t) _mm512_storeu_ps(acc + 16 * t, sums[t]);
#if defined(__AVX512BF16__)
            linear_epilogue16(acc, t0, tn, 16 * g, N, b, op, o, other_st, out);
#else
            for (int t = 0; t < tn; ++t)
                for (int j = 0; j < 16; ++j) {
                    const int64_t n = 16 * g + j;
                    out[(t0 + t) * N + n] = to_bf16(apply_op(acc[16 * t + j] + (b ? bf16_value(b[n]) : 0.f), op, o,
                                                             other_st, (int)(t0 + t), n));
                }
#endif
        }
    }
    }
    free(xq);
    return failed ? -1 : 0;
}
#endif

