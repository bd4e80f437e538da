#include "common.h"
#include "quant_formats.h"

/*
 * Weight-only quantized matmuls: y = epilogue(x W^T + bias) with W held quantized (x, y, bias and `other` bf16), for
 * a decode step's rows (linear_q4_1, linear_int8), and W widened back to bf16 for a prefill's many rows, which then
 * run the bf16 matmuls (dequantize_weight). A weight is one uint8 tensor [N, row_bytes]:
 *  - Q4_1, GGUF's blocks as llama.cpp reads them: per 32 weights 20 bytes, fp16 d, fp16 m, 16 bytes of nibbles;
 *    weight j < 16 of a block is d * (qs[j] & 15) + m, weight 16 + j is d * (qs[j] >> 4) + m. row_bytes = K / 32 * 20.
 *    Held in groups of 16 rows (the rows past the last whole group as they are): group g's block b is Q4_1_UNIT
 *    bytes at (g * K / 32 + b) * Q4_1_UNIT, the 16 rows' (d, m) as 16 dwords, then 4 vectors of 64 bytes, lane j of
 *    vector v row j's nibble bytes 4v .. 4v + 3, so that one load feeds 16 outputs' integer dot products and a block's
 *    scales are one vector (quantized_linear.group_rows).
 *  - INT8 per output channel: K int8 q, then the row's float32 scale s; weight k is s * q[k]. row_bytes = K + 4.
 *  - Q8_0, GGUF's (its token embedding, so the Q4_1 file's tied LM head): per 32 weights 34 bytes, fp16 d and 32
 *    int8 q; weight j is d * q[j]. row_bytes = K / 32 * 34.
 * Each weight is widened in registers to float32 (d * q is exact in float32, so d * q + m is one rounding whether
 * fused or not: the torch twin's dequantized weight to the bit) and met with x widened to float32, so the kernel and
 * its twin differ only in the order of the float32 sum. Two other paths, where the build has them
 * (quant_kernel_path says which runs): Q4_1 (and Q8_0 without AMX) with x quantized to int8 for integer dot
 * products (AVX512-VNNI, as llama.cpp's Q4_1 x Q8_1 and Q8_0 x Q8_0: linear_quant_vnni.c), and from a few rows,
 * every format widened to bf16 a panel at a time and met with x on AMX tiles, so the widening is paid once for all
 * the rows.
 * Work: threads share out panels of QUANT_PANEL output rows (a group of 16 rows for Q4_1 with x quantized); each
 * panel meets QUANT_TILE_T rows of x at a time, the panel's few KB of weights re-read from L1/L2 for the next tile.
 * Sums, op and rounding as in linear_small.
 */

/* QUANT_R rows of W meet QUANT_TILE_T rows of x at a time: their R x T sums stay in registers (with the R rows'
 * widened weights: 32 zmm registers with AVX-512, 16 ymm (two a sum) with AVX2). */
#if defined(__AVX512F__)
#define QUANT_R 4
#define QUANT_TILE_T 4
#else
#define QUANT_R 2
#define QUANT_TILE_T 2
#endif
#define QUANT_PANEL 16
typedef uint8_t v16u8 __attribute__((vector_size(16)));

/* 16 bytes -> 16 floats, the bytes read as uint8 or as int8, with the widest extension this build has: GCC 12 turns
 * __builtin_convertvector of bytes into one insert per lane. */
static inline v16f bytes_to_f32(v16u8 q, int is_signed) {
    v16f r;
#if defined(__AVX512F__)
    __m128i v;
    memcpy(&v, &q, sizeof v);
    const __m512 f = _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v));
    memcpy(&r, &f, sizeof r);
#elif defined(__SSE4_1__)
    __m128i v;
    memcpy(&v, &q, sizeof v);
    for (int i = 0; i < 4; ++i, v = _mm_srli_si128(v, 4)) {
        const __m128 f = _mm_cvtepi32_ps(is_signed ? _mm_cvtepi8_epi32(v) : _mm_cvtepu8_epi32(v));
        memcpy((float*)&r + 4 * i, &f, sizeof f);
    }
#else
    for (int i = 0; i < 16; ++i) r[i] = is_signed ? (float)(int8_t)q[i] : (float)q[i];
#endif
    return r;
}

static inline v16f load_i8_f32(const uint8_t* p) {  /* 16 int8 at p -> 16 floats */
    v16u8 q;
    memcpy(&q, p, sizeof q);
    return bytes_to_f32(q, 1);
}

/* Row n's block b of a Q4_1 weight of N rows: its 16 bytes of nibbles (GGUF's order) into qs, and where its fp16 d
 * and m are. */
static inline const uint8_t* q4_1_block(const uint8_t* w, int64_t N, int64_t K, int64_t n, int64_t b, v16u8* qs) {
    if (n < N / 16 * 16) {
        const uint8_t* u = q4_1_unit(w, K, n / 16, b) + 4 * (n % 16);
        for (int v = 0; v < 4; ++v) memcpy((uint8_t*)qs + 4 * v, u + 64 + 64 * v, 4);
        return u;
    }
    const uint8_t* p = w + n * quant_row_bytes(WEIGHT_Q4_1, K) + 20 * b;
    memcpy(qs, p + 4, sizeof *qs);
    return p;
}

/* How many vectors of 16 weights quant_widen gives at a time: a block of 32, or INT8's 16 (its K is a multiple). */
#define QUANT_VECTORS(format) ((format) == WEIGHT_INT8 ? 1 : 2)

/* Row n's weights k .. k + 16 * QUANT_VECTORS(format) - 1 widened to float32 into wv, 16 weights a vector (INT8's
 * without its row scale); returns where they are held, for the prefetch. always_inline so that each caller gets the
 * format as a constant. */
static inline __attribute__((always_inline)) const uint8_t* quant_widen(int format, const uint8_t* w, int64_t N,
                                                                         int64_t K, int64_t n, int64_t k, v16f* wv) {
    if (format == WEIGHT_Q4_1) {
        v16u8 qs;
        const uint8_t* dm = q4_1_block(w, N, K, n, k / 32, &qs);
        uint16_t dh, mh;
        memcpy(&dh, dm, 2);
        memcpy(&mh, dm + 2, 2);
        const float d = half_value(dh), m = half_value(mh);
        wv[0] = bytes_to_f32(qs & 15, 0) * d + m;  /* weights k .. k + 15 */
        wv[1] = bytes_to_f32(qs >> 4, 0) * d + m;  /* weights k + 16 .. k + 31 */
        return dm;
    }
    const uint8_t* row = w + n * quant_row_bytes(format, K);
    if (format == WEIGHT_Q8_0) {
        const uint8_t* blk = row + 34 * (k / 32);
        uint16_t dh;
        memcpy(&dh, blk, 2);
        const float d = half_value(dh);
        wv[0] = load_i8_f32(blk + 2) * d;
        wv[1] = load_i8_f32(blk + 18) * d;
        return blk;
    }
    wv[0] = load_i8_f32(row + k);
    return row + k;
}

static inline float int8_row_scale(const uint8_t* w, int64_t K, int64_t n) {
    float scale;
    memcpy(&scale, w + n * quant_row_bytes(WEIGHT_INT8, K) + K, sizeof scale);
    return scale;
}

/* R rows of W from row n against T rows of xf ([T, K] float32): sums[r][t] = row n + r's dot product with x row t
 * (INT8: the integer weights' dot products, times each row's scale). Several weight rows at once give the FMAs
 * independent chains (one row's sum alone waits on each FMA's latency) and share each load of x. */
static inline __attribute__((always_inline)) void quant_rows(int format, const uint8_t* w, int64_t N, int64_t n,
                                                              int64_t K, const float* xf,
                                                              float sums[QUANT_R][QUANT_TILE_T], int R, int T) {
    const int V = QUANT_VECTORS(format);
    v16f acc[QUANT_R][QUANT_TILE_T];
    for (int r = 0; r < R; ++r)
        for (int t = 0; t < T; ++t) acc[r][t] = (v16f){0};
    for (int64_t k = 0; k < K; k += 16 * V) {
        v16f wv[QUANT_R][2];
        for (int r = 0; r < R; ++r)
            __builtin_prefetch(quant_widen(format, w, N, K, n + r, k, wv[r]) + QUANT_PREFETCH, 0, 3);
        for (int t = 0; t < T; ++t) {
            const v16f x0 = load16(xf + t * K + k);
            if (V == 1) {
                for (int r = 0; r < R; ++r) acc[r][t] += wv[r][0] * x0;
            } else {
                const v16f x1 = load16(xf + t * K + k + 16);
                for (int r = 0; r < R; ++r) acc[r][t] += wv[r][0] * x0 + wv[r][1] * x1;
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        const float scale = format == WEIGHT_INT8 ? int8_row_scale(w, K, n + r) : 1.f;
        for (int t = 0; t < T; ++t) sums[r][t] = hsum16(acc[r][t]) * scale;
    }
}

/* Constant row counts let the compiler keep every accumulator in a register. */
#define DISPATCH_T(fn, R, tn, ...)                                        \
    switch (tn) {                                                         \
        case 1: fn(__VA_ARGS__, R, 1); break;                             \
        case QUANT_TILE_T: fn(__VA_ARGS__, R, QUANT_TILE_T); break;       \
        default: fn(__VA_ARGS__, R, tn); break;                           \
    }
#define DISPATCH(fn, rn, tn, ...)                                         \
    if (rn == QUANT_R) {                                                  \
        DISPATCH_T(fn, QUANT_R, tn, __VA_ARGS__)                          \
    } else {                                                              \
        DISPATCH_T(fn, rn, tn, __VA_ARGS__)                               \
    }

/* How linear_quant computes T rows of x against an [N, K] weight of `format` in this build, so that the torch twin
 * computes the same: 0, each weight widened to float32 and met with x in float32; 1, x quantized to int8 per block
 * for integer dot products (Q4_1, and Q8_0 where AMX is not: linear_quant_vnni.c); 2, each weight widened to bf16
 * and met with x on AMX tiles (the bf16 tiles path below). The bf16 tiles cost about the same at any row count up
 * to 32 (widening the weights, ~8 cycles a block of 32 here, is most of it), the other paths a pass of work per
 * row: measured at the model's shapes on two cores of an Intel Xeon, the VNNI path is the faster to 4 rows (Q4_1),
 * the float32 path to 3 (Q8_0, INT8). */
#define QUANT_AMX_ROWS_Q4_1 5
#define QUANT_AMX_ROWS 4
int quant_kernel_path(int format, int64_t T, int64_t K, int64_t N) {
    int amx = 0;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    amx = linear_amx_available();
    if (T >= (format == WEIGHT_Q4_1 ? QUANT_AMX_ROWS_Q4_1 : QUANT_AMX_ROWS) && K % 32 == 0 && N % 16 == 0 && amx) return 2;
#else
    (void)T; (void)N;
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (format == WEIGHT_Q4_1) return 1;
    /* NOTE: Q8_0 (q4_1's LM head) only where AMX is not: measured on AMD Zen 4 (2 cores) alone, where at the LM
     * head's shape it took 1.45 ms against the float32 path's 1.80 at one row, 2.6 against 4.7 at 8, 9.5 against
     * 35 at 64 (the float32 path widens every weight once per row) */
    if (format == WEIGHT_Q8_0 && !amx) return 1;
#endif
    (void)amx;
    (void)K;
    (void)format;
    return 0;
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
/*
 * The bf16 tiles path: W meets x on AMX as linear_amx does, but W is widened on the fly, a panel of 32 output rows at a
 * time, into bf16 in a buffer that stays in L1/L2 (each weight rounded once from its float32 value: the weights the
 * prefill's widened copy holds), and is read from there by every row of x. W is the tiles' A operand (16 output rows
 * of 32 k, row-major: one block of a row widens to one 64-byte tile row, no transposition) and x the B operand, packed
 * once per call in the tiles' pair-interleaved layout; the sums come out [n][t] and are transposed on the way out.
 */
/* Block b of an INT8 or Q8_0 row widened to bf16 (32 values) into dst. */
static inline void widen_block_bf16(int format, const uint8_t* row, int64_t K, int64_t b, uint16_t* dst) {
    __m512 f0, f1;
    if (format == WEIGHT_Q8_0) {
        const uint8_t* blk = row + 34 * b;
        uint16_t dh;
        memcpy(&dh, blk, 2);
        const __m512 d = _mm512_set1_ps(half_value(dh));
        f0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2)))), d);
        f1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 18)))), d);
    } else {
        float scale;
        memcpy(&scale, row + K, sizeof scale);
        const __m512 s = _mm512_set1_ps(scale);
        f0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + 32 * b)))), s);
        f1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + 32 * b + 16)))),
                           s);
    }
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));  /* nearest even, as torch */
}

/* One Q4_1 block (dm: its fp16 d and m, qs: its 16 bytes of nibbles) widened to bf16 (32 values) into dst. */
static inline void widen_q4_1_block_bf16(const uint8_t* dm, const uint8_t* qs, uint16_t* dst) {
    uint16_t dh, mh;
    memcpy(&dh, dm, 2);
    memcpy(&mh, dm + 2, 2);
    const __m512 d = _mm512_set1_ps(half_value(dh)), m = _mm512_set1_ps(half_value(mh));
    const __m128i q = _mm_loadu_si128((const __m128i*)qs), low4 = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(q, low4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), low4);
    const __m512 f0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), d, m);  /* d * q exact: one rounding */
    const __m512 f1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), d, m);
    _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(f1, f0));  /* nearest even, as torch */
}

/* Two Q4_1 blocks of a row (dm0, qs0 and dm1, qs1 as above) widened to bf16 into dst0 and dst1: the two blocks' 16
 * values each, d * q + m rounded once, as one 32-entry table that the nibbles index (a third fewer instructions than
 * widening each nibble to float32). */
static inline void widen_q4_1_pair_bf16(const uint8_t* dm0p, const uint8_t* dm1p, const uint8_t* qs0,
                                        const uint8_t* qs1, uint16_t* dst0, uint16_t* dst1) {
    int32_t dm0, dm1;
    memcpy(&dm0, dm0p, 4);
    memcpy(&dm1, dm1p, 4);
    const __m512 dm = _mm512_castps128_ps512(_mm_cvtph_ps(_mm_setr_epi32(dm0, dm1, 0, 0)));  /* d0 m0 d1 m1 */
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 t0 = _mm512_fmadd_ps(iota, _mm512_permutexvar_ps(_mm512_set1_epi32(0), dm),
                                      _mm512_permutexvar_ps(_mm512_set1_epi32(1), dm));
    const __m512 t1 = _mm512_fmadd_ps(iota, _mm512_permutexvar_ps(_mm512_set1_epi32(2), dm),
                                      _mm512_permutexvar_ps(_mm512_set1_epi32(3), dm));
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(t1, t0);  /* 0-15 block b's values, 16-31 block b + 1's */
    const __m256i qs = _mm256_loadu2_m128i((const __m128i*)qs1, (const __m128i*)qs0);
    const __m512i z = _mm512_cvtepu8_epi16(qs);  /* lanes 0-15 block b's bytes, 16-31 block b + 1's */
    const __m512i second = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(16), 1);
    const __m512i low4 = _mm512_set1_epi16(15);
    const __m512i lo = _mm512_ternarylogic_epi32(z, low4, second, 0xEA);  /* (z & 15) | second */
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(z, 4), low4, second, 0xEA);
    const __m512i wl = _mm512_permutexvar_epi16(lo, table), wh = _mm512_permutexvar_epi16(hi, table);
    _mm256_storeu_si256((__m256i*)dst0, _mm512_castsi512_si256(wl));
    _mm256_storeu_si256((__m256i*)(dst0 + 16), _mm512_castsi512_si256(wh));
    _mm256_storeu_si256((__m256i*)dst1, _mm512_extracti64x4_epi64(wl, 1));
    _mm256_storeu_si256((__m256i*)(dst1 + 16), _mm512_extracti64x4_epi64(wh, 1));
}

/* A Q4_1 unit's nibbles (4 vectors, lane j of vector v: row j's bytes 4v .. 4v + 3) back to rows: qs[16 * j + i] is
 * row j's byte i, GGUF's order. */
static inline void q4_1_unit_rows(const uint8_t* u, uint8_t* qs) {
    const __m512i v0 = _mm512_loadu_si512(u + 64), v1 = _mm512_loadu_si512(u + 128);
    const __m512i v2 = _mm512_loadu_si512(u + 192), v3 = _mm512_loadu_si512(u + 256);
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
    const __m512i a = _mm512_permutex2var_epi32(v0, first, v1), b = _mm512_permutex2var_epi32(v0, second, v1);
    const __m512i c = _mm512_permutex2var_epi32(v2, first, v3), d = _mm512_permutex2var_epi32(v2, second, v3);
    /* a: (v0[j], v1[j]) for rows 0-7, c: (v2[j], v3[j]); b and d rows 8-15 */
    const __m512i rows_lo = _mm512_setr_epi32(0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23);
    const __m512i rows_hi = _mm512_setr_epi32(8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28, 29, 14, 15, 30, 31);
    _mm512_storeu_si512(qs, _mm512_permutex2var_epi32(a, rows_lo, c));
    _mm512_storeu_si512(qs + 64, _mm512_permutex2var_epi32(a, rows_hi, c));
    _mm512_storeu_si512(qs + 128, _mm512_permutex2var_epi32(b, rows_lo, d));
    _mm512_storeu_si512(qs + 192, _mm512_permutex2var_epi32(b, rows_hi, d));
}

static int linear_quant_amx(int format, const void* x, int64_t x_st, const uint8_t* w, const uint16_t* b, int64_t T,
                            int64_t K, int64_t N, int op, const uint16_t* o, int64_t other_st, uint16_t* out,
                            int num_threads) {
    const int64_t KB = K / 32, TT = (T + 15) / 16;  /* x's tiles: TT groups of 16 rows, KB of 32 k */
    /* xp [TT][KB][16 pairs of k][16 t][2], zero rows past T */
    uint16_t* xp = scratch(0, (size_t)(TT * KB * 512 * sizeof(uint16_t)));
    if (xp == NULL) return -1;
    memset(xp, 0, (size_t)(TT * KB * 512 * sizeof(uint16_t)));
    for (int64_t t = 0; t < T; ++t) {
        const uint16_t* src = (const uint16_t*)x + t * x_st;
        uint32_t* dst = (uint32_t*)xp + (t / 16) * KB * 256 + t % 16;
        for (int64_t kp = 0; kp < K / 2; ++kp) memcpy(dst + (kp / 16) * 256 + (kp % 16) * 16, src + 2 * kp, 4);
    }
    const int64_t row_bytes = quant_row_bytes(format, K), num_panels = (N + 31) / 32;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) if (N * K >= 65536)
    {
        /* the panel widened: [KB][2 tiles][16 rows][32 k] bf16 */
        uint16_t* panel = scratch(1, (size_t)(KB * 1024 * sizeof(uint16_t)));
        if (panel == NULL) {
#pragma omp atomic write
            failed = 1;
        } else {
            load_tile_config();  /* 0-3 sums, 4-5 W, 6-7 x */
            float acc[16 * 16], acc_t[16 * 16];
#pragma omp for schedule(static)
            for (int64_t np = 0; np < num_panels; ++np) {
                const int64_t n0 = 32 * np, halves = N - n0 >= 32 ? 2 : 1;  /* N % 16 == 0 */
                /* NOTE: kb outer: the panel is written in order; the next panel's weights are requested as far
                 * along, so that they are here while this one is widened */
                if (format == WEIGHT_Q4_1) {
                    for (int64_t kb = 0; kb < KB; kb += 2) {  /* a group's blocks two at a time */
                        const int pair = kb + 1 < KB;
                        for (int64_t h = 0; h < halves; ++h) {
                            const uint8_t* u = q4_1_unit(w, K, n0 / 16 + h, kb);
                            for (int line = 0; line < 2 * Q4_1_UNIT; line += 64)
                                __builtin_prefetch(q4_1_unit(w, K, n0 / 16 + h + 2, kb) + line, 0, 3);
                            uint8_t qs[2][256];
                            q4_1_unit_rows(u, qs[0]);
                            if (pair) q4_1_unit_rows(u + Q4_1_UNIT, qs[1]);
                            for (int r = 0; r < 16; ++r) {
                                uint16_t* dst = panel + kb * 1024 + (16 * h + r) * 32;
                                if (pair)
                                    widen_q4_1_pair_bf16(u + 4 * r, u + Q4_1_UNIT + 4 * r, qs[0] + 16 * r,
                                                         qs[1] + 16 * r, dst, dst + 1024);
                                else
                                    widen_q4_1_block_bf16(u + 4 * r, qs[0] + 16 * r, dst);
                            }
                        }
                    }
                } else {
                    for (int64_t kb = 0; kb < KB; ++kb) {
                        const int64_t block_bytes = format == WEIGHT_Q8_0 ? 34 : 32;
                        for (int64_t r = 0; r < 32; ++r)
                            __builtin_prefetch(w + (n0 + 32 + r) * row_bytes + block_bytes * kb, 0, 3);
                        for (int64_t r = 0; r < 16 * halves; ++r)
                            widen_block_bf16(format, w + (n0 + r) * row_bytes, K, kb, panel + kb * 1024 + r * 32);
                    }
                }
                for (int64_t tt = 0; tt < TT; tt += 2) {
                    const int two = tt + 1 < TT;
                    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                    for (int64_t kb = 0; kb < KB; ++kb) {
                        _tile_loadd(4, panel + kb * 1024, 64);
                        _tile_loadd(6, xp + (tt * KB + kb) * 512, 64);
                        _tile_dpbf16ps(0, 4, 6);
                        if (halves == 2) {
                            _tile_loadd(5, panel + kb * 1024 + 512, 64);
                            _tile_dpbf16ps(1, 5, 6);
                        }
                        if (two) {
                            _tile_loadd(7, xp + ((tt + 1) * KB + kb) * 512, 64);
                            _tile_dpbf16ps(2, 4, 7);
                            if (halves == 2) _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    for (int q = 0; q < 4; ++q) {  /* q: outputs n0 + 16 (q % 2), rows 16 (tt + q / 2) */
                        const int64_t t0 = 16 * (tt + q / 2), rows = T - t0 < 16 ? T - t0 : 16;
                        if (q % 2 >= halves || rows <= 0) continue;
                        switch (q) {  /* tile numbers must be constants */
                            case 0: _tile_stored(0, acc, 64); break;
                            case 1: _tile_stored(1, acc, 64); break;
                            case 2: _tile_stored(2, acc, 64); break;
                            default: _tile_stored(3, acc, 64); break;
                        }
                        for (int64_t t = 0; t < rows; ++t)  /* [n][t] -> [t][n] */
                            for (int j = 0; j < 16; ++j) acc_t[t * 16 + j] = acc[j * 16 + t];
                        linear_epilogue16(acc_t, t0, rows, n0 + 16 * (q % 2), N, b, op, o, other_st, out);
                    }
                }
            }
            _tile_release();
        }
    }
    return failed ? -1 : 0;
}
#endif

static int linear_quant(int format, const void* x, int64_t x_st, const void* weight, const void* bias, int64_t T,
                        int64_t K, int64_t N, int op, const void* other, int64_t other_st, void* y,
                        int num_threads) {
    if (T < 1 || K < 1 || K > LINEAR_MAX_K || K % quant_block(format) != 0) return -1;
    const int path = quant_kernel_path(format, T, K, N);
    (void)path;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
    if (path == 2)
        return linear_quant_amx(format, x, x_st, (const uint8_t*)weight, (const uint16_t*)bias, T, K, N, op,
                                (const uint16_t*)other, other_st, (uint16_t*)y, num_threads);
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if (path == 1)
        return linear_quant_vnni(format, x, x_st, (const uint8_t*)weight, (const uint16_t*)bias, T, K, N, op,
                                 (const uint16_t*)other, other_st, (uint16_t*)y, num_threads);
#endif
    float* xf = malloc(sizeof(float) * T * K);
    if (xf == NULL) return -1;
    for (int64_t t = 0; t < T; ++t) load_row((const uint16_t*)x + t * x_st, DTYPE_BF16, K, xf + t * K);
    const uint8_t* w = (const uint8_t*)weight;
    const uint16_t* b = (const uint16_t*)bias;
    const uint16_t* o = (const uint16_t*)other;
    uint16_t* out = (uint16_t*)y;
    const int64_t num_panels = (N + QUANT_PANEL - 1) / QUANT_PANEL;
    /* Small projections are not worth waking the other threads for. */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (N * K >= 65536)
    for (int64_t panel = 0; panel < num_panels; ++panel) {
        const int64_t n0 = panel * QUANT_PANEL, n1 = n0 + QUANT_PANEL < N ? n0 + QUANT_PANEL : N;
        for (int64_t t0 = 0; t0 < T; t0 += QUANT_TILE_T) {
            const int tn = T - t0 < QUANT_TILE_T ? (int)(T - t0) : QUANT_TILE_T;
            const float* xt = xf + t0 * K;
            for (int64_t n = n0; n < n1; n += QUANT_R) {
                const int rn = n1 - n < QUANT_R ? (int)(n1 - n) : QUANT_R;
                float sums[QUANT_R][QUANT_TILE_T];
                if (format == WEIGHT_Q4_1) {
                    DISPATCH(quant_rows, rn, tn, WEIGHT_Q4_1, w, N, n, K, xt, sums)
                } else if (format == WEIGHT_Q8_0) {
                    DISPATCH(quant_rows, rn, tn, WEIGHT_Q8_0, w, N, n, K, xt, sums)
                } else {
                    DISPATCH(quant_rows, rn, tn, WEIGHT_INT8, w, N, n, K, xt, sums)
                }
                for (int r = 0; r < rn; ++r) {
                    const float bn = b ? bf16_value(b[n + r]) : 0.f;
                    for (int t = 0; t < tn; ++t)
                        out[(t0 + t) * N + n + r] = to_bf16(apply_op(sums[r][t] + bn, op, o, other_st,
                                                                     (int)(t0 + t), n + r));
                }
            }
        }
    }
    free(xf);
    return 0;
}

/* linear_small's arguments, W one Q4_1 weight ([N, K / 32 * 20] bytes). Returns 0, or -1 if it cannot take them. */
int linear_q4_1(const void* x, int64_t x_st, const void* weight, const void* bias, int64_t T, int64_t K, int64_t N,
                int op, const void* other, int64_t other_st, void* y, int num_threads) {
    return linear_quant(WEIGHT_Q4_1, x, x_st, weight, bias, T, K, N, op, other, other_st, y, num_threads);
}

/* linear_small's arguments, W one Q8_0 weight ([N, K / 32 * 34] bytes). */
int linear_q8_0(const void* x, int64_t x_st, const void* weight, const void* bias, int64_t T, int64_t K, int64_t N,
                int op, const void* other, int64_t other_st, void* y, int num_threads) {
    return linear_quant(WEIGHT_Q8_0, x, x_st, weight, bias, T, K, N, op, other, other_st, y, num_threads);
}

/* linear_small's arguments, W one INT8 weight ([N, K + 4] bytes). */
int linear_int8(const void* x, int64_t x_st, const void* weight, const void* bias, int64_t T, int64_t K, int64_t N,
                int op, const void* other, int64_t other_st, void* y, int num_threads) {
    return linear_quant(WEIGHT_INT8, x, x_st, weight, bias, T, K, N, op, other, other_st, y, num_threads);
}

static inline void store16_bf16(uint16_t* p, v16f f) {  /* round to nearest even, as torch */
    v16u u;
    memcpy(&u, &f, sizeof u);
    u = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    const v16u16 h = __builtin_convertvector(u, v16u16);
    memcpy(p, &h, sizeof h);
}

/* Row n of W widened to bf16 into dst, each weight rounded once from its float32 value. */
static inline __attribute__((always_inline)) void dequantize_row(int format, const uint8_t* w, int64_t N, int64_t K,
                                                                  int64_t n, uint16_t* dst) {
    const float scale = format == WEIGHT_INT8 ? int8_row_scale(w, K, n) : 1.f;
    for (int64_t k = 0; k < K; k += 16 * QUANT_VECTORS(format)) {
        v16f wv[2];
        quant_widen(format, w, N, K, n, k, wv);
        for (int v = 0; v < QUANT_VECTORS(format); ++v) store16_bf16(dst + k + 16 * v, wv[v] * scale);
    }
}

/* W [N, row_bytes] (format 1 Q4_1, 2 INT8, 3 Q8_0) -> out [N, K] bf16 row-major, each weight rounded once from its float32
 * value. Returns 0, or -1 for a K the format does not take. */
int dequantize_weight(int format, const void* weight, int64_t N, int64_t K, void* out, int num_threads) {
    if (K < 1 || format < WEIGHT_Q4_1 || format > WEIGHT_Q8_0 || K % quant_block(format) != 0) return -1;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (N * K >= 65536)
    for (int64_t n = 0; n < N; ++n) {
        uint16_t* dst = (uint16_t*)out + n * K;
        if (format == WEIGHT_Q4_1) dequantize_row(WEIGHT_Q4_1, weight, N, K, n, dst);
        else if (format == WEIGHT_Q8_0) dequantize_row(WEIGHT_Q8_0, weight, N, K, n, dst);
        else dequantize_row(WEIGHT_INT8, weight, N, K, n, dst);
    }
    return 0;
}
