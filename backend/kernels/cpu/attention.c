/*
 * CPU kernels for the places where eager torch spends more time on overhead than on work. Each is a C twin of torch
 * code (same inputs, same result within float rounding); backend/kernels/cpu_kernels.py builds this file at first use
 * (-O3 -march=native -ffast-math) and falls back to the torch code where it cannot.
 *
 * paged_decode_attention (twin of backend.engine.attention.paged_decode_attention): one query token per sequence reads its
 * keys and values straight from the paged pool through its block table, so nothing is gathered into a temporary
 * copy first (the torch path copies every sequence's K/V once per layer, then reads the copy again). A work item is
 * a whole sequence (or one (sequence, KV head) when there are few sequences): its query heads share every K/V row
 * it reads.
 *
 * rope_paged_attention (twin of backend.engine.attention.rope_paged_attention): the rotary embedding, the K/V write
 * and the decodes' attention of one layer in one call, from the QKV projection's output.
 *
 * rms_norm (twin of HF's LlamaRMSNorm): one pass per row instead of eight tensor ops; F.rms_norm in bf16 widens the
 * whole input to float32 and allocates per op, which made it 2.5x slower than layer_norm over a 4096-token prefill.
 *
 * Work is spread over torch's own OpenMP threads: this library's libgomp.so.1 resolves to the copy torch loaded.
 * Arithmetic is float32; bf16 inputs are widened on load and outputs rounded to nearest even, as torch does.
 */
#include <float.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEADS 64 /* query heads one work item may hold (a whole sequence) */
#define MAX_HEAD_DIM 256
#define MAX_ROW 16384 /* hidden size limit of rms_norm */

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

/*
 * One work item: the NK KV heads from kv_begin of sequence b (NK * G query heads), against its `len` cached tokens.
 * A whole sequence per item (NK = KVH) reads each cached token's K (then V) row for all heads as one contiguous run,
 * and the next block is prefetched row by row while the current one is read: the pool is far larger than the caches, so the
 * kernel runs at the speed it streams blocks in (reading one head's 128-byte slice of each row, 3x strided, left
 * the loads waiting on memory). always_inline so that each call site below gets D and dtype as constants: the row
 * loops are then fully unrolled and vectorised.
 */
/* The item's NQ query rows as float32, pre-scaled; their accumulators zeroed and running maxima reset. */
static inline void start_queries(const char* q_rows, int64_t q_sh, int dtype, int64_t D, int64_t NQ, float scale,
                                 float* q, float* acc, float* max_score) {
    const int64_t esize = dtype == DTYPE_BF16 ? 2 : 4;
    for (int64_t j = 0; j < NQ; ++j) {
        load_row(q_rows + j * q_sh * esize, dtype, D, q + j * D);
        for (int64_t d = 0; d < D; ++d) {
            q[j * D + d] *= scale;
            acc[j * D + d] = 0.f;
        }
        max_score[j] = -FLT_MAX;
    }
}

/* scores[j][t] = exp(scores[j][t] - max_score[j]) for t < len, and sum[j] their total: the softmax's numerators. */
static inline void exp_scores(float* scores, int64_t max_context, const float* max_score, int64_t NQ, int64_t len,
                              float* sum) {
    for (int64_t j = 0; j < NQ; ++j) {
        float* s = scores + j * max_context;
        float total = 0.f;
        for (int64_t t = 0; t < len; ++t) {
            s[t] = expf(s[t] - max_score[j]);
            total += s[t];
        }
        sum[j] = total;
    }
}

static inline __attribute__((always_inline)) void attend_one(
    const char* q_rows, int64_t q_sh, const char* k_bytes, const char* v_bytes, int64_t c_sb, int64_t c_ss,
    int64_t c_sh, const int32_t* table, int64_t len, int64_t block_size, int64_t NK, int64_t G, const int64_t D,
    const int dtype, float scale, float* scores, int64_t max_context, float* q, float* acc, char* out_rows,
    int64_t o_sh) {
    const int64_t esize = dtype == DTYPE_BF16 ? 2 : 4;
    const int64_t num_blocks = (len + block_size - 1) / block_size, NQ = NK * G;
    const int64_t row_bytes = NK * c_sh * esize;  /* one token's K (or V) row over the item's heads */
    float row[MAX_HEAD_DIM], max_score[MAX_HEADS], sum[MAX_HEADS];
    start_queries(q_rows, q_sh, dtype, D, NQ, scale, q, acc, max_score);
    /* scores[j][t] = q_j . k_t, block by block (no division per token) */
    for (int64_t i = 0, t = 0; i < num_blocks; ++i) {
        const char* block = k_bytes + table[i] * c_sb * esize;
        const char* next = i + 1 < num_blocks ? k_bytes + table[i + 1] * c_sb * esize : v_bytes + table[0] * c_sb * esize;
        for (int64_t offset = 0; offset < block_size && t < len; ++offset, ++t) {
            for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + offset * c_ss * esize + b);
            for (int64_t h = 0; h < NK; ++h) {
                load_row(block + (offset * c_ss + h * c_sh) * esize, dtype, D, row);
                for (int64_t g = 0; g < G; ++g) {
                    const int64_t j = h * G + g;
                    float dot = 0.f;
                    for (int64_t d = 0; d < D; ++d) dot += q[j * D + d] * row[d];
                    scores[j * max_context + t] = dot;
                    max_score[j] = dot > max_score[j] ? dot : max_score[j];
                }
            }
        }
    }
    exp_scores(scores, max_context, max_score, NQ, len, sum);
    /* acc[j] = sum_t p[j][t] v_t, normalised on the way out */
    for (int64_t i = 0, t = 0; i < num_blocks; ++i) {
        const char* block = v_bytes + table[i] * c_sb * esize;
        const char* next = v_bytes + table[i + 1 < num_blocks ? i + 1 : i] * c_sb * esize;
        for (int64_t offset = 0; offset < block_size && t < len; ++offset, ++t) {
            for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + offset * c_ss * esize + b);
            for (int64_t h = 0; h < NK; ++h) {
                load_row(block + (offset * c_ss + h * c_sh) * esize, dtype, D, row);
                for (int64_t g = 0; g < G; ++g) {
                    const int64_t j = h * G + g;
                    const float p = scores[j * max_context + t];
                    for (int64_t d = 0; d < D; ++d) acc[j * D + d] += p * row[d];
                }
            }
        }
    }
    for (int64_t j = 0; j < NQ; ++j) store_row(out_rows + j * o_sh * esize, dtype, D, acc + j * D, 1.f / sum[j]);
}

/*
 * The same work item for head dims that are a multiple of 16, TILE tokens at a time: their K (then V) rows are
 * widened to float32 once into `tile` (L1-resident), then every query head of the item reads them from there. A
 * head's TILE scores come out of one reduction of TILE partial-sum vectors (a transpose-add tree: about 3
 * instructions a score instead of a horizontal sum each), and its output accumulates in registers across the tile.
 */
#define TILE 16
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16f load16(const float* p) { v16f v; memcpy(&v, p, sizeof v); return v; }
static inline void store16(float* p, v16f v) { memcpy(p, &v, sizeof v); }
static inline v16f hadd_pairs(v16f a, v16f b, v16i lo, v16i hi) {
    return __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}
/* r[i] = the sum of p[i]'s 16 lanes, for i < 16 */
static inline v16f reduce16(const v16f* p) {
    const v16i lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}, hi1 = lo1 + 8;
    const v16i lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27}, hi2 = lo2 + 4;
    const v16i lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29}, hi3 = lo3 + 2;
    const v16i lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}, hi4 = lo4 + 1;
    v16f b[8], c[4], d[2];
    for (int i = 0; i < 8; ++i) b[i] = hadd_pairs(p[2 * i], p[2 * i + 1], lo1, hi1);
    for (int i = 0; i < 4; ++i) c[i] = hadd_pairs(b[2 * i], b[2 * i + 1], lo2, hi2);
    for (int i = 0; i < 2; ++i) d[i] = hadd_pairs(c[2 * i], c[2 * i + 1], lo3, hi3);
    return hadd_pairs(d[0], d[1], lo4, hi4);
}

/* Rows of tokens t0 .. t0 + n - 1 (all NK heads) into tile [TILE, NK * D] as float32; the rows TILE tokens on are
 * prefetched. */
static inline __attribute__((always_inline)) void load_tile(
    const char* base, const int32_t* table, int64_t c_sb, int64_t c_ss, int64_t c_sh, int64_t block_size,
    int64_t t0, int64_t n, int64_t len, int64_t NK, const int64_t D, const int dtype, float* tile) {
    const int64_t esize = dtype == DTYPE_BF16 ? 2 : 4;
    for (int64_t tt = 0; tt < n; ++tt) {
        const int64_t t = t0 + tt, ahead = t + TILE;
        const char* src = base + (table[t / block_size] * c_sb + (t % block_size) * c_ss) * esize;
        if (ahead < len) {
            const char* next = base + (table[ahead / block_size] * c_sb + (ahead % block_size) * c_ss) * esize;
            for (int64_t b = 0; b < NK * c_sh * esize; b += 64) __builtin_prefetch(next + b);
        }
        for (int64_t h = 0; h < NK; ++h) load_row(src + h * c_sh * esize, dtype, D, tile + (tt * NK + h) * D);
    }
    for (int64_t tt = n; tt < TILE; ++tt) memset(tile + tt * NK * D, 0, sizeof(float) * NK * D);
}

static inline __attribute__((always_inline)) void attend_tiled(
    const char* q_rows, int64_t q_sh, const char* k_bytes, const char* v_bytes, int64_t c_sb, int64_t c_ss,
    int64_t c_sh, const int32_t* table, int64_t len, int64_t block_size, int64_t NK, int64_t G, const int64_t D,
    const int dtype, float scale, float* scores, int64_t max_context, float* q, float* acc, float* tile,
    char* out_rows, int64_t o_sh) {
    const int64_t esize = dtype == DTYPE_BF16 ? 2 : 4, NQ = NK * G, DV = D / 16;
    float max_score[MAX_HEADS], sum[MAX_HEADS];
    start_queries(q_rows, q_sh, dtype, D, NQ, scale, q, acc, max_score);
    for (int64_t t0 = 0; t0 < len; t0 += TILE) {  /* scores[j][t] = q_j . k_t */
        const int64_t n = len - t0 < TILE ? len - t0 : TILE;
        load_tile(k_bytes, table, c_sb, c_ss, c_sh, block_size, t0, n, len, NK, D, dtype, tile);
        for (int64_t j = 0; j < NQ; ++j) {
            const float* qj = q + j * D;
            const float* rows = tile + (j / G) * D;
            v16f part[TILE];
            for (int64_t tt = 0; tt < TILE; ++tt) {
                const float* r = rows + tt * NK * D;
                v16f a = load16(qj) * load16(r);
                for (int64_t c = 1; c < DV; ++c) a += load16(qj + 16 * c) * load16(r + 16 * c);
                part[tt] = a;
            }
            const v16f sc = reduce16(part);
            float* s = scores + j * max_context + t0;
            for (int64_t tt = 0; tt < n; ++tt) {
                s[tt] = sc[tt];
                max_score[j] = sc[tt] > max_score[j] ? sc[tt] : max_score[j];
            }
        }
    }
    exp_scores(scores, max_context, max_score, NQ, len, sum);
    for (int64_t t0 = 0; t0 < len; t0 += TILE) {  /* acc[j] = sum_t p[j][t] v_t */
        const int64_t n = len - t0 < TILE ? len - t0 : TILE;
        load_tile(v_bytes, table, c_sb, c_ss, c_sh, block_size, t0, n, len, NK, D, dtype, tile);
        for (int64_t j = 0; j < NQ; ++j) {
            const float* rows = tile + (j / G) * D;
            const float* p = scores + j * max_context + t0;
            v16f a[MAX_HEAD_DIM / 16];
            for (int64_t c = 0; c < DV; ++c) a[c] = load16(acc + j * D + 16 * c);
            for (int64_t tt = 0; tt < n; ++tt) {
                const v16f weight = (v16f){0.f} + p[tt];
                for (int64_t c = 0; c < DV; ++c) a[c] += weight * load16(rows + tt * NK * D + 16 * c);
            }
            for (int64_t c = 0; c < DV; ++c) store16(acc + j * D + 16 * c, a[c]);
        }
    }
    for (int64_t j = 0; j < NQ; ++j) store_row(out_rows + j * o_sh * esize, dtype, D, acc + j * D, 1.f / sum[j]);
}

/*
 * Strides are in elements.
 * query:  [B, H, D] strides (q_sb, q_sh, 1)
 * k/v:    [num_blocks, block_size, KVH, D] strides (c_sb, c_ss, c_sh, 1), the same for K and V
 * block_tables: [B, *] int32 with row stride bt_sb; context_lens: [B] int32, each in [1, max_context]
 * out:    [B, H, D] strides (o_sb, o_sh, 1)
 * Called inside a parallel region (its work is shared out by `omp for`).
 */
static void decode_attention_items(const void* query, int64_t q_sb, int64_t q_sh, const void* k_cache,
                                   const void* v_cache, int64_t c_sb, int64_t c_ss, int64_t c_sh,
                                   const int32_t* block_tables, int64_t bt_sb, const int32_t* context_lens, int64_t B,
                                   int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale,
                                   int64_t max_context, void* out, int64_t o_sb, int64_t o_sh, int dtype,
                                   int num_threads) {
    const int64_t G = H / KVH;
    const int64_t esize = dtype == DTYPE_BF16 ? 2 : 4;
    /* A sequence per item when there are enough of them to share out; else one (sequence, KV head) per item. */
    const int64_t NK = B >= 4 * num_threads && H <= MAX_HEADS ? KVH : 1, items_per_seq = KVH / NK;
    float* scores = (float*)malloc(sizeof(float) * NK * G * max_context);  /* (NK * G, context) of the item */
    float* q = (float*)malloc(sizeof(float) * NK * G * D);
    float* acc = (float*)malloc(sizeof(float) * NK * G * D);
    float* tile = (float*)malloc(sizeof(float) * TILE * NK * D);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < B * items_per_seq; ++item) {
        const int64_t b = item / items_per_seq, kv_begin = (item % items_per_seq) * NK;
        const char* q_rows = (const char*)query + (b * q_sb + kv_begin * G * q_sh) * esize;
        const char* k_bytes = (const char*)k_cache + kv_begin * c_sh * esize;
        const char* v_bytes = (const char*)v_cache + kv_begin * c_sh * esize;
        char* out_rows = (char*)out + (b * o_sb + kv_begin * G * o_sh) * esize;
#define ARGS(HEAD_DIM, DTYPE)                                                                                       \
    q_rows, q_sh, k_bytes, v_bytes, c_sb, c_ss, c_sh, block_tables + b * bt_sb, context_lens[b], block_size, NK, G, \
        HEAD_DIM, DTYPE, scale, scores, max_context, q, acc
        if (D == 64 && dtype == DTYPE_BF16) attend_tiled(ARGS(64, DTYPE_BF16), tile, out_rows, o_sh);
        else if (D == 128 && dtype == DTYPE_BF16) attend_tiled(ARGS(128, DTYPE_BF16), tile, out_rows, o_sh);
        else if (D == 64) attend_tiled(ARGS(64, DTYPE_F32), tile, out_rows, o_sh);
        else if (D == 128) attend_tiled(ARGS(128, DTYPE_F32), tile, out_rows, o_sh);
        else attend_one(ARGS(D, dtype), out_rows, o_sh);
#undef ARGS
    }
    free(scores);
    free(q);
    free(acc);
    free(tile);
}

void paged_decode_attention(const void* query, int64_t q_sb, int64_t q_sh, const void* k_cache, const void* v_cache,
                            int64_t c_sb, int64_t c_ss, int64_t c_sh, const int32_t* block_tables, int64_t bt_sb,
                            const int32_t* context_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                            int64_t block_size, float scale, int64_t max_context, void* out, int64_t o_sb,
                            int64_t o_sh, int dtype, int num_threads) {
#pragma omp parallel num_threads(num_threads)
    decode_attention_items(query, q_sb, q_sh, k_cache, v_cache, c_sb, c_ss, c_sh, block_tables, bt_sb, context_lens,
                           B, H, KVH, D, block_size, scale, max_context, out, o_sb, o_sh, dtype, num_threads);
}

/*
 * One layer's attention for a decode-heavy step, after the QKV projection (twin of
 * backend.engine.attention.rope_paged_attention): the rotary embedding applied in place to the q and k heads of every
 * token's row of qkv [T, (H + 2 KVH) D] (row stride qkv_st), each token's k and v heads stored in the pool at its
 * slot (negative slots skipped), then the first `num_decodes` tokens attend (as paged_decode_attention; their query
 * rows are qkv's rows). One parallel region instead of a dozen tensor ops and two.
 * cos, sin_signed: [max_len, D] tables in the dtype (sin_signed = [-sin_lo, sin_hi]); positions, slots: [T] int64.
 * The rotation rounds as the torch twin does: round(round(x cos) + swap(x) sin_signed).
 */
void rope_paged_attention(void* qkv, int64_t qkv_st, int64_t T, const int64_t* positions, const void* cos,
                          const void* sin_signed, const int64_t* slots, void* k_cache, void* v_cache, int64_t c_sb,
                          int64_t c_ss, int64_t c_sh, int64_t num_decodes, const int32_t* block_tables, int64_t bt_sb,
                          const int32_t* context_lens, int64_t H, int64_t KVH, int64_t D, int64_t block_size,
                          float scale, int64_t max_context, void* out, int64_t o_sb, int64_t o_sh, int dtype,
                          int num_threads) {
    const int64_t esize = dtype == DTYPE_BF16 ? 2 : 4, half = D / 2;
#pragma omp parallel num_threads(num_threads) if (T >= 8 || num_decodes * max_context >= 1024)
    {
        float x[MAX_HEAD_DIM], c[MAX_HEAD_DIM], s[MAX_HEAD_DIM], y[MAX_HEAD_DIM];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            char* row = (char*)qkv + t * qkv_st * esize;
            load_row((const char*)cos + positions[t] * D * esize, dtype, D, c);
            load_row((const char*)sin_signed + positions[t] * D * esize, dtype, D, s);
            for (int64_t h = 0; h < H + KVH; ++h) {
                char* head = row + h * D * esize;
                load_row(head, dtype, D, x);
                for (int64_t d = 0; d < D; ++d) {
                    const float swapped = d < half ? x[d + half] : x[d - half];
                    y[d] = round_to(x[d] * c[d], dtype) + swapped * s[d];
                }
                store_row(head, dtype, D, y, 1.f);
            }
            if (slots[t] < 0) continue;
            const int64_t at = (slots[t] / block_size) * c_sb + (slots[t] % block_size) * c_ss;
            for (int64_t h = 0; h < KVH; ++h) {
                memcpy((char*)k_cache + (at + h * c_sh) * esize, row + (H + h) * D * esize, D * esize);
                memcpy((char*)v_cache + (at + h * c_sh) * esize, row + (H + KVH + h) * D * esize, D * esize);
            }
        }
        if (num_decodes > 0)
            decode_attention_items(qkv, qkv_st, D, k_cache, v_cache, c_sb, c_ss, c_sh, block_tables, bt_sb,
                                   context_lens, num_decodes, H, KVH, D, block_size, scale, max_context, out, o_sb,
                                   o_sh, dtype, num_threads);
    }
}

/*
 * out = weight * round(x / sqrt(mean(x^2) + eps)), rounding to the input dtype in between as HF's LlamaRMSNorm does.
 * x: [T, D] row stride x_st; weight: [D]; out: [T, D] contiguous.
 */
void rms_norm(const void* x, int64_t x_st, const void* weight, void* out, int64_t T, int64_t D, float eps, int dtype,
              int num_threads) {
    const int64_t esize = dtype == DTYPE_BF16 ? 2 : 4;
    /* Below ~64k elements a row loop is faster than waking the other threads. */
#pragma omp parallel num_threads(num_threads) if (T * D >= 65536)
    {
        float row[MAX_ROW], w[MAX_ROW];
        load_row(weight, dtype, D, w);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; ++t) {
            load_row((const char*)x + t * x_st * esize, dtype, D, row);
            float sum_sq = 0.f;
            for (int64_t d = 0; d < D; ++d) sum_sq += row[d] * row[d];
            const float inv_rms = 1.f / sqrtf(sum_sq / (float)D + eps);
            for (int64_t d = 0; d < D; ++d) row[d] = round_to(row[d] * inv_rms, dtype) * w[d];
            store_row((char*)out + t * D * esize, dtype, D, row, 1.f);
        }
    }
}

/*
 * sample_rows (twin of backend.engine.sampler.sample_rows): one token per row of logits [*, V] (row stride `stride`), for
 * the R rows named in `rows` (NULL: the first R), each with its row of `settings` (temperature, top_k, top_p, u, as
 * doubles: one array from the caller instead of four): argmax where temperature is 0, else a draw from
 * softmax(x / T) restricted to its top-k and top-p prefix, by inverse CDF with the row's own uniform number u in
 * [0, 1), scanning tokens in index order.
 * Rows are independent (a row's token never depends on its batch-mates). Non-finite logits (-inf: banned) weigh 0.
 *
 * A draw is a few vectorised passes over the row and never sorts the vocabulary. The weights w = exp((x - max) / T)
 * (the best token weighs 1) follow the logits' order, so a prefix of the sorted order is "every token whose logit is
 * above a cut, plus the first `ties` tokens at the cut in index order" (a stable sort's order), and the top-k and
 * top-p cuts are found by a quickselect over the logits (select_cut), which counts and sums the weights above a
 * pivot and keeps the part of the candidates that holds the cut.
 */
#define SAMPLE_BLOCK 1024
/* Where a top-k or top-p cut is looked for first: among the tokens within 8, then 17 (weights down to about 4e-8 of
 * the best token's) times T of the best logit; the first range that holds the whole top-k and top-p. (A range at 4
 * as well cost more in the weighing pass than its fewer candidates saved in select_cut.) */
static const float NEAR_RANGES[] = {8.f, 17.f};

typedef float f32x8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
enum { ABOVE = 0, AT_LEAST = 1, EQUAL = 2 };

static inline uint32_t bits_of(float f) { union { float f; uint32_t u; } v = {.f = f}; return v.u; }
static inline float float_of(uint32_t u) { union { uint32_t u; float f; } v = {.u = u}; return v.f; }

#define COMPARE(x, t, mode) ((mode) == ABOVE ? (x) > (t) : (mode) == AT_LEAST ? (x) >= (t) : (x) == (t))

/* Sum of w[i] and count over the i whose x[i] is above t (or at least t, or equal to it). Four independent 8-float
 * accumulators per block (GCC vector extensions: vectorised on any x86-64, no serial dependency), float within a
 * block, double across blocks. */
static void sum_where(const float* x, const float* w, int64_t n, float t, int mode, double* mass, int64_t* count) {
    const f32x8 tt = (f32x8){0.f} + t;
    double total = 0.0;
    int64_t num = 0, i = 0;
    for (; i + SAMPLE_BLOCK <= n; i += SAMPLE_BLOCK) {
        f32x8 acc[4] = {{0.f}};
        i32x8 cnt[4] = {{0}};
        for (int64_t j = i; j < i + SAMPLE_BLOCK; j += 32)
            for (int k = 0; k < 4; ++k) {
                f32x8 xv, wv;
                memcpy(&xv, x + j + 8 * k, sizeof xv);
                memcpy(&wv, w + j + 8 * k, sizeof wv);
                const i32x8 in = COMPARE(xv, tt, mode);  /* -1 where counted, 0 elsewhere */
                acc[k] += (f32x8)((i32x8)wv & in);
                cnt[k] -= in;
            }
        const f32x8 a = acc[0] + acc[1] + acc[2] + acc[3];
        const i32x8 c = cnt[0] + cnt[1] + cnt[2] + cnt[3];
        float block = 0.f;
        for (int l = 0; l < 8; ++l) { block += a[l]; num += c[l]; }
        total += block;
    }
    for (; i < n; ++i) {
        const int in = COMPARE(x[i], t, mode);
        total += in ? w[i] : 0.f;
        num += in;
    }
    *mass = total;
    *count = num;
}

/* A token's weight e^((x - m) / T), m the row's best logit: the best token weighs 1; e^-127 and below round to 0. */
static inline float weight_of(float x, float m, float inv_t) {
    const float e = (x - m) * inv_t;
    return expf(e > -127.f ? e : -127.f);
}

/* Every token's weight into w, and, in the same pass, sum_where(x, w, n, t, AT_LEAST) for each of the `num`
 * thresholds in t and sum_where(x, w, n, -FLT_MAX, ABOVE)'s mass as *total (the same sums, added in another
 * order). A block's weights are summed while they are still in L1. */
#define MAX_NEAR 2 /* the thresholds weigh_and_sum takes at most */
_Static_assert(sizeof NEAR_RANGES / sizeof NEAR_RANGES[0] <= MAX_NEAR, "weigh_and_sum takes every near range at once");
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

static void weigh_and_sum(const float* x, float* w, int64_t n, float m, float inv_t, const float* t, int num,
                          double* total, double* mass, int64_t* count) {
#if defined(__AVX512F__)
    /* 16 tokens at a time: weigh them, then add each weight to every sum it belongs to under a compare mask. Float
     * within a block, double across blocks; unused thresholds are FLT_MAX (nothing counts). */
    __m512 tt[MAX_NEAR];
    for (int r = 0; r < MAX_NEAR; ++r) tt[r] = _mm512_set1_ps(r < num ? t[r] : FLT_MAX);
    const __m512 low = _mm512_set1_ps(-FLT_MAX), floor_e = _mm512_set1_ps(-127.f);
    const __m512 mm = _mm512_set1_ps(m), it = _mm512_set1_ps(inv_t);
    double all_d = 0.0, sums_d[MAX_NEAR] = {0.0};
    int64_t nums_d[MAX_NEAR] = {0};
    int64_t i0 = 0;
    for (; i0 + SAMPLE_BLOCK <= n; i0 += SAMPLE_BLOCK) {
        __m512 acc_all = _mm512_setzero_ps(), acc[MAX_NEAR];
        for (int r = 0; r < MAX_NEAR; ++r) acc[r] = _mm512_setzero_ps();
        for (int64_t j = i0; j < i0 + SAMPLE_BLOCK; j += 16) {
            const __m512 xv = _mm512_loadu_ps(x + j);
            const __m512 wv = exp16(_mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(xv, mm), it), floor_e));
            _mm512_storeu_ps(w + j, wv);
            acc_all = _mm512_mask_add_ps(acc_all, _mm512_cmp_ps_mask(xv, low, _CMP_GT_OQ), acc_all, wv);
            for (int r = 0; r < MAX_NEAR; ++r) {
                const __mmask16 in = _mm512_cmp_ps_mask(xv, tt[r], _CMP_GE_OQ);
                acc[r] = _mm512_mask_add_ps(acc[r], in, acc[r], wv);
                nums_d[r] += __builtin_popcount(in);
            }
        }
        all_d += _mm512_reduce_add_ps(acc_all);
        for (int r = 0; r < MAX_NEAR; ++r) sums_d[r] += _mm512_reduce_add_ps(acc[r]);
    }
    for (; i0 < n; ++i0) {
        w[i0] = weight_of(x[i0], m, inv_t);
        all_d += x[i0] > -FLT_MAX ? w[i0] : 0.f;
        for (int r = 0; r < num; ++r) {
            sums_d[r] += x[i0] >= t[r] ? w[i0] : 0.f;
            nums_d[r] += x[i0] >= t[r];
        }
    }
    *total = all_d;
    for (int r = 0; r < num; ++r) { mass[r] = sums_d[r]; count[r] = nums_d[r]; }
#else
    const f32x8 low = (f32x8){0.f} - FLT_MAX;
    f32x8 tt[MAX_NEAR];
    double sums[MAX_NEAR] = {0.0};
    int64_t nums[MAX_NEAR] = {0};
    for (int r = 0; r < num; ++r) tt[r] = (f32x8){0.f} + t[r];
    double all = 0.0;
    int64_t i = 0;
    for (; i + SAMPLE_BLOCK <= n; i += SAMPLE_BLOCK) {
        for (int64_t j = i; j < i + SAMPLE_BLOCK; ++j) w[j] = weight_of(x[j], m, inv_t);
        f32x8 acc_all[4] = {{0.f}}, acc[MAX_NEAR][4] = {{{0.f}}};
        i32x8 cnt[MAX_NEAR][4] = {{{0}}};
        for (int64_t j = i; j < i + SAMPLE_BLOCK; j += 32)
            for (int k = 0; k < 4; ++k) {
                f32x8 xv, wv;
                memcpy(&xv, x + j + 8 * k, sizeof xv);
                memcpy(&wv, w + j + 8 * k, sizeof wv);
                acc_all[k] += (f32x8)((i32x8)wv & COMPARE(xv, low, ABOVE));
                for (int r = 0; r < num; ++r) {
                    const i32x8 in = COMPARE(xv, tt[r], AT_LEAST);
                    acc[r][k] += (f32x8)((i32x8)wv & in);
                    cnt[r][k] -= in;
                }
            }
        const f32x8 a = acc_all[0] + acc_all[1] + acc_all[2] + acc_all[3];
        float block = 0.f;
        for (int l = 0; l < 8; ++l) block += a[l];
        all += block;
        for (int r = 0; r < num; ++r) {
            const f32x8 ar = acc[r][0] + acc[r][1] + acc[r][2] + acc[r][3];
            const i32x8 c = cnt[r][0] + cnt[r][1] + cnt[r][2] + cnt[r][3];
            float br = 0.f;
            for (int l = 0; l < 8; ++l) { br += ar[l]; nums[r] += c[l]; }
            sums[r] += br;
        }
    }
    for (; i < n; ++i) {
        w[i] = weight_of(x[i], m, inv_t);
        all += COMPARE(x[i], -FLT_MAX, ABOVE) ? w[i] : 0.f;
        for (int r = 0; r < num; ++r) {
            const int in = COMPARE(x[i], t[r], AT_LEAST);
            sums[r] += in ? w[i] : 0.f;
            nums[r] += in;
        }
    }
    *total = all;
    for (int r = 0; r < num; ++r) { mass[r] = sums[r]; count[r] = nums[r]; }
#endif
}

/* The kept prefix: tokens with x > cut, then the first `ties` tokens with x == cut in index order. The token at
 * which the running weight of the prefix, in index order, first exceeds target (the last kept one if rounding leaves
 * the target unreached). Block sums first, then one block token by token. */
static int64_t inverse_cdf(const float* x, const float* w, int64_t V, float cut, int64_t ties, double target) {
    double acc = 0.0;
    int64_t tied = 0;
    for (int64_t start = 0; start < V; start += SAMPLE_BLOCK) {
        const int64_t len = start + SAMPLE_BLOCK < V ? SAMPLE_BLOCK : V - start;
        double above, at;
        int64_t num_above, num_at;
        sum_where(x + start, w + start, len, cut, ABOVE, &above, &num_above);
        sum_where(x + start, w + start, len, cut, EQUAL, &at, &num_at);
        const int64_t take = num_at < ties - tied ? num_at : ties - tied;
        const double block = above + (take ? at / (double)num_at * (double)take : 0.0);
        if (acc + block > target) {
            double running = acc;
            int64_t rank = tied;
            for (int64_t i = start; i < start + len; ++i) {
                if (!(x[i] > cut || (x[i] == cut && rank++ < ties))) continue;
                running += w[i];
                if (running > target && w[i] > 0.f) return i;
            }
        }
        acc += block;
        tied += take;
    }
    for (int64_t i = V - 1; i >= 0; --i)
        if (x[i] > cut) return i;
    for (int64_t i = 0; i < V; ++i)
        if (x[i] == cut) return i;
    return 0;
}

/* Scratch rows of one thread: the row as floats and its weights, and the compacted candidates with their indices.
 * The packing loops below store whole vectors: a vector of candidates stored at num <= i ends by i + 16 <= n, so
 * it never writes past the n values it reads, nor over values not read yet when packing in place. */
typedef struct { float* x; float* w; float* xc; float* wc; int32_t* idx; } sample_scratch;

/* The tokens with x >= t among the n, in index order: their logits, weights and indices into the scratch's xc, wc
 * and idx. With AVX-512 a group of 64 tokens with none (most of the vocabulary of a peaked row) costs four compares
 * and one branch; a group with some is packed by compresses without a branch per token or per 16, whose outcome
 * would be a coin toss where the candidates are spread over the vocabulary (a flat row). */
static void gather_at_least(const float* x, const float* w, int64_t n, float t, const sample_scratch* s) {
    int64_t num = 0, i = 0;
#if defined(__AVX512F__)
    const __m512 tt = _mm512_set1_ps(t);
    const __m512i step = _mm512_set1_epi32(16);
    __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (; i + 64 <= n; i += 64) {
        __m512 xv[4];
        __mmask16 in[4];
        for (int k = 0; k < 4; ++k) {
            xv[k] = _mm512_loadu_ps(x + i + 16 * k);
            in[k] = _mm512_cmp_ps_mask(xv[k], tt, _CMP_GE_OQ);
        }
        if (!(in[0] | in[1] | in[2] | in[3])) {
            index = _mm512_add_epi32(index, _mm512_slli_epi32(step, 2));
            continue;
        }
        for (int k = 0; k < 4; ++k, index = _mm512_add_epi32(index, step)) {
            /* compress in registers, then a full store: a compressing store to memory is microcoded and slow */
            _mm512_storeu_ps(s->xc + num, _mm512_maskz_compress_ps(in[k], xv[k]));
            _mm512_storeu_ps(s->wc + num, _mm512_maskz_compress_ps(in[k], _mm512_loadu_ps(w + i + 16 * k)));
            _mm512_storeu_si512(s->idx + num, _mm512_maskz_compress_epi32(in[k], index));
            num += __builtin_popcount(in[k]);
        }
    }
#endif
    for (; i < n; ++i)
        if (x[i] >= t) { s->xc[num] = x[i]; s->wc[num] = w[i]; s->idx[num++] = (int32_t)i; }
}

/* Keep the tokens above p (upper) or at or below it, packed in index order into xs and ws (in place when x is xs);
 * returns how many, and the largest kept logit in *max. */
static int64_t keep_part(const float* x, const float* w, int64_t n, float p, int upper, float* xs, float* ws,
                         float* max) {
    int64_t num = 0, i = 0;
    float top = -FLT_MAX;
#if defined(__AVX512F__)
    const __m512 pp = _mm512_set1_ps(p);
    __m512 tops = _mm512_set1_ps(-FLT_MAX);
    for (; i + 16 <= n; i += 16) {
        const __m512 xv = _mm512_loadu_ps(x + i);
        const __mmask16 above = _mm512_cmp_ps_mask(xv, pp, _CMP_GT_OQ);
        const __mmask16 in = upper ? above : (__mmask16)~above;
        tops = _mm512_mask_max_ps(tops, in, tops, xv);
        _mm512_storeu_ps(xs + num, _mm512_maskz_compress_ps(in, xv));
        _mm512_storeu_ps(ws + num, _mm512_maskz_compress_ps(in, _mm512_loadu_ps(w + i)));
        num += __builtin_popcount(in);
    }
    top = _mm512_reduce_max_ps(tops);
#endif
    for (; i < n; ++i) {
        const float xi = x[i], wi = w[i];  /* read before the write: xs may be x */
        if (upper ? xi > p : xi <= p) {
            xs[num] = xi;
            ws[num++] = wi;
            top = xi > top ? xi : top;
        }
    }
    *max = top;
    return num;
}

#define SMALL_SELECT 64 /* below this many candidates select_cut sorts them */

/* The largest logit d among the n tokens with g(x >= d) >= target, where g counts the tokens (by_mass 0: the top-k
 * cut, target k) or sums their weights (by_mass 1: the top-p cut, target P); the smallest logit if none is (a
 * target rounding left out of reach). That is exactly the cut a bisection over the logit values finds, but where
 * bisection reads all n tokens once per bit of the logit (16 passes for bf16, more where the range spans zero), this
 * is a quickselect by value: each round splits the candidates at a pivot, sums g over the part above it, and keeps
 * only the part that holds the answer (carrying the upper part's g when the lower one is kept), so all rounds
 * together read a few times n. max: the largest of the x. xs, ws: room for n values each. */
static float select_cut(const float* x, const float* w, int64_t n, float max, int by_mass, double target, float* xs,
                        float* ws) {
    double above = 0.0;  /* g of the tokens above every candidate left */
    while (n > SMALL_SELECT) {
        float sample[5];  /* the pivot: the median of five spread samples, so a round keeps about half */
        for (int k = 0; k < 5; ++k) sample[k] = x[n * (2 * k + 1) / 10];
        for (int k = 1; k < 5; ++k)
            for (int j = k; j > 0 && sample[j - 1] > sample[j]; --j) {
                const float t = sample[j]; sample[j] = sample[j - 1]; sample[j - 1] = t;
            }
        float p = sample[2];
        if (!(p < max)) {  /* most samples sit at the top: split the value range instead */
            float lowest = max;
            for (int64_t i = 0; i < n; ++i) lowest = x[i] < lowest ? x[i] : lowest;
            if (lowest == max) return max;  /* one value left */
            p = lowest * 0.5f + max * 0.5f;  /* (max - lowest) could overflow */
            if (!(p < max)) p = lowest;  /* adjacent floats: the lower one splits them */
        }
        /* Both parts hold a candidate (max above p, the samples at or below it): every round shrinks n. */
        double mass;
        int64_t count;
        sum_where(x, w, n, p, ABOVE, &mass, &count);
        const double upper = above + (by_mass ? mass : (double)count);
        const int keep_upper = upper >= target;  /* then the answer is one of the tokens above p */
        if (!keep_upper) above = upper;
        float kept_max;
        n = keep_part(x, w, n, p, keep_upper, xs, ws, &kept_max);
        max = kept_max;
        x = xs;
        w = ws;
    }
    if (x != xs) {
        memcpy(xs, x, sizeof(float) * n);
        memcpy(ws, w, sizeof(float) * n);
    }
    for (int64_t k = 1; k < n; ++k)  /* few left: sort them, largest first, and walk down */
        for (int64_t j = k; j > 0 && xs[j - 1] < xs[j]; --j) {
            const float tx = xs[j], tw = ws[j];
            xs[j] = xs[j - 1]; ws[j] = ws[j - 1];
            xs[j - 1] = tx; ws[j - 1] = tw;
        }
    for (int64_t k = 0; k < n; ++k) {
        above += by_mass ? (double)ws[k] : 1.0;
        if ((k + 1 == n || xs[k + 1] != xs[k]) && above >= target) return xs[k];
    }
    return n ? xs[n - 1] : max;
}

static int64_t sample_one(const void* src, int dtype, int64_t V, float temperature, int64_t top_k, float top_p,
                          double u, const sample_scratch* scratch) {
    float* x = scratch->x;
    float* w = scratch->w;
    float m = -FLT_MAX, lowest = FLT_MAX;
    for (int64_t i = 0; i < V; ++i) {  /* non-finite (banned) logits sink below every finite one */
        const uint32_t bits = dtype == DTYPE_BF16 ? (uint32_t)((const uint16_t*)src)[i] << 16
                                                  : bits_of(((const float*)src)[i]);
        x[i] = (bits & 0x7F800000u) == 0x7F800000u ? -FLT_MAX : float_of(bits);
        m = x[i] > m ? x[i] : m;
        lowest = x[i] < lowest ? x[i] : lowest;
    }
    if (temperature == 0.f) {
        for (int64_t i = 0; i < V; ++i)
            if (x[i] == m) return i;  /* the first index on ties, as argmax */
    }
    const float inv_t = 1.f / temperature;
    double total;
    int64_t count;
    const int by_k = top_k > 0 && top_k < V, by_p = top_p < 1.f;
    if (!by_k && !by_p) {
        weigh_and_sum(x, w, V, m, inv_t, NULL, 0, &total, NULL, NULL);  /* banned tokens weigh 0 anyway */
        return inverse_cdf(x, w, V, -FLT_MAX, 0, u * total);
    }

    /* The logit range the cuts are looked for in: [lowest, max], or only the top of it, [near, max], when that holds
     * the whole top-k and at least top_p of the weight (then neither cut can lie below near; almost always true of
     * the first or second range tried, and it leaves a small share of the vocabulary to search). The total and the
     * mass of every range come from the pass that weighs the tokens. */
    enum { NUM_RANGES = sizeof NEAR_RANGES / sizeof NEAR_RANGES[0] };
    float nears[NUM_RANGES];
    int num_ranges = 0;
    for (; num_ranges < NUM_RANGES; ++num_ranges) {
        nears[num_ranges] = round_to(m - NEAR_RANGES[num_ranges] * temperature, dtype);  /* a value the dtype holds */
        if (!(nears[num_ranges] > lowest)) break;
    }
    double near_masses[NUM_RANGES];
    int64_t near_counts[NUM_RANGES];
    weigh_and_sum(x, w, V, m, inv_t, nears, num_ranges, &total, near_masses, near_counts);
    float near = lowest;
    int near_enough = 0;
    int64_t num_near = V;
    for (int r = 0; r < num_ranges && !near_enough; ++r) {
        near = nears[r];
        num_near = near_counts[r];
        near_enough = (!by_k || num_near >= top_k) && near_masses[r] >= (double)top_p * total;
    }
    /* Every cut then lies at or above `near`: the tokens below it are never kept. Unless they are most of the
     * vocabulary, select_cut and the draw run over those candidates only, gathered in index order (so that ties and
     * the draw keep their order); `idx` maps a candidate back to its token. */
    const int32_t* idx = NULL;
    if (near_enough && num_near <= V / 2) {
        gather_at_least(x, w, V, near, scratch);
        x = scratch->xc;
        w = scratch->wc;
        idx = scratch->idx;
        V = num_near;
    }
    /* select_cut's room: the scratch rows the candidates are not in */
    float* free_x = idx ? scratch->x : scratch->xc;
    float* free_w = idx ? scratch->w : scratch->wc;

    float cut = -FLT_MAX;  /* the prefix kept so far: everything */
    int64_t ties = 0;
    double base = total;  /* the mass top-p is a share of: the top-k's when there is a top-k */
    if (by_k) {
        cut = select_cut(x, w, V, m, 0, (double)top_k, free_x, free_w);
        double mass;
        int64_t above;
        sum_where(x, w, V, cut, ABOVE, &mass, &above);
        ties = top_k - above;
        base = mass + (double)ties * weight_of(cut, m, inv_t);
    }
    if (by_p) {
        const double P = (double)top_p * base;
        const float p_cut = select_cut(x, w, V, m, 1, P, free_x, free_w);
        const double w_cut = weight_of(p_cut, m, inv_t);
        double above;
        sum_where(x, w, V, p_cut, ABOVE, &above, &count);
        int64_t p_ties = 1;  /* keep the j-th tie while the mass before it, above + j * w_cut, is below P */
        while (p_ties < V && above + (double)p_ties * w_cut < P) ++p_ties;
        if (p_cut > cut || (p_cut == cut && p_ties < ties)) { cut = p_cut; ties = p_ties; }
    }
    double kept, at;
    int64_t num_at;
    sum_where(x, w, V, cut, ABOVE, &kept, &count);
    sum_where(x, w, V, cut, EQUAL, &at, &num_at);
    if (num_at) kept += at / (double)num_at * (double)(ties < num_at ? ties : num_at);
    const int64_t picked = inverse_cdf(x, w, V, cut, ties, u * kept);
    return idx ? idx[picked] : picked;
}

void sample_rows(const void* logits, int64_t stride, int dtype, int64_t V, const int64_t* rows, int64_t R,
                 const double* settings, int64_t* out, int num_threads) {
    const int64_t esize = dtype == DTYPE_BF16 ? 2 : 4;
#pragma omp parallel num_threads(num_threads) if (R > 1)
    {
        sample_scratch scratch = {(float*)malloc(sizeof(float) * V), (float*)malloc(sizeof(float) * V),
                                  (float*)malloc(sizeof(float) * V), (float*)malloc(sizeof(float) * V),
                                  (int32_t*)malloc(sizeof(int32_t) * V)};
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < R; ++r) {
            const double* row = settings + 4 * r;  /* temperature, top_k, top_p, uniform */
            out[r] = sample_one((const char*)logits + (rows ? rows[r] : r) * stride * esize, dtype, V, (float)row[0],
                                (int64_t)row[1], (float)row[2], row[3], &scratch);
        }
        free(scratch.x);
        free(scratch.w);
        free(scratch.xc);
        free(scratch.wc);
        free(scratch.idx);
    }
}

int max_row(void) { return MAX_ROW; }
int max_group(void) { return MAX_GROUP; }
int max_head_dim(void) { return MAX_HEAD_DIM; }

/*
 * linear_small: y = epilogue(x W^T + bias) for the few rows of a decode step; W, x, y and `other` bf16. At a
 * handful of rows a projection is one pass over its weight: each weight row is read once from memory and met with
 * every x row while it is in registers, blocks of 4 rows shared out among the threads. Streaming SmolLM2's 151
 * weights this way reads 22 GB/s on the Xeon measured, where oneDNN's matmul read 14-15 (and the same loop with
 * non-temporal prefetches 12).
 * W is [N, K] row-major, or, where vdpbf16ps exists (linear_weight_packed), packed by pack_linear_weight into blocks
 * of 4 rows interleaved by 32 columns, [N/4][K/32][4][32], so that each block is one contiguous stream.
 * op: 0 none, 1 silu, 2 times `other`, 3 plus `other` ([T, N], row stride other_st), applied to the float32 sum
 * and rounded once, as oneDNN's fused post-ops do. x: [T, K] row stride x_st; y: [T, N] contiguous; T <= 64,
 * taken 8 rows at a time over each block of W (from L1 after the first 8).
 */
#define LINEAR_MAX_T 64
#define LINEAR_TILE_T 8 /* x rows met by one pass over a block of W: their sums stay in registers */
#define LINEAR_MAX_K 16384
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
#include <immintrin.h>
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

/* Whether linear_small wants its weight packed (pack_linear_weight) on this build: the AVX512-BF16 path reads each
 * block of 4 rows as one stream, [N/4][K/32][4][32]; elsewhere it reads plain rows. */
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

/*
 * linear_amx: y = op(x W^T + b) for any number of rows T, on AMX tiles (Sapphire Rapids and later), for the decode
 * steps linear_small is slower at (the model decides: 2 to 64 rows). The weight is packed once
 * (pack_linear_weight_amx) into the tiles' pair-interleaved layout, [N/16][K/32][16 pairs of k][16 n][2], so each
 * 16 x 32 block of W is one contiguous 1 KB tile load. A thread takes 32 outputs (two panels of W) at a time and runs
 * every 32-row group of x past them: four 16 x 16 float32 accumulator tiles, each x tile and each W tile loaded once
 * per two multiplies (with one panel and four row groups, x was loaded for every multiply: 1.4x slower at 64 rows).
 * The bias, the elementwise op and the rounding to bf16 are applied 16 floats at a time on the way out, as oneDNN's
 * fused post-ops do (float32 sum, one rounding).
 * Returns -1 where this build or this kernel cannot run it (no AMX, N % 32, K % 32, K too large).
 */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define LINEAR_AMX 1
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

typedef struct __attribute__((packed, aligned(64))) {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Linux hands a process the AMX register state only once asked (the first ask may come from oneDNN, or from here). */
static int amx_permitted(void) {
    static int state = 0;  /* 0: not asked yet, 1: granted, -1: refused */
    if (state == 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
    return state == 1;
}

static inline __m512 widen16_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

/* Rows [t0, t0 + rows) x columns [j0, j0 + 16) of the output from the float32 sums in acc (16 floats a row). */
static inline void amx_epilogue(const float* acc, int64_t t0, int64_t rows, int64_t j0, int64_t N, const uint16_t* b,
                                int op, const uint16_t* other, int64_t other_st, uint16_t* out) {
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

int linear_amx_available(void) {
#if defined(LINEAR_AMX)
    return amx_permitted();
#else
    return 0;
#endif
}

void pack_linear_weight_amx(const void* weight, int64_t N, int64_t K, void* packed) {
    const uint16_t* w = (const uint16_t*)weight;
    uint16_t* p = (uint16_t*)packed;
    for (int64_t nb = 0; nb < N / 16; ++nb)
        for (int64_t kb = 0; kb < K / 32; ++kb)
            for (int64_t kp = 0; kp < 16; ++kp)
                for (int64_t n = 0; n < 16; ++n)
                    for (int64_t e = 0; e < 2; ++e)
                        *p++ = w[(nb * 16 + n) * K + kb * 32 + 2 * kp + e];
}

int linear_amx(const void* x, int64_t x_st, const void* weight, const void* bias, int64_t T, int64_t K, int64_t N,
               int op, const void* other, int64_t other_st, void* y, int num_threads) {
#if defined(LINEAR_AMX)
    if (T < 1 || N % 32 != 0 || K % 32 != 0 || K > LINEAR_MAX_K || !amx_permitted()) return -1;
    /* x as the tiles read it: 32-row groups, so a T that is not a multiple of 32 is padded with zero rows */
    const int64_t Tp = (T + 31) / 32 * 32;
    uint16_t* padded = NULL;
    const uint16_t* xa = (const uint16_t*)x;
    int64_t xs = x_st;
    if (Tp != T) {
        padded = (uint16_t*)calloc((size_t)(Tp * K), sizeof(uint16_t));
        if (padded == NULL) return -1;
        for (int64_t t = 0; t < T; ++t) memcpy(padded + t * K, xa + t * x_st, sizeof(uint16_t) * K);
        xa = padded;
        xs = K;
    }
    const uint16_t* w = (const uint16_t*)weight;
    const int64_t KB = K / 32, stride = xs * (int64_t)sizeof(uint16_t);
#pragma omp parallel num_threads(num_threads) if (N * K >= 65536)
    {
        tile_config cfg = {0};
        cfg.palette = 1;
        for (int i = 0; i < 8; ++i) { cfg.rows[i] = 16; cfg.colsb[i] = 64; }  /* 0-3 sums, 4-5 W, 6-7 x */
        _tile_loadconfig(&cfg);
        float acc[4][16 * 16];
#pragma omp for schedule(static)
        for (int64_t np = 0; np < N / 32; ++np) {  /* 32 outputs: two panels of W */
            const uint16_t* panel = w + 2 * np * KB * 512;  /* panel nb: one 1 KB tile per 32 of K */
            for (int64_t m0 = 0; m0 < Tp; m0 += 32) {
                const char* a = (const char*)(xa + m0 * xs);
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
                        amx_epilogue(acc[q], t0, rows, 32 * np + 16 * (q % 2), N, (const uint16_t*)bias, op,
                                     (const uint16_t*)other, other_st, (uint16_t*)y);
                }
            }
        }
        _tile_release();
    }
    free(padded);
    return 0;
#else
    (void)x; (void)x_st; (void)weight; (void)bias; (void)T; (void)K; (void)N; (void)op; (void)other; (void)other_st;
    (void)y; (void)num_threads;
    return -1;
#endif
}

/*
 * decode_stack: every decoder layer of a decode-only step of at most LINEAR_MAX_T sequences, bf16, in one call:
 * per layer RMSNorm, QKV (linear_small or linear_amx), rotary embedding + K/V write + attention
 * (rope_paged_attention), O plus the residual, RMSNorm, SiLU(gate) * up, down plus the residual; the same C
 * functions the layer-by-layer path calls, so the result is the same to the bit. What it saves is the Python between them: at batch 1 a layer's eight calls,
 * their argument checks and the per-layer conversions of the step's metadata cost more than its attention.
 * h: [T, Dm] residual stream, updated in place. Per-layer arrays (num_layers pointers each): the two norms' weights,
 * the QKV, O, gate, up and down weights (linear_small's layout), the QKV bias (NULL entries: none), the same five
 * weights in linear_amx's layout (NULL entries where there are none: then only T <= small_rows runs), the K and V
 * pools. Up to small_rows rows the projections run linear_small, above it linear_amx.
 * Scratch: x [T, Dm], qkv [T, Nqkv], attn [T, H * D], gate and up [T, I]. Returns 0, or -1 if a projection refused.
 */
static int stack_linear(const void* x, int64_t x_st, const void* small_w, const void* amx_w, const void* bias,
                        int64_t T, int64_t small_rows, int64_t K, int64_t N, int op, const void* other,
                        int64_t other_st, void* y, int num_threads) {
    if (T <= small_rows) return linear_small(x, x_st, small_w, bias, T, K, N, op, other, other_st, y, num_threads);
    if (amx_w == NULL) return -1;
    return linear_amx(x, x_st, amx_w, bias, T, K, N, op, other, other_st, y, num_threads);
}

int decode_stack(void* h, int64_t T, int64_t Dm, int64_t num_layers, const void* const* norm1,
                 const void* const* qkv_w, const void* const* qkv_b, const void* const* o_w,
                 const void* const* norm2, const void* const* gate_w, const void* const* up_w,
                 const void* const* down_w, const void* const* qkv_a, const void* const* o_a,
                 const void* const* gate_a, const void* const* up_a, const void* const* down_a, int64_t small_rows,
                 int64_t I, float eps, const int64_t* positions, const void* cos,
                 const void* sin_signed, const int64_t* slots, void* const* k_caches, void* const* v_caches,
                 int64_t c_sb, int64_t c_ss, int64_t c_sh, const int32_t* block_tables, int64_t bt_sb,
                 const int32_t* context_lens, int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale,
                 int64_t max_context, void* x, void* qkv, void* attn, void* gate, void* up, int num_threads) {
    const int64_t Nqkv = (H + 2 * KVH) * D;
    for (int64_t l = 0; l < num_layers; ++l) {
        rms_norm(h, Dm, norm1[l], x, T, Dm, eps, DTYPE_BF16, num_threads);
        if (stack_linear(x, Dm, qkv_w[l], qkv_a[l], qkv_b[l], T, small_rows, Dm, Nqkv, 0, NULL, 0, qkv, num_threads))
            return -1;
        rope_paged_attention(qkv, Nqkv, T, positions, cos, sin_signed, slots, k_caches[l], v_caches[l], c_sb, c_ss,
                             c_sh, T, block_tables, bt_sb, context_lens, H, KVH, D, block_size, scale, max_context,
                             attn, H * D, D, DTYPE_BF16, num_threads);
        if (stack_linear(attn, H * D, o_w[l], o_a[l], NULL, T, small_rows, H * D, Dm, 3, h, Dm, h, num_threads))
            return -1;
        rms_norm(h, Dm, norm2[l], x, T, Dm, eps, DTYPE_BF16, num_threads);
        if (stack_linear(x, Dm, gate_w[l], gate_a[l], NULL, T, small_rows, Dm, I, 1, NULL, 0, gate, num_threads))
            return -1;
        if (stack_linear(x, Dm, up_w[l], up_a[l], NULL, T, small_rows, Dm, I, 2, gate, I, up, num_threads)) return -1;
        if (stack_linear(up, I, down_w[l], down_a[l], NULL, T, small_rows, I, Dm, 3, h, Dm, h, num_threads))
            return -1;
    }
    return 0;
}
