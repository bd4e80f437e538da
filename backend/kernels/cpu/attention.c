/*
 * paged_decode_attention (twin of paged_decode_attention in backend/engine/attention/torch_backend.py): one query
 * token per sequence reads its keys and values straight from the paged pool through its block table, so nothing is
 * gathered into a temporary copy first. A work item is a whole sequence (or one (sequence, KV head) when there are
 * few sequences): its query heads share every K/V row it reads.
 *
 * rope_paged_attention: the rotary embedding, the K/V write and the decodes' attention of one layer in one call,
 * from the QKV projection's output (the prefill chunks' attention is left to the caller).
 */
#include "common.h"

/* The pool is [blocks][block_size][KV heads][D], strides c_sb, c_ss and c_sh in elements. Where a slot (block *
 * block_size + offset) starts, and where a sequence's token t does, through its block table. */
static inline int64_t slot_at(int64_t slot, int64_t block_size, int64_t c_sb, int64_t c_ss) {
    return (slot / block_size) * c_sb + (slot % block_size) * c_ss;
}

static inline int64_t token_at(const int32_t* table, int64_t t, int64_t block_size, int64_t c_sb, int64_t c_ss) {
    return table[t / block_size] * c_sb + (t % block_size) * c_ss;
}

/*
 * One work item: the NK KV heads from kv_begin of sequence b (NK * G query heads), against its `len` cached tokens.
 * A whole sequence per item (NK = KVH) reads each cached token's K (then V) row for all heads as one contiguous run,
 * and the next block is prefetched row by row while the current one is read: the pool is far larger than the
 * caches, so the kernel runs at the speed it streams blocks in (one head's slice of each row, strided, leaves the
 * loads waiting on memory). always_inline so that each call site below gets D and dtype as constants: the row
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

/* One pass of attend_one over the item's cached rows of `bytes` (the K pool, then the V pool), block by block (no
 * division per token), each row of the block read next prefetched (`after`: the block read after the last): over K,
 * scores[j][t] = q_j . k_t and each query's running maximum; over V, acc[j] += p[j][t] v_t. */
static inline __attribute__((always_inline)) void attend_rows(
    const int over_v, const char* bytes, const char* after, int64_t c_sb, int64_t c_ss, int64_t c_sh,
    const int32_t* table, int64_t len, int64_t block_size, int64_t NK, int64_t G, const int64_t D, const int dtype,
    float* scores, int64_t max_context, const float* q, float* acc, float* max_score) {
    const int64_t esize = dtype == DTYPE_BF16 ? 2 : 4;
    const int64_t num_blocks = (len + block_size - 1) / block_size;
    const int64_t row_bytes = NK * c_sh * esize;  /* one token's K (or V) row over the item's heads */
    float row[MAX_HEAD_DIM];
    for (int64_t i = 0, t = 0; i < num_blocks; ++i) {
        const char* block = bytes + table[i] * c_sb * esize;
        const char* next = i + 1 < num_blocks ? bytes + table[i + 1] * c_sb * esize : after;
        for (int64_t offset = 0; offset < block_size && t < len; ++offset, ++t) {
            for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(next + offset * c_ss * esize + b);
            for (int64_t h = 0; h < NK; ++h) {
                load_row(block + (offset * c_ss + h * c_sh) * esize, dtype, D, row);
                for (int64_t g = 0; g < G; ++g) {
                    const int64_t j = h * G + g;
                    if (over_v) {
                        const float p = scores[j * max_context + t];
                        for (int64_t d = 0; d < D; ++d) acc[j * D + d] += p * row[d];
                    } else {
                        float dot = 0.f;
                        for (int64_t d = 0; d < D; ++d) dot += q[j * D + d] * row[d];
                        scores[j * max_context + t] = dot;
                        max_score[j] = dot > max_score[j] ? dot : max_score[j];
                    }
                }
            }
        }
    }
}

static inline __attribute__((always_inline)) void attend_one(
    const char* q_rows, int64_t q_sh, const char* k_bytes, const char* v_bytes, int64_t c_sb, int64_t c_ss,
    int64_t c_sh, const int32_t* table, int64_t len, int64_t block_size, int64_t NK, int64_t G, const int64_t D,
    const int dtype, float scale, float* scores, int64_t max_context, float* q, float* acc, char* out_rows,
    int64_t o_sh) {
    const int64_t esize = dtype == DTYPE_BF16 ? 2 : 4;
    const int64_t last = table[(len - 1) / block_size], NQ = NK * G;
    float max_score[MAX_HEADS], sum[MAX_HEADS];
    start_queries(q_rows, q_sh, dtype, D, NQ, scale, q, acc, max_score);
    attend_rows(0, k_bytes, v_bytes + table[0] * c_sb * esize, c_sb, c_ss, c_sh, table, len, block_size, NK, G, D,
                dtype, scores, max_context, q, acc, max_score);
    exp_scores(scores, max_context, max_score, NQ, len, sum);
    attend_rows(1, v_bytes, v_bytes + last * c_sb * esize, c_sb, c_ss, c_sh, table, len, block_size, NK, G, D, dtype,
                scores, max_context, q, acc, max_score);
    for (int64_t j = 0; j < NQ; ++j) store_row(out_rows + j * o_sh * esize, dtype, D, acc + j * D, 1.f / sum[j]);
}

/*
 * The same work item for head dims that are a multiple of 16, TILE tokens at a time. A head's TILE scores come out
 * of one reduction of TILE partial-sum vectors (a transpose-add tree: about 3 instructions a score instead of a
 * horizontal sum each). float32 items (and bf16 ones on the widened path) widen the tile's K (then V) rows to float32
 * once into `tile` (L1-resident), which every query head of the item then reads. bf16 items (`direct`) read the
 * pool's rows in place: the scores by vdpbf16ps on the bf16 pairs (score_bf16), and each V row widened in registers
 * once for the query heads of its KV head (weigh_values_bf16), with no float32 copy of the tile to write and read
 * back for every head. python -m bench.decode_attention times the two paths (docs/cpu-kernels.md).
 */
#define TILE 16
typedef int32_t v16i __attribute__((vector_size(64)));

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
        const char* src = base + token_at(table, t, block_size, c_sb, c_ss) * esize;
        if (ahead < len) {
            const char* next = base + token_at(table, ahead, block_size, c_sb, c_ss) * esize;
            for (int64_t b = 0; b < NK * c_sh * esize; b += 64) __builtin_prefetch(next + b);
        }
        for (int64_t h = 0; h < NK; ++h) load_row(src + h * c_sh * esize, dtype, D, tile + (tt * NK + h) * D);
    }
    for (int64_t tt = n; tt < TILE; ++tt) memset(tile + tt * NK * D, 0, sizeof(float) * NK * D);
}

/* The next tile's rows, prefetched a few lines at a time between the current tile's loads rather than all at once
 * (a burst of a whole tile's lines from scattered blocks left the loads waiting on memory). */
typedef struct {
    const char* rows[TILE];
    int64_t count, lines, row, line;
} TilePrefetch;

static inline void prefetch_tile(TilePrefetch* p, const uint16_t* pool, const int32_t* table, int64_t c_sb,
                                 int64_t c_ss, int64_t block_size, int64_t t0, int64_t len, int64_t row_bytes) {
    p->count = p->row = p->line = 0;
    p->lines = (row_bytes + 63) / 64;
    for (int64_t t = t0; t < len && t < t0 + TILE; ++t)
        p->rows[p->count++] = (const char*)(pool + token_at(table, t, block_size, c_sb, c_ss));
}

static inline void prefetch_some(TilePrefetch* p, int64_t k) {
    for (; k > 0 && p->row < p->count; --k) {
        __builtin_prefetch(p->rows[p->row] + 64 * p->line);
        if (++p->line == p->lines) {
            p->line = 0;
            ++p->row;
        }
    }
}

/* acc[j] += sum_t p[j][t] v_t for attend_tiled's bf16 item: each V row widened once from the pool for every query
 * head of its KV head (no float32 copy of the tile), up to PV_REGS accumulator vectors in registers at a time. */
#define PV_REGS 16
static inline __attribute__((always_inline)) void weigh_values_bf16(
    const uint16_t* v_pool, int64_t c_sb, int64_t c_ss, int64_t c_sh, const int32_t* table, int64_t len,
    int64_t block_size, int64_t NK, int64_t G, const int64_t D, const float* scores, int64_t max_context,
    float* acc) {
    const int64_t DV = D / 16, CH = PV_REGS / DV > 0 ? PV_REGS / DV : 1;  /* query heads a pass holds */
    const int64_t row_bytes = NK * c_sh * 2;
    for (int64_t t0 = 0; t0 < len; t0 += TILE) {
        const int64_t n = len - t0 < TILE ? len - t0 : TILE;
        const uint16_t* rows[TILE];
        for (int64_t tt = 0; tt < n; ++tt) {
            const int64_t t = t0 + tt;
            rows[tt] = v_pool + token_at(table, t, block_size, c_sb, c_ss);
        }
        TilePrefetch next;
        prefetch_tile(&next, v_pool, table, c_sb, c_ss, block_size, t0 + TILE, len, row_bytes);
        const int64_t steps = NK * ((G + CH - 1) / CH) * n, per_step = (next.count * next.lines + steps - 1) / steps;
        for (int64_t h = 0; h < NK; ++h) {
            for (int64_t g0 = 0; g0 < G; g0 += CH) {
                const int64_t m = G - g0 < CH ? G - g0 : CH, j0 = h * G + g0;
                v16f a[PV_REGS];
                for (int64_t g = 0; g < CH; ++g)
                    if (g < m)
                        for (int64_t c = 0; c < DV; ++c) a[g * DV + c] = load16(acc + (j0 + g) * D + 16 * c);
                for (int64_t tt = 0; tt < n; ++tt) {
                    prefetch_some(&next, per_step);
                    v16f v[MAX_HEAD_DIM / 16];
                    for (int64_t c = 0; c < DV; ++c) v[c] = widen_bf16(rows[tt] + h * c_sh + 16 * c);
                    for (int64_t g = 0; g < CH; ++g) {
                        if (g >= m) continue;
                        const v16f w = (v16f){0.f} + scores[(j0 + g) * max_context + t0 + tt];
                        for (int64_t c = 0; c < DV; ++c) a[g * DV + c] += w * v[c];
                    }
                }
                for (int64_t g = 0; g < CH; ++g)
                    if (g < m)
                        for (int64_t c = 0; c < DV; ++c) store16(acc + (j0 + g) * D + 16 * c, a[g * DV + c]);
            }
        }
    }
}

#if defined(__AVX512BF16__)
/* The scores of attend_tiled's item for bf16 heads of a multiple of 32 dimensions, straight from the pool's rows with
 * vdpbf16ps: each 64-byte line of a K row is 16 pairs of dimensions, met by the same pairs of the bf16 query, so
 * nothing is widened. A product of two bf16 is exact in float32: this differs from the widened path (and from torch)
 * only in the order of the float32 sums, and the scale is applied to the sum (exact for a power of two). */
static inline __attribute__((always_inline)) void score_bf16(
    const uint16_t* q_rows, int64_t q_sh, const uint16_t* k_pool, int64_t c_sb, int64_t c_ss, int64_t c_sh,
    const int32_t* table, int64_t len, int64_t block_size, int64_t NK, int64_t G, const int64_t D, float scale,
    float* scores, int64_t max_context, float* max_score) {
    const int64_t NQ = NK * G, DZ = D / 32;
    __m512bh qv[MAX_HEADS * (MAX_HEAD_DIM / 32)];
    __m512 vmax[MAX_HEADS];
    for (int64_t j = 0; j < NQ; ++j) {
        for (int64_t z = 0; z < DZ; ++z) qv[j * DZ + z] = (__m512bh)_mm512_loadu_si512(q_rows + j * q_sh + 32 * z);
        vmax[j] = _mm512_set1_ps(-FLT_MAX);
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    const int64_t row_bytes = NK * c_sh * 2;
    for (int64_t t0 = 0; t0 < len; t0 += TILE) {
        const int64_t n = len - t0 < TILE ? len - t0 : TILE;
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        const uint16_t* rows[TILE];
        for (int64_t tt = 0; tt < TILE; ++tt) {  /* past the context: the first row again, its scores not kept */
            const int64_t t = tt < n ? t0 + tt : t0;
            rows[tt] = k_pool + token_at(table, t, block_size, c_sb, c_ss);
        }
        TilePrefetch next;
        prefetch_tile(&next, k_pool, table, c_sb, c_ss, block_size, t0 + TILE, len, row_bytes);
        const int64_t per_step = (next.count * next.lines + NQ * TILE - 1) / (NQ * TILE);
        for (int64_t j = 0; j < NQ; ++j) {
            const int64_t h = j / G;
            v16f part[TILE];
            for (int64_t tt = 0; tt < TILE; ++tt) {
                prefetch_some(&next, per_step);
                const uint16_t* k = rows[tt] + h * c_sh;
                __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[j * DZ], (__m512bh)_mm512_loadu_si512(k));
                for (int64_t z = 1; z < DZ; ++z)
                    a = _mm512_dpbf16_ps(a, qv[j * DZ + z], (__m512bh)_mm512_loadu_si512(k + 32 * z));
                part[tt] = (v16f)a;
            }
            const __m512 sc = _mm512_mul_ps((__m512)reduce16(part), vscale);
            _mm512_mask_storeu_ps(scores + j * max_context + t0, valid, sc);
            vmax[j] = _mm512_mask_max_ps(vmax[j], valid, vmax[j], sc);
        }
    }
    for (int64_t j = 0; j < NQ; ++j) max_score[j] = _mm512_reduce_max_ps(vmax[j]);
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
/*
 * The direct bf16 item on a CPU with AVX2 and FMA but no AVX-512 (Zen 2 and 3): sixteen 8-float registers, where the
 * 16-float vectors above are register pairs (TILE tokens' partial sums alone fill all sixteen, and the reduction's
 * shuffles cross lanes). Work comes in pieces that fit: the scores of ATTEND_QUERIES query heads against
 * SCORE_TOKENS keys (12 accumulators, each K row widened in registers once for the three), and the values' sums of
 * ATTEND_QUERIES heads over 32 dimensions (12 accumulators, each V line widened once for the three). Tokens go in
 * the outer loop and KV heads inside it, so that every line of a token's row is used while it is in cache. A query
 * group that is not a multiple of ATTEND_QUERIES repeats its last head, the repeats' results not kept.
 */
#define ATTEND_QUERIES 3
#define SCORE_TOKENS 4

static inline __m128 sums4(__m256 a, __m256 b, __m256 c, __m256 d) {  /* the sums of a, b, c and d's lanes */
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* scores[j][t] = q_j . k_t (q pre-scaled float32, [NQ][D]) and each query's maximum, K rows read from the pool. */
static inline __attribute__((always_inline)) void score_avx2(
    const float* q, const uint16_t* k_pool, int64_t c_sb, int64_t c_ss, int64_t c_sh, const int32_t* table,
    int64_t len, int64_t block_size, int64_t NK, int64_t G, const int64_t D, float* scores, int64_t max_context,
    float* max_score) {
    const int64_t row_bytes = NK * c_sh * 2;
    for (int64_t t0 = 0; t0 < len; t0 += SCORE_TOKENS) {
        const int64_t n = len - t0 < SCORE_TOKENS ? len - t0 : SCORE_TOKENS;
        const uint16_t* rows[SCORE_TOKENS];
        for (int64_t tt = 0; tt < SCORE_TOKENS; ++tt) {  /* past the context: the first row again, not kept */
            const int64_t t = tt < n ? t0 + tt : t0;
            rows[tt] = k_pool + token_at(table, t, block_size, c_sb, c_ss);
        }
        for (int64_t t = t0 + TILE; t < len && t < t0 + TILE + SCORE_TOKENS; ++t) {  /* a tile ahead */
            const char* ahead = (const char*)(k_pool + token_at(table, t, block_size, c_sb, c_ss));
            for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(ahead + b);
        }
        for (int64_t h = 0; h < NK; ++h) {
            for (int64_t g0 = 0; g0 < G; g0 += ATTEND_QUERIES) {
                const float* qs[ATTEND_QUERIES];
                for (int64_t g = 0; g < ATTEND_QUERIES; ++g) qs[g] = q + (h * G + (g0 + g < G ? g0 + g : G - 1)) * D;
                __m256 a[ATTEND_QUERIES][SCORE_TOKENS];
                for (int64_t g = 0; g < ATTEND_QUERIES; ++g)
                    for (int64_t tt = 0; tt < SCORE_TOKENS; ++tt) a[g][tt] = _mm256_setzero_ps();
                for (int64_t c = 0; c < D; c += 8) {
                    for (int64_t tt = 0; tt < SCORE_TOKENS; ++tt) {
                        const __m256 k = widen8_bf16(rows[tt] + h * c_sh + c);
                        for (int64_t g = 0; g < ATTEND_QUERIES; ++g)
                            a[g][tt] = _mm256_fmadd_ps(_mm256_loadu_ps(qs[g] + c), k, a[g][tt]);
                    }
                }
                for (int64_t g = 0; g < ATTEND_QUERIES && g0 + g < G; ++g) {
                    const int64_t j = h * G + g0 + g;
                    float s[SCORE_TOKENS];
                    _mm_storeu_ps(s, sums4(a[g][0], a[g][1], a[g][2], a[g][3]));
                    for (int64_t tt = 0; tt < n; ++tt) {
                        scores[j * max_context + t0 + tt] = s[tt];
                        max_score[j] = s[tt] > max_score[j] ? s[tt] : max_score[j];
                    }
                }
            }
        }
    }
}

/* acc[j] += sum_t p[j][t] v_t, V rows read from the pool: per TILE tokens, per KV head, per 32 dimensions. */
static inline __attribute__((always_inline)) void weigh_values_avx2(
    const uint16_t* v_pool, int64_t c_sb, int64_t c_ss, int64_t c_sh, const int32_t* table, int64_t len,
    int64_t block_size, int64_t NK, int64_t G, const int64_t D, const float* scores, int64_t max_context,
    float* acc) {
    const int64_t row_bytes = NK * c_sh * 2;
    float spare[4 * 8] = {0.f};  /* where a repeated head's sums go */
    for (int64_t t0 = 0; t0 < len; t0 += TILE) {
        const int64_t n = len - t0 < TILE ? len - t0 : TILE;
        const uint16_t* rows[TILE];
        for (int64_t tt = 0; tt < n; ++tt) {
            const int64_t t = t0 + tt;
            rows[tt] = v_pool + token_at(table, t, block_size, c_sb, c_ss);
        }
        TilePrefetch next;
        prefetch_tile(&next, v_pool, table, c_sb, c_ss, block_size, t0 + TILE, len, row_bytes);
        const int64_t groups = (G + ATTEND_QUERIES - 1) / ATTEND_QUERIES;
        const int64_t per_step = (next.count * next.lines + NK * groups * n - 1) / (NK * groups * n);
        for (int64_t h = 0; h < NK; ++h) {
            for (int64_t g0 = 0; g0 < G; g0 += ATTEND_QUERIES) {
                const float* p[ATTEND_QUERIES];
                for (int64_t g = 0; g < ATTEND_QUERIES; ++g)
                    p[g] = scores + (h * G + (g0 + g < G ? g0 + g : G - 1)) * max_context + t0;
                for (int64_t d0 = 0; d0 < D; d0 += 32) {
                    float* out[ATTEND_QUERIES];
                    __m256 a[ATTEND_QUERIES][4];
                    for (int64_t g = 0; g < ATTEND_QUERIES; ++g) {
                        out[g] = g0 + g < G ? acc + (h * G + g0 + g) * D + d0 : spare;
                        for (int64_t c = 0; c < 4; ++c) a[g][c] = _mm256_loadu_ps(out[g] + 8 * c);
                    }
                    for (int64_t tt = 0; tt < n; ++tt) {
                        if (d0 == 0) prefetch_some(&next, per_step);
                        __m256 w[ATTEND_QUERIES];
                        for (int64_t g = 0; g < ATTEND_QUERIES; ++g) w[g] = _mm256_broadcast_ss(p[g] + tt);
                        const uint16_t* v = rows[tt] + h * c_sh + d0;
                        for (int64_t c = 0; c < 4; ++c) {
                            const __m256 x = widen8_bf16(v + 8 * c);
                            for (int64_t g = 0; g < ATTEND_QUERIES; ++g) a[g][c] = _mm256_fmadd_ps(w[g], x, a[g][c]);
                        }
                    }
                    for (int64_t g = 0; g < ATTEND_QUERIES; ++g)
                        for (int64_t c = 0; c < 4; ++c) _mm256_storeu_ps(out[g] + 8 * c, a[g][c]);
                }
            }
        }
    }
}
#endif

static inline __attribute__((always_inline)) void attend_tiled(
    const char* q_rows, int64_t q_sh, const char* k_bytes, const char* v_bytes, int64_t c_sb, int64_t c_ss,
    int64_t c_sh, const int32_t* table, int64_t len, int64_t block_size, int64_t NK, int64_t G, const int64_t D,
    const int dtype, float scale, float* scores, int64_t max_context, float* q, float* acc, float* tile,
    char* out_rows, int64_t o_sh, const int direct) {
    const int64_t esize = dtype == DTYPE_BF16 ? 2 : 4, NQ = NK * G, DV = D / 16;
    float max_score[MAX_HEADS], sum[MAX_HEADS];
    start_queries(q_rows, q_sh, dtype, D, NQ, scale, q, acc, max_score);
#if defined(__AVX512BF16__)
    if (direct && D % 32 == 0)
        score_bf16((const uint16_t*)q_rows, q_sh, (const uint16_t*)k_bytes, c_sb, c_ss, c_sh, table, len, block_size,
                   NK, G, D, scale, scores, max_context, max_score);
    else
#elif !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    if (direct && D % 32 == 0)
        score_avx2(q, (const uint16_t*)k_bytes, c_sb, c_ss, c_sh, table, len, block_size, NK, G, D, scores,
                   max_context, max_score);
    else
#endif
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
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
    if (direct && D % 32 == 0)
        weigh_values_avx2((const uint16_t*)v_bytes, c_sb, c_ss, c_sh, table, len, block_size, NK, G, D, scores,
                          max_context, acc);
    else
#endif
    if (direct)
        weigh_values_bf16((const uint16_t*)v_bytes, c_sb, c_ss, c_sh, table, len, block_size, NK, G, D, scores,
                          max_context, acc);
    else
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

/* Whether bf16 items widen each tile of K and V to float32 before using it, as the kernel did before score_bf16 and
 * weigh_values_bf16: the baseline that python -m bench.decode_attention times beside the direct path. float32 items
 * always take the widened path. */
static int decode_widened = 0;
int set_decode_attention_widened(int widened) {  /* returns the setting it replaces */
    const int before = decode_widened;
    decode_widened = widened;
    return before;
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
    const int direct = dtype == DTYPE_BF16 && !decode_widened;
    /* A sequence per item when there are enough of them to share out; else one (sequence, KV head) per item. */
    const int64_t NK = B >= 4 * num_threads && H <= MAX_HEADS ? KVH : 1, items_per_seq = KVH / NK;
    float* scores = (float*)malloc(sizeof(float) * NK * G * max_context);  /* (NK * G, context) of the item */
    float* q = (float*)malloc(sizeof(float) * NK * G * D);
    float* acc = (float*)malloc(sizeof(float) * NK * G * D);
    float* tile = (float*)malloc(sizeof(float) * TILE * NK * D);
    /* By the run schedule, dynamic,1 (backend/engine/openmp.py): the items' contexts differ in length, and a thread
     * kept off its core holds up one item, not its share. */
#pragma omp for schedule(runtime)
    for (int64_t item = 0; item < B * items_per_seq; ++item) {
        const int64_t b = item / items_per_seq, kv_begin = (item % items_per_seq) * NK;
        const char* q_rows = (const char*)query + (b * q_sb + kv_begin * G * q_sh) * esize;
        const char* k_bytes = (const char*)k_cache + kv_begin * c_sh * esize;
        const char* v_bytes = (const char*)v_cache + kv_begin * c_sh * esize;
        char* out_rows = (char*)out + (b * o_sb + kv_begin * G * o_sh) * esize;
#define ARGS(HEAD_DIM, DTYPE)                                                                                       \
    q_rows, q_sh, k_bytes, v_bytes, c_sb, c_ss, c_sh, block_tables + b * bt_sb, context_lens[b], block_size, NK, G, \
        HEAD_DIM, DTYPE, scale, scores, max_context, q, acc
        if (D == 64 && direct) attend_tiled(ARGS(64, DTYPE_BF16), tile, out_rows, o_sh, 1);
        else if (D == 128 && direct) attend_tiled(ARGS(128, DTYPE_BF16), tile, out_rows, o_sh, 1);
        else if (D == 64 && dtype == DTYPE_BF16) attend_tiled(ARGS(64, DTYPE_BF16), tile, out_rows, o_sh, 0);
        else if (D == 128 && dtype == DTYPE_BF16) attend_tiled(ARGS(128, DTYPE_BF16), tile, out_rows, o_sh, 0);
        else if (D == 64) attend_tiled(ARGS(64, DTYPE_F32), tile, out_rows, o_sh, 0);
        else if (D == 128) attend_tiled(ARGS(128, DTYPE_F32), tile, out_rows, o_sh, 0);
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
 * One layer's attention for a decode-heavy step, after the QKV projection: the rotary embedding applied in place
 * to the q and k heads of every token's row of qkv [T, (H + 2 KVH) D] (row stride qkv_st), each token's k and v
 * heads stored in the pool at its slot (negative slots skipped), then the first `num_decodes` tokens attend (as
 * paged_decode_attention; their query rows are qkv's rows); the rows of `out` past num_decodes are not written. One
 * parallel region instead of a dozen tensor ops.
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
            const int64_t at = slot_at(slots[t], block_size, c_sb, c_ss);
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
 * prefill_attention (twin of attend_prefills in backend/engine/attention/torch_backend.py): each prefill chunk's
 * queries attend to the chunk's cached prefix and to the chunk itself, causally, after rope_paged_attention has
 * rotated them in qkv and written every token's K/V to the pool. Chunk c is chunks[c] = (first token in the step's
 * stream, query tokens n, cached tokens, offset into `slots`), and slots[offset .. offset + cached + n) are the pool
 * slots of its whole context in order. bf16 only, D a multiple of 64, where vdpbf16ps exists: it returns 0, else -1
 * and writes nothing (the caller runs the torch twin).
 *
 * Why not torch's SDPA: at a prefill's sizes (a chunk of 128-512 tokens, 64-dim heads) its flash kernel ran at a
 * few tens of GFLOP/s, a sixth of one forward step's time for a 128-token prompt. Here each chunk's K and V are laid
 * out once per (chunk, KV head) as vdpbf16ps reads them (K: [ctx/16][D/2][16 keys][2], so one 64-byte line is one
 * pair of dimensions of 16 keys, met by a query's pair broadcast; V: [ctx/2][D/16][16 dims][2], one line a pair of
 * keys of 16 dimensions, met by a pair of probabilities broadcast), and every line loaded meets PREFILL_ROWS query
 * vectors. Scores and sums are float32; the probabilities are rounded to bf16 for the P.V products, as torch's
 * bf16 SDPA does.
 */
#if defined(__AVX512BF16__)
#define PREFILL_ROWS 4          /* query vectors met by each K or V line loaded: their sums stay in registers */
#define PREFILL_QUERY_BLOCK 16  /* query tokens of one work item (times the group's heads) */
#define PREFILL_KERNEL 1
typedef uint16_t prefill_pack_t;

static inline int64_t round_up16(int64_t n) { return (n + 15) & ~(int64_t)15; }

/* One (chunk, KV head)'s K and V, from the pool through the chunk's context slots, into the layouts above; zero past
 * the context (a zero probability times a zero V, never times whatever the buffer held). */
static void pack_prefill_kv(const uint16_t* k_cache, const uint16_t* v_cache, int64_t c_sb, int64_t c_ss,
                            int64_t c_sh, int64_t block_size, const int64_t* slots, int64_t len, int64_t kh,
                            int64_t D, uint32_t* kp, uint16_t* vp) {
    const int64_t padded = round_up16(len), pairs = D / 2, lines = D / 16;
    memset(kp, 0, padded * D * sizeof(uint16_t));
    memset(vp, 0, padded * D * sizeof(uint16_t));
    for (int64_t j = 0; j < len; ++j) {
        const int64_t at = slot_at(slots[j], block_size, c_sb, c_ss) + kh * c_sh;
        const uint16_t* k = k_cache + at;
        const uint16_t* v = v_cache + at;
        for (int64_t d2 = 0; d2 < pairs; ++d2) memcpy(kp + ((j / 16) * pairs + d2) * 16 + j % 16, k + 2 * d2, 4);
        for (int64_t d = 0; d < D; ++d) vp[(((j / 2) * lines + d / 16) * 16 + d % 16) * 2 + j % 2] = v[d];
    }
}

/* PREFILL_ROWS query vectors (rows[r]: the query's bf16 row; limit[r]: the keys it sees, 1 + its position) against
 * the packed K and V of their KV head; out_rows[r] gets each one's output (NULL: a padding vector, not written).
 * scores: PREFILL_ROWS x padded floats; probs: PREFILL_ROWS x padded bf16. */
static inline __attribute__((always_inline)) void prefill_vectors(
    const uint16_t* const rows[PREFILL_ROWS], const int64_t limit[PREFILL_ROWS], uint16_t* const out_rows[PREFILL_ROWS],
    const uint32_t* kp, const uint16_t* vp, const int64_t D, float scale, float* scores, uint16_t* probs,
    int64_t padded) {
    int64_t keys = 0;
    for (int r = 0; r < PREFILL_ROWS; ++r) keys = limit[r] > keys ? limit[r] : keys;
    const int64_t blocks = (keys + 15) / 16, pairs = D / 2, lines = D / 16;
    const __m512 vscale = _mm512_set1_ps(scale);
    __m512 vmax[PREFILL_ROWS];
    for (int r = 0; r < PREFILL_ROWS; ++r) vmax[r] = _mm512_set1_ps(-FLT_MAX);
    for (int64_t kb = 0; kb < blocks; ++kb) {  /* scores of 16 keys at a time, each row's running maximum */
        __m512 acc[PREFILL_ROWS];
        for (int r = 0; r < PREFILL_ROWS; ++r) acc[r] = _mm512_setzero_ps();
        const uint32_t* line = kp + kb * pairs * 16;
        for (int64_t d2 = 0; d2 < pairs; ++d2) {
            const __m512bh k = (__m512bh)_mm512_loadu_si512(line + d2 * 16);
            for (int r = 0; r < PREFILL_ROWS; ++r) {
                uint32_t q;
                memcpy(&q, rows[r] + 2 * d2, 4);
                acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_set1_epi32((int)q), k);
            }
        }
        const __m512i key = _mm512_add_epi32(_mm512_set1_epi32((int)(kb * 16)),
                                             _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        for (int r = 0; r < PREFILL_ROWS; ++r) {
            const __mmask16 seen = _mm512_cmplt_epi32_mask(key, _mm512_set1_epi32((int)limit[r]));
            const __m512 s = _mm512_mask_mov_ps(_mm512_set1_ps(-FLT_MAX), seen, _mm512_mul_ps(acc[r], vscale));
            vmax[r] = _mm512_max_ps(vmax[r], s);
            _mm512_storeu_ps(scores + r * padded + kb * 16, s);
        }
    }
    float inv_sum[PREFILL_ROWS];
    for (int r = 0; r < PREFILL_ROWS; ++r) {  /* the softmax's numerators, rounded to bf16 for P.V; their sum */
        const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(vmax[r]));
        __m512 total = _mm512_setzero_ps();
        for (int64_t kb = 0; kb < blocks; ++kb) {
            const __m512 s = _mm512_loadu_ps(scores + r * padded + kb * 16);
            const __mmask16 seen = _mm512_cmp_ps_mask(s, _mm512_set1_ps(-FLT_MAX), _CMP_GT_OQ);
            const __m512 p = _mm512_maskz_mov_ps(seen, exp16(_mm512_max_ps(_mm512_sub_ps(s, m),
                                                                          _mm512_set1_ps(-127.f))));
            total = _mm512_add_ps(total, p);
            _mm256_storeu_si256((__m256i*)(probs + r * padded + kb * 16), (__m256i)_mm512_cvtneps_pbh(p));
        }
        inv_sum[r] = 1.f / _mm512_reduce_add_ps(total);
    }
    for (int64_t l0 = 0; l0 < lines; l0 += 4) {  /* out = P.V, 64 dimensions at a time: 16 sums in registers */
        __m512 acc[PREFILL_ROWS][4];
        for (int r = 0; r < PREFILL_ROWS; ++r)
            for (int l = 0; l < 4; ++l) acc[r][l] = _mm512_setzero_ps();
        for (int64_t j2 = 0; j2 < blocks * 8; ++j2) {
            const uint16_t* line = vp + (j2 * lines + l0) * 32;
            __m512bh v[4];
            for (int l = 0; l < 4; ++l) v[l] = (__m512bh)_mm512_loadu_si512(line + l * 32);
            for (int r = 0; r < PREFILL_ROWS; ++r) {
                uint32_t p;
                memcpy(&p, probs + r * padded + 2 * j2, 4);
                const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)p);
                for (int l = 0; l < 4; ++l) acc[r][l] = _mm512_dpbf16_ps(acc[r][l], pb, v[l]);
            }
        }
        for (int r = 0; r < PREFILL_ROWS; ++r) {
            if (!out_rows[r]) continue;
            for (int l = 0; l < 4; ++l)
                _mm256_storeu_si256((__m256i*)(out_rows[r] + (l0 + l) * 16),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][l], _mm512_set1_ps(inv_sum[r]))));
        }
    }
}
#endif

#if !defined(__AVX512BF16__) && defined(__AVX2__) && defined(__FMA__)
/* The same kernel on a CPU with AVX2 and no bf16 dot product (Zen 2 and 3), in float32: each (chunk, KV head)'s K is
 * widened once into [ctx/16][D][16 keys] (one d of 16 keys in two vectors, met by a query's d broadcast) and its V
 * into rows [ctx][D] (16 dimensions of a key in two vectors, met by a probability broadcast); every pair of vectors
 * loaded meets PREFILL_ROWS queries, 12 sums in registers, as the AVX2 projections' panels do. The probabilities stay
 * float32. */
#define PREFILL_ROWS 6
#define PREFILL_QUERY_BLOCK 16
typedef float prefill_pack_t;

static inline int64_t round_up16(int64_t n) { return (n + 15) & ~(int64_t)15; }

static void pack_prefill_kv(const uint16_t* k_cache, const uint16_t* v_cache, int64_t c_sb, int64_t c_ss,
                            int64_t c_sh, int64_t block_size, const int64_t* slots, int64_t len, int64_t kh,
                            int64_t D, float* kp, float* vp) {
    const int64_t padded = round_up16(len);
    memset(kp, 0, padded * D * sizeof(float));
    memset(vp, 0, padded * D * sizeof(float));
    for (int64_t j = 0; j < len; ++j) {
        const int64_t at = slot_at(slots[j], block_size, c_sb, c_ss) + kh * c_sh;
        const uint16_t* k = k_cache + at;
        const uint16_t* v = v_cache + at;
        float* kt = kp + (j / 16) * D * 16 + j % 16;
        for (int64_t d = 0; d < D; ++d) kt[d * 16] = bf16_value(k[d]);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(vp + j * D + d, widen8_bf16(v + d));
    }
}

static inline __attribute__((always_inline)) void prefill_vectors(
    const uint16_t* const rows[PREFILL_ROWS], const int64_t limit[PREFILL_ROWS], uint16_t* const out_rows[PREFILL_ROWS],
    const float* kp, const float* vp, const int64_t D, float scale, float* scores, float* probs, int64_t padded) {
    int64_t keys = 0;
    for (int r = 0; r < PREFILL_ROWS; ++r) keys = limit[r] > keys ? limit[r] : keys;
    const int64_t blocks = (keys + 15) / 16;
    float q[PREFILL_ROWS][MAX_HEAD_DIM];
    for (int r = 0; r < PREFILL_ROWS; ++r) load_row(rows[r], DTYPE_BF16, D, q[r]);
    const __m256 vscale = _mm256_set1_ps(scale), lowest = _mm256_set1_ps(-FLT_MAX);
    __m256 vmax[PREFILL_ROWS];
    for (int r = 0; r < PREFILL_ROWS; ++r) vmax[r] = lowest;
    for (int64_t kb = 0; kb < blocks; ++kb) {  /* scores of 16 keys at a time, each row's running maximum */
        __m256 acc[PREFILL_ROWS][2];
        for (int r = 0; r < PREFILL_ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        const float* line = kp + kb * D * 16;
        for (int64_t d = 0; d < D; ++d) {
            const __m256 k0 = _mm256_loadu_ps(line + d * 16), k1 = _mm256_loadu_ps(line + d * 16 + 8);
            for (int r = 0; r < PREFILL_ROWS; ++r) {
                const __m256 qd = _mm256_broadcast_ss(q[r] + d);
                acc[r][0] = _mm256_fmadd_ps(qd, k0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(qd, k1, acc[r][1]);
            }
        }
        for (int r = 0; r < PREFILL_ROWS; ++r) {
            for (int h = 0; h < 2; ++h) {
                const __m256i key = _mm256_add_epi32(_mm256_set1_epi32((int)(kb * 16 + 8 * h)),
                                                     _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
                const __m256 seen = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32((int)limit[r]), key));
                const __m256 sc = _mm256_blendv_ps(lowest, _mm256_mul_ps(acc[r][h], vscale), seen);
                vmax[r] = _mm256_max_ps(vmax[r], sc);
                _mm256_storeu_ps(scores + r * padded + kb * 16 + 8 * h, sc);
            }
        }
    }
    float inv_sum[PREFILL_ROWS];
    for (int r = 0; r < PREFILL_ROWS; ++r) {  /* the softmax's numerators (zero where a key is not seen); their sum */
        float m8[8];
        _mm256_storeu_ps(m8, vmax[r]);
        float m = m8[0];
        for (int i = 1; i < 8; ++i) m = m8[i] > m ? m8[i] : m;
        __m256 total = _mm256_setzero_ps();
        for (int64_t j = 0; j < blocks * 16; j += 8) {
            const __m256 sc = _mm256_loadu_ps(scores + r * padded + j);
            const __m256 seen = _mm256_cmp_ps(sc, lowest, _CMP_GT_OQ);
            const __m256 p = _mm256_and_ps(seen, exp8(_mm256_max_ps(_mm256_sub_ps(sc, _mm256_set1_ps(m)),
                                                                    _mm256_set1_ps(-87.f))));
            total = _mm256_add_ps(total, p);
            _mm256_storeu_ps(probs + r * padded + j, p);
        }
        float t8[8];
        _mm256_storeu_ps(t8, total);
        inv_sum[r] = 1.f / (((t8[0] + t8[1]) + (t8[2] + t8[3])) + ((t8[4] + t8[5]) + (t8[6] + t8[7])));
    }
    for (int64_t d0 = 0; d0 < D; d0 += 16) {  /* out = P.V, 16 dimensions at a time */
        __m256 acc[PREFILL_ROWS][2];
        for (int r = 0; r < PREFILL_ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (int64_t j = 0; j < blocks * 16; ++j) {
            const __m256 v0 = _mm256_loadu_ps(vp + j * D + d0), v1 = _mm256_loadu_ps(vp + j * D + d0 + 8);
            for (int r = 0; r < PREFILL_ROWS; ++r) {
                const __m256 p = _mm256_broadcast_ss(probs + r * padded + j);
                acc[r][0] = _mm256_fmadd_ps(p, v0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(p, v1, acc[r][1]);
            }
        }
        for (int r = 0; r < PREFILL_ROWS; ++r) {
            if (!out_rows[r]) continue;
            const __m256 inv = _mm256_set1_ps(inv_sum[r]);
            store8_bf16(out_rows[r] + d0, _mm256_mul_ps(acc[r][0], inv));
            store8_bf16(out_rows[r] + d0 + 8, _mm256_mul_ps(acc[r][1], inv));
        }
    }
}
#define PREFILL_KERNEL 1
#endif

int prefill_attention(const void* qkv, int64_t qkv_st, const void* k_cache, const void* v_cache, int64_t c_sb,
                      int64_t c_ss, int64_t c_sh, int64_t block_size, const int64_t* chunks, int64_t num_chunks,
                      const int64_t* slots, int64_t H, int64_t KVH, int64_t D, float scale, void* out, int64_t o_st,
                      int64_t o_sh, int dtype, int num_threads) {
#if defined(PREFILL_KERNEL)
    if (dtype != DTYPE_BF16 || D % 64 != 0 || D > MAX_HEAD_DIM || H % KVH != 0) return -1;
    const int64_t G = H / KVH;
    /* Where each (chunk, KV head)'s packed K and V start, and the work items: (chunk, KV head, block of query
     * tokens), a chunk's last blocks (the most keys) first so that the threads end together. */
    int64_t* packed_at = (int64_t*)malloc(sizeof(int64_t) * (num_chunks + 1));
    int64_t* first_item = (int64_t*)malloc(sizeof(int64_t) * (num_chunks + 1));
    int64_t widest = 0;
    packed_at[0] = first_item[0] = 0;
    for (int64_t c = 0; c < num_chunks; ++c) {
        const int64_t len = chunks[4 * c + 2] + chunks[4 * c + 1], padded = round_up16(len);
        widest = padded > widest ? padded : widest;
        packed_at[c + 1] = packed_at[c] + KVH * padded * D;
        first_item[c + 1] = first_item[c] + KVH * ((chunks[4 * c + 1] + PREFILL_QUERY_BLOCK - 1) / PREFILL_QUERY_BLOCK);
    }
    prefill_pack_t* kpack = (prefill_pack_t*)malloc(sizeof(prefill_pack_t) * packed_at[num_chunks]);
    prefill_pack_t* vpack = (prefill_pack_t*)malloc(sizeof(prefill_pack_t) * packed_at[num_chunks]);
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_chunks * KVH; ++item) {
            const int64_t c = item / KVH, kh = item % KVH, len = chunks[4 * c + 2] + chunks[4 * c + 1];
            const int64_t at = packed_at[c] + kh * round_up16(len) * D;
            pack_prefill_kv((const uint16_t*)k_cache, (const uint16_t*)v_cache, c_sb, c_ss, c_sh, block_size,
                            slots + chunks[4 * c + 3], len, kh, D, (void*)(kpack + at), vpack + at);
        }
        float* scores = (float*)malloc(sizeof(float) * PREFILL_ROWS * widest);
        prefill_pack_t* probs = (prefill_pack_t*)malloc(sizeof(prefill_pack_t) * PREFILL_ROWS * widest);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < first_item[num_chunks]; ++item) {
            int64_t c = 0;
            while (first_item[c + 1] <= item) ++c;
            const int64_t start = chunks[4 * c], n = chunks[4 * c + 1], cached = chunks[4 * c + 2];
            const int64_t blocks = (n + PREFILL_QUERY_BLOCK - 1) / PREFILL_QUERY_BLOCK;
            const int64_t kh = (item - first_item[c]) / blocks, qb = blocks - 1 - (item - first_item[c]) % blocks;
            const int64_t padded = round_up16(cached + n), at = packed_at[c] + kh * padded * D;
            const int64_t i0 = qb * PREFILL_QUERY_BLOCK;
            const int64_t i1 = i0 + PREFILL_QUERY_BLOCK < n ? i0 + PREFILL_QUERY_BLOCK : n;
            const int64_t vectors = (i1 - i0) * G;  /* (token, head of the group), token-major */
            for (int64_t v0 = 0; v0 < vectors; v0 += PREFILL_ROWS) {
                const uint16_t* rows[PREFILL_ROWS];
                int64_t limit[PREFILL_ROWS];
                uint16_t* out_rows[PREFILL_ROWS];
                for (int r = 0; r < PREFILL_ROWS; ++r) {
                    const int64_t v = v0 + r < vectors ? v0 + r : v0;  /* padding repeats the first, unwritten */
                    const int64_t t = start + i0 + v / G, h = kh * G + v % G;
                    rows[r] = (const uint16_t*)qkv + t * qkv_st + h * D;
                    limit[r] = cached + i0 + v / G + 1;
                    out_rows[r] = v0 + r < vectors ? (uint16_t*)out + t * o_st + h * o_sh : NULL;
                }
                if (D == 64)
                    prefill_vectors(rows, limit, out_rows, (const void*)(kpack + at), vpack + at, 64, scale,
                                    scores, probs, padded);
                else
                    prefill_vectors(rows, limit, out_rows, (const void*)(kpack + at), vpack + at, D, scale,
                                    scores, probs, padded);
            }
        }
        free(scores);
        free(probs);
    }
    free(kpack);
    free(vpack);
    free(packed_at);
    free(first_item);
    return 0;
#else
    (void)qkv; (void)qkv_st; (void)k_cache; (void)v_cache; (void)c_sb; (void)c_ss; (void)c_sh; (void)block_size;
    (void)chunks; (void)num_chunks; (void)slots; (void)H; (void)KVH; (void)D; (void)scale; (void)out; (void)o_st;
    (void)o_sh; (void)dtype; (void)num_threads;
    return -1;
#endif
}

int prefill_attention_available(void) {
#if defined(PREFILL_KERNEL)
    return 1;
#else
    return 0;
#endif
}

int max_group(void) { return MAX_GROUP; }
int max_head_dim(void) { return MAX_HEAD_DIM; }
