#include "common.h"

/*
 * linear_amx: y = op(x W^T + b) for any number of rows T, on AMX tiles (Sapphire Rapids and later), for the steps
 * linear_small is slower at (backend/engine/linear.py decides which rows). It reads the weight as
 * pack_linear_weight lays it out for linear_small, the tiles' pair-interleaved layout, [N/16][K/32][16 pairs of k]
 * [16 n][2], so each 16 x 32 block of W is one contiguous 1 KB tile load. A thread takes 32 outputs (two panels of
 * W) at a time and runs every 32-row group of x past them: four 16 x 16 float32 accumulator tiles, so that each x
 * tile and each W tile is loaded once per two multiplies.
 * The bias, the elementwise op and the rounding to bf16 are applied 16 floats at a time on the way out
 * (linear_epilogue16), as oneDNN's fused post-ops do (float32 sum, one rounding).
 * Returns -1 where this build or this kernel cannot run it (no AMX, N % 32, K % 32, K too large).
 */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define LINEAR_AMX 1
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Linux hands a process the AMX register state only once asked (the first ask may come from oneDNN, or from here). */
static int amx_permitted(void) {
    static int state = 0;  /* 0: not asked yet, 1: granted, -1: refused */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

#endif

int linear_amx_available(void) {
#if defined(LINEAR_AMX)
    return amx_permitted();
#else
    return 0;
#endif
}

int linear_amx(const void* x, int64_t x_st, const void* weight, const void* bias, int64_t T, int64_t K, int64_t N,
               int op, const void* other, int64_t other_st, void* y, int num_threads) {
#if defined(LINEAR_AMX)
    if (T < 1 || N % 32 != 0 || K % 32 != 0 || K > LINEAR_MAX_K || !amx_permitted()) return -1;
    /* x as the tiles read it: 32-row groups. The full groups are read in place; a last, partial group is copied
     * into `tail` padded with zero rows. NOTE: only that group: copying all of x into a padded buffer cost each call
     * a pass over T x K (a step of 1,055 rows took 1.4x the time of one of 1,024). */
    const int64_t Tp = (T + 31) / 32 * 32, Tfull = T / 32 * 32;
    uint16_t* tail = NULL;
    if (Tp != T) {
        tail = (uint16_t*)calloc((size_t)(32 * K), sizeof(uint16_t));
        if (tail == NULL) return -1;
        for (int64_t t = Tfull; t < T; ++t)
            memcpy(tail + (t - Tfull) * K, (const uint16_t*)x + t * x_st, sizeof(uint16_t) * K);
    }
    const uint16_t* w = (const uint16_t*)weight;
    const int64_t KB = K / 32;
#pragma omp parallel num_threads(num_threads) if (N * K >= 65536)
    {
        load_tile_config();  /* 0-3 sums, 4-5 W, 6-7 x */
        float acc[4][16 * 16];
#pragma omp for schedule(static)
        for (int64_t np = 0; np < N / 32; ++np) {  /* 32 outputs: two panels of W */
            const uint16_t* panel = w + 2 * np * KB * 512;  /* panel nb: one 1 KB tile per 32 of K */
            for (int64_t m0 = 0; m0 < Tp; m0 += 32) {
                const char* a = m0 < Tfull ? (const char*)((const uint16_t*)x + m0 * x_st) : (const char*)tail;
                const int64_t stride = (m0 < Tfull ? x_st : K) * (int64_t)sizeof(uint16_t);
                _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
                for (int64_t kb = 0; kb < KB; ++kb) {
                    const uint16_t* b0 = panel + kb * 512;
                    if (m0 == 0)  /* the next pair's tiles, on their way in */
                        for (int l = 0; l < 32; ++l) __builtin_prefetch(b0 + 2 * KB * 512 + 32 * l, 0, 3);
                    _tile_loadd(4, b0, 64);
                    _tile_loadd(5, b0 + KB * 512, 64);
                    _tile_loadd(6, a + kb * 64, stride);
                    _tile_loadd(7, a + kb * 64 + 16 * stride, stride);
                    _tile_dpbf16ps(0, 6, 4);
                    _tile_dpbf16ps(1, 6, 5);
                    _tile_dpbf16ps(2, 7, 4);
                    _tile_dpbf16ps(3, 7, 5);
                }
                _tile_stored(0, acc[0], 64);
                _tile_stored(1, acc[1], 64);
                _tile_stored(2, acc[2], 64);
                _tile_stored(3, acc[3], 64);
                for (int q = 0; q < 4; ++q) {  /* q: rows m0 + 16 (q / 2), outputs 32 np + 16 (q % 2) */
                    const int64_t t0 = m0 + 16 * (q / 2), rows = T - t0 < 16 ? T - t0 : 16;
                    if (rows > 0)
                        linear_epilogue16(acc[q], t0, rows, 32 * np + 16 * (q % 2), N, (const uint16_t*)bias, op,
                                     (const uint16_t*)other, other_st, (uint16_t*)y);
                }
            }
        }
        _tile_release();
    }
    free(tail);
    return 0;
#else
    (void)x; (void)x_st; (void)weight; (void)bias; (void)T; (void)K; (void)N; (void)op; (void)other; (void)other_st;
    (void)y; (void)num_threads;
    return -1;
#endif
}
