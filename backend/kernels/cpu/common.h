/*
 * What the CPU kernels share: dtype codes, the limits each kernel exports, row loads and stores with bf16
 * rounding, vector helpers, and the exported functions that other kernels call (decode_stack calls them all).
 *
 * Every kernel is a C twin of a torch operation (same inputs, same result within float rounding);
 * backend/kernels/cpu_kernels.py compiles the files of this folder into one shared library at first use
 * (-O3 -march=native -ffast-math) and loads it with ctypes. Work is spread over torch's own OpenMP threads: the
 * library's libgomp.so.1 resolves to the copy torch loaded. Arithmetic is float32; bf16 inputs are widened on load
 * and outputs rounded to nearest even, as torch does.
 */
#ifndef CPU_KERNELS_COMMON_H
#define CPU_KERNELS_COMMON_H

#include <float.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16        /* query heads per KV head (attention) */
#define MAX_HEADS 64        /* query heads one attention work item may hold (a whole sequence) */
#define MAX_HEAD_DIM 256    /* attention */
#define MAX_ROW 16384       /* hidden size (rms_norm) */
#define LINEAR_MAX_T 64     /* rows of x (linear_small, and so decode_stack) */
#define LINEAR_MAX_K 16384  /* columns of x (linear_small, linear_amx) */

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1 };

static inline void load_row(const void* src, int dtype, int64_t n, float* dst) {
    if (dtype == DTYPE_BF16) {
        const uint16_t* p = (const uint16_t*)src;
        for (int64_t i = 0; i < n; ++i) {
            union { uint32_t u; float f; } v = {.u = (uint32_t)p[i] << 16};  /* bf16 is a truncated float32 */
            dst[i] = v.f;
        }
    } else {
        const float* p = (const float*)src;
        for (int64_t i = 0; i < n; ++i) dst[i] = p[i];
    }
}

static inline float round_to(float f, int dtype) {  /* the value the dtype would hold */
    if (dtype != DTYPE_BF16) return f;
    union { uint32_t u; float f; } v = {.f = f};
    v.u = (v.u + 0x7FFFu + ((v.u >> 16) & 1u)) & 0xFFFF0000u;
    return v.f;
}

static inline void store_row(void* dst, int dtype, int64_t n, const float* src, float factor) {
    if (dtype == DTYPE_BF16) {
        uint16_t* p = (uint16_t*)dst;
        for (int64_t i = 0; i < n; ++i) {
            union { uint32_t u; float f; } v = {.f = src[i] * factor};
            p[i] = (uint16_t)((v.u + 0x7FFFu + ((v.u >> 16) & 1u)) >> 16);  /* round to nearest even, as torch */
        }
    } else {
        float* p = (float*)dst;
        for (int64_t i = 0; i < n; ++i) p[i] = src[i] * factor;
    }
}

typedef float v16f __attribute__((vector_size(64)));

static inline v16f load16(const float* p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float* p, v16f v) { memcpy(p, &v, sizeof v); }

/* Helpers of the matmuls (linear_small, linear_quant). */
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

static inline float apply_op(float v, int op, const uint16_t* other, int64_t other_st, int t, int64_t j) {
    switch (op) {
        case 1: return v / (1.f + expf(-v));
        case 2: return v * bf16_value(other[t * other_st + j]);
        case 3: return v + bf16_value(other[t * other_st + j]);
        default: return v;
    }
}

#if defined(__AVX512F__)
/* e^e for 16 e in [-127, 0]: e = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so that n ln2 is exact), e^r by
 * its Taylor series to r^7 (truncation below 1e-8 relative), scaled by 2^n. Within 0.9 ulp of e^e over [-87, 0], at a
 * third of libmvec's cost here. */
static inline __m512 exp16(__m512 e) {
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(e, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), e);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 5040.f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* 8 bf16 -> 8 floats */
static inline __m256 widen8_bf16(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

/* e^e for 8 e in [-87, 88], as exp16 does it for 16: e = n ln2 + r, e^r by its Taylor series to r^7, 2^n put into
 * the exponent. */
static inline __m256 exp8(__m256 e) {
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(e, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), e);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.f / 5040.f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 720.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

/* 8 floats rounded to bf16 (nearest even, as torch) and stored */
static inline void store8_bf16(uint16_t* dst, __m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i h = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd), 16);
    _mm_storeu_si128((__m128i*)dst, _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}
#endif

#if defined(__AVX512BF16__)
static inline __m512 widen16_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

/* The matmuls' way out: rows [t0, t0 + rows) x columns [j0, j0 + 16) of y from the float32 sums in acc (16 floats a
 * row): the bias, the op (see linear_small) and one rounding to bf16, 16 floats at a time. */
static inline void linear_epilogue16(const float* acc, int64_t t0, int64_t rows, int64_t j0, int64_t N,
                                     const uint16_t* b, int op, const uint16_t* other, int64_t other_st,
                                     uint16_t* out) {
    const __m512 bias = b ? widen16_bf16(b + j0) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = t0 + r;
        __m512 v = _mm512_add_ps(_mm512_loadu_ps(acc + 16 * r), bias);
        if (op == 1) {  /* silu: v / (1 + e^-v), the exponent kept where exp16 is exact */
            const __m512 e = _mm512_min_ps(_mm512_max_ps(_mm512_sub_ps(_mm512_setzero_ps(), v),
                                                         _mm512_set1_ps(-127.f)), _mm512_set1_ps(88.f));
            v = _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(e)));
        } else if (op == 2) {
            v = _mm512_mul_ps(v, widen16_bf16(other + t * other_st + j0));
        } else if (op == 3) {
            v = _mm512_add_ps(v, widen16_bf16(other + t * other_st + j0));
        }
        _mm256_storeu_si256((__m256i*)(out + t * N + j0), (__m256i)_mm512_cvtneps_pbh(v));  /* nearest even */
    }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
/* The AMX matmuls' tiles (linear_amx, linear_quant's bf16 tiles): all eight 16 rows of 64 bytes. */
typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static inline void load_tile_config(void) {
    tile_config cfg = {0};
    cfg.palette = 1;
    for (int i = 0; i < 8; ++i) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }
    _tile_loadconfig(&cfg);
}
#endif

/* The exported kernels other files call. */
int linear_amx_available(void);
void rope_paged_attention(void* qkv, int64_t qkv_st, int64_t T, const int64_t* positions, const void* cos,
                          const void* sin_signed, const int64_t* slots, void* k_cache, void* v_cache, int64_t c_sb,
                          int64_t c_ss, int64_t c_sh, int64_t num_decodes, const int32_t* block_tables, int64_t bt_sb,
                          const int32_t* context_lens, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                          float scale, int64_t max_context, void* out, int64_t o_sb, int64_t o_sh, int dtype,
                          int num_threads);
void rms_norm(const void* x, int64_t x_st, const void* weight, void* out, int64_t T, int64_t D, float eps, int dtype,
              int num_threads);
int linear_small(const void* x, int64_t x_st, const void* weight, const void* bias, int64_t T, int64_t K, int64_t N,
                 int op, const void* other, int64_t other_st, void* y, int num_threads);
int linear_q4_1(const void* x, int64_t x_st, const void* weight, const void* bias, int64_t T, int64_t K, int64_t N,
                int op, const void* other, int64_t other_st, void* y, int num_threads);
int linear_int8(const void* x, int64_t x_st, const void* weight, const void* bias, int64_t T, int64_t K, int64_t N,
                int op, const void* other, int64_t other_st, void* y, int num_threads);
int linear_amx(const void* x, int64_t x_st, const void* weight, const void* bias, int64_t T, int64_t K, int64_t N,
               int op, const void* other, int64_t other_st, void* y, int num_threads);

#endif
