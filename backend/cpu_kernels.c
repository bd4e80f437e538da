/*
 * CPU kernels for the two places where eager torch spends more time on overhead than on work. Both are C twins of
 * torch code (same inputs, same result within float rounding); backend/cpu_kernels.py builds this file at first use
 * (-O3 -march=native -ffast-math) and falls back to the torch code where it cannot.
 *
 * paged_decode_attention (twin of backend.attention.paged_decode_attention): one query token per sequence reads its
 * keys and values straight from the paged pool through its block table, so nothing is gathered into a temporary
 * copy first (the torch path copies every sequence's K/V once per layer, then reads the copy again). A work item is
 * one (sequence, KV head): its GROUP query heads share every K/V row it reads.
 *
 * rms_norm (twin of HF's LlamaRMSNorm): one pass per row instead of eight tensor ops; F.rms_norm in bf16 widens the
 * whole input to float32 and allocates per op, which made it 2.5x slower than layer_norm over a 4096-token prefill.
 *
 * Work is spread over torch's own OpenMP threads: this library's libgomp.so.1 resolves to the copy torch loaded.
 * Arithmetic is float32; bf16 inputs are widened on load and outputs rounded to nearest even, as torch does.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#define MAX_GROUP 16
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
 * One work item: the GROUP query heads of sequence b that share KV head kv_head, against its `len` cached tokens.
 * always_inline so that each call site below gets D and dtype as constants: the row loops are then fully unrolled
 * and vectorised, which made the kernel twice as fast at head_dim 64.
 */
static inline __attribute__((always_inline)) void attend_one(
    const char* q_rows, int64_t q_sh, const char* k_bytes, const char* v_bytes, int64_t c_sb, int64_t c_ss,
    const int32_t* table, int64_t len, int64_t block_size, int64_t G, const int64_t D, const int dtype, float scale,
    float* scores, int64_t max_context, char* out_rows, int64_t o_sh) {
    const int64_t esize = dtype == DTYPE_BF16 ? 2 : 4;
    const int64_t num_blocks = (len + block_size - 1) / block_size;
    float q[MAX_GROUP][MAX_HEAD_DIM], acc[MAX_GROUP][MAX_HEAD_DIM], row[MAX_HEAD_DIM];
    float max_score[MAX_GROUP], sum[MAX_GROUP];
    for (int64_t g = 0; g < G; ++g) {
        load_row(q_rows + g * q_sh * esize, dtype, D, q[g]);
        for (int64_t d = 0; d < D; ++d) {
            q[g][d] *= scale;
            acc[g][d] = 0.f;
        }
        max_score[g] = -FLT_MAX;
        sum[g] = 0.f;
    }
    /* scores[g][t] = q_g . k_t, block by block (no division per token) */
    for (int64_t i = 0, t = 0; i < num_blocks; ++i) {
        const char* block = k_bytes + table[i] * c_sb * esize;
        for (int64_t offset = 0; offset < block_size && t < len; ++offset, ++t) {
            load_row(block + offset * c_ss * esize, dtype, D, row);
            for (int64_t g = 0; g < G; ++g) {
                float dot = 0.f;
                for (int64_t d = 0; d < D; ++d) dot += q[g][d] * row[d];
                scores[g * max_context + t] = dot;
                max_score[g] = dot > max_score[g] ? dot : max_score[g];
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) {
        float* s = scores + g * max_context;
        for (int64_t t = 0; t < len; ++t) {
            s[t] = expf(s[t] - max_score[g]);
            sum[g] += s[t];
        }
    }
    /* acc[g] = sum_t p[g][t] v_t, normalised on the way out */
    for (int64_t i = 0, t = 0; i < num_blocks; ++i) {
        const char* block = v_bytes + table[i] * c_sb * esize;
        for (int64_t offset = 0; offset < block_size && t < len; ++offset, ++t) {
            load_row(block + offset * c_ss * esize, dtype, D, row);
            for (int64_t g = 0; g < G; ++g) {
                const float p = scores[g * max_context + t];
                for (int64_t d = 0; d < D; ++d) acc[g][d] += p * row[d];
            }
        }
    }
    for (int64_t g = 0; g < G; ++g) store_row(out_rows + g * o_sh * esize, dtype, D, acc[g], 1.f / sum[g]);
}

/*
 * Strides are in elements.
 * query:  [B, H, D] strides (q_sb, q_sh, 1)
 * k/v:    [num_blocks, block_size, KVH, D] strides (c_sb, c_ss, c_sh, 1), the same for K and V
 * block_tables: [B, *] int32 with row stride bt_sb; context_lens: [B] int32, each in [1, max_context]
 * out:    [B, H, D] strides (o_sb, o_sh, 1)
 */
void paged_decode_attention(const void* query, int64_t q_sb, int64_t q_sh, const void* k_cache, const void* v_cache,
                            int64_t c_sb, int64_t c_ss, int64_t c_sh, const int32_t* block_tables, int64_t bt_sb,
                            const int32_t* context_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                            int64_t block_size, float scale, int64_t max_context, void* out, int64_t o_sb,
                            int64_t o_sh, int dtype, int num_threads) {
    const int64_t G = H / KVH;
    const int64_t esize = dtype == DTYPE_BF16 ? 2 : 4;

#pragma omp parallel num_threads(num_threads)
    {
        float* scores = (float*)malloc(sizeof(float) * G * max_context);  /* (G, context) of the current item */
#pragma omp for schedule(static)
        for (int64_t item = 0; item < B * KVH; ++item) {
            const int64_t b = item / KVH, kv_head = item % KVH;
            const char* q_rows = (const char*)query + (b * q_sb + kv_head * G * q_sh) * esize;
            const char* k_bytes = (const char*)k_cache + kv_head * c_sh * esize;
            const char* v_bytes = (const char*)v_cache + kv_head * c_sh * esize;
            char* out_rows = (char*)out + (b * o_sb + kv_head * G * o_sh) * esize;
#define ATTEND(HEAD_DIM, DTYPE)                                                                                   \
    attend_one(q_rows, q_sh, k_bytes, v_bytes, c_sb, c_ss, block_tables + b * bt_sb, context_lens[b], block_size, \
               G, HEAD_DIM, DTYPE, scale, scores, max_context, out_rows, o_sh)
            if (D == 64 && dtype == DTYPE_BF16) ATTEND(64, DTYPE_BF16);
            else if (D == 128 && dtype == DTYPE_BF16) ATTEND(128, DTYPE_BF16);
            else if (D == 64) ATTEND(64, DTYPE_F32);
            else if (D == 128) ATTEND(128, DTYPE_F32);
            else ATTEND(D, dtype);
#undef ATTEND
        }
        free(scores);
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

int max_row(void) { return MAX_ROW; }
int max_group(void) { return MAX_GROUP; }
int max_head_dim(void) { return MAX_HEAD_DIM; }
