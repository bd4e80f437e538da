/*
 * What linear_quant.c (the quantized formats' float32 and AMX paths) and linear_quant_vnni.c (their integer dot
 * products) share: the formats' codes and byte layouts (linear_quant.c says what each holds), fp16 widening, the
 * weights' prefetch distance, a thread's scratch buffers.
 */
#ifndef CPU_KERNELS_QUANT_FORMATS_H
#define CPU_KERNELS_QUANT_FORMATS_H

#include "common.h"
#if (defined(__F16C__) || defined(__SSE4_1__)) && !defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { WEIGHT_Q4_1 = 1, WEIGHT_INT8 = 2, WEIGHT_Q8_0 = 3 };

/* NOTE: a decode step's quantized weights (~100 MB for SmolLM2-135M in Q4_1) outgrow the share of L3 a core gets here
 * (~50 MB), so each step streams them from memory; the hardware prefetchers alone left the kernels waiting on it (30
 * layers' projections at one row: 5.9 ms, 3.4 ms with each row's weights requested this many bytes ahead). */
#define QUANT_PREFETCH 4096

static inline float half_value(uint16_t h) {  /* IEEE fp16 -> float32, exact */
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    if (exp == 0) {  /* zero or subnormal: mant * 2^-24 */
        const float f = (float)mant * 5.9604644775390625e-8f;
        return sign ? -f : f;
    }
    union { uint32_t u; float f; } v = {.u = sign | (exp == 31 ? 0x7F800000u : (exp + 112) << 23) | (mant << 13)};
    return v.f;
#endif
}

static inline int64_t quant_row_bytes(int format, int64_t K) {
    return format == WEIGHT_Q4_1 ? K / 32 * 20 : format == WEIGHT_Q8_0 ? K / 32 * 34 : K + 4;
}

static inline int64_t quant_block(int format) { return format == WEIGHT_INT8 ? 16 : 32; }  /* K is a multiple */

/* Q4_1's block (g, b) of 16 rows: Q4_1_UNIT bytes, the rows' 16 (d, m) dwords, then 4 vectors of their nibbles. */
#define Q4_1_UNIT 320
static inline const uint8_t* q4_1_unit(const uint8_t* w, int64_t K, int64_t g, int64_t b) {
    return w + (g * (K / 32) + b) * Q4_1_UNIT;
}

#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || \
    (defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__))
/* A thread's buffer `which` of at least `size` bytes, 64-byte aligned, kept for its next call. NOTE: a step makes
 * ~180 of these calls on the same OpenMP threads; a fresh allocation each time was handed back to the system and
 * paid its page faults again. */
static inline void* scratch(int which, size_t size) {
    static __thread void* buffers[2];
    static __thread size_t sizes[2];
    if (sizes[which] < size) {
        free(buffers[which]);
        size = (size + 65535) & ~(size_t)65535;
        buffers[which] = aligned_alloc(64, size);
        sizes[which] = buffers[which] == NULL ? 0 : size;
    }
    return buffers[which];
}
#endif

/* linear_quant's arguments, W one Q4_1 or Q8_0 weight: x quantized to int8 for integer dot products
 * (linear_quant_vnni.c, builds with AVX512-VNNI). Returns 0, or -1 if it cannot take them. */
int linear_quant_vnni(int format, const void* x, int64_t x_st, const uint8_t* w, const uint16_t* b, int64_t T,
                      int64_t K, int64_t N, int op, const uint16_t* o, int64_t other_st, uint16_t* out,
                      int num_threads);

#endif
