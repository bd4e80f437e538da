#include "common.h"

/*
 * sample_rows (twin of sample_rows in backend/engine/sampler.py): one token per row of logits [*, V] (row stride
 * `stride`), for the R rows named in `rows` (NULL: the first R), each with its row of `settings` (temperature, top_k,
 * top_p, u, as doubles: one array from the caller instead of four): argmax where temperature is 0, else a draw
 * from softmax(x / T) restricted to its top-k and top-p prefix, by inverse CDF with the row's own uniform number u in
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

/*
 * token_logprobs (twin of token_logprobs in backend/engine/sampler.py): for each of the R rows named in `rows`
 * (NULL: the first R), the picked token's log-probability under softmax(x * inv_t[r]) and its rank (1 + the tokens
 * with a larger logit), and the row's k likeliest tokens (largest first; ties in index order) with theirs. Non-finite
 * (banned) logits have probability 0 (log-probability -inf). One pass loads the row, one weighs it (the weights and
 * their sum, as the draw weighs them), one counts the rank, one keeps the top k: no log-softmax of the row is
 * written, and rows run on the threads in parallel.
 */
static void logprobs_one(const void* src, int dtype, int64_t V, float inv_t, int64_t token, int k, float* logprob,
                         int64_t* rank, int64_t* top_ids, float* top_vals, const sample_scratch* scratch) {
    float* x = scratch->x;
    float* w = scratch->w;
    float m = -FLT_MAX;
    for (int64_t i = 0; i < V; ++i) {  /* non-finite (banned) logits sink below every finite one */
        const uint32_t bits = dtype == DTYPE_BF16 ? (uint32_t)((const uint16_t*)src)[i] << 16
                                                  : bits_of(((const float*)src)[i]);
        x[i] = (bits & 0x7F800000u) == 0x7F800000u ? -FLT_MAX : float_of(bits);
        m = x[i] > m ? x[i] : m;
    }
    double total;
    weigh_and_sum(x, w, V, m, inv_t, NULL, 0, &total, NULL, NULL);  /* banned tokens weigh 0 */
    const double log_total = log(total);
    double mass;
    int64_t above;
    sum_where(x, w, V, x[token], ABOVE, &mass, &above);
    *rank = above + 1;
    *logprob = x[token] == -FLT_MAX ? -INFINITY : (float)((double)(x[token] - m) * inv_t - log_total);
    int n = 0;  /* the top k so far, largest first; a token enters only above the k-th (ties keep index order) */
    for (int64_t i = 0; k > 0 && i < V; ++i) {
#if defined(__AVX512F__)
        /* Once k are kept, almost no token enters: 16 at a time are passed over with one compare. */
        if (n == k && (i & 15) == 0 && i + 16 <= V &&
            !_mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), _mm512_set1_ps(top_vals[k - 1]), _CMP_GT_OQ)) {
            i += 15;
            continue;
        }
#endif
        if (n == k && !(x[i] > top_vals[k - 1])) continue;
        int j = n < k ? n++ : k - 1;
        for (; j > 0 && top_vals[j - 1] < x[i]; --j) {
            top_vals[j] = top_vals[j - 1];
            top_ids[j] = top_ids[j - 1];
        }
        top_vals[j] = x[i];
        top_ids[j] = i;
    }
    for (int j = 0; j < n; ++j)
        top_vals[j] = top_vals[j] == -FLT_MAX ? -INFINITY : (float)((double)(top_vals[j] - m) * inv_t - log_total);
}

void token_logprobs(const void* logits, int64_t stride, int dtype, int64_t V, const int64_t* rows, int64_t R,
                    const float* inv_t, const int64_t* tokens, int k, float* logprob, int64_t* rank, int64_t* top_ids,
                    float* top_vals, int num_threads) {
    const int64_t esize = dtype == DTYPE_BF16 ? 2 : 4;
#pragma omp parallel num_threads(num_threads) if (R > 1)
    {
        sample_scratch scratch = {(float*)malloc(sizeof(float) * V), (float*)malloc(sizeof(float) * V), NULL, NULL,
                                  NULL};
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < R; ++r)
            logprobs_one((const char*)logits + (rows ? rows[r] : r) * stride * esize, dtype, V, inv_t[r], tokens[r],
                         k, logprob + r, rank + r, top_ids + r * k, top_vals + r * k, &scratch);
        free(scratch.x);
        free(scratch.w);
    }
}

/*
 * apply_token_bitmask (twin of the numpy write in backend/engine/structured_output.py): each of the R named rows of
 * logits [*, V] (row stride `stride`) gets -inf wherever its grammar's bitmask (row i of `bitmask` [R, words], bit
 * t % 32 of word t / 32, 1: allowed) has a 0. A word with no allowed token is written whole, one with every token
 * allowed skipped, the rest bit by bit: a JSON state forbids nearly everything, a free-text one nearly nothing.
 */
void apply_token_bitmask(void* logits, int64_t stride, int dtype, int64_t V, const int64_t* rows,
                         const int32_t* bitmask, int64_t words, int64_t R) {
    for (int64_t i = 0; i < R; ++i) {
        const uint32_t* mask = (const uint32_t*)(bitmask + i * words);
        float* f32 = (float*)logits + rows[i] * stride;
        uint16_t* bf16 = (uint16_t*)logits + rows[i] * stride;
        for (int64_t w = 0; w * 32 < V; ++w) {
            const int64_t t0 = w * 32, n = V - t0 < 32 ? V - t0 : 32;
            uint32_t forbidden = ~mask[w];
            if (n < 32) forbidden &= (1u << n) - 1;
            if (forbidden == 0) continue;
            if (forbidden == 0xFFFFFFFFu) {
                if (dtype == DTYPE_BF16) for (int b = 0; b < 32; ++b) bf16[t0 + b] = 0xFF80;  /* -inf's bits */
                else for (int b = 0; b < 32; ++b) f32[t0 + b] = -INFINITY;
                continue;
            }
            while (forbidden) {
                const int b = __builtin_ctz(forbidden);
                forbidden &= forbidden - 1;
                if (dtype == DTYPE_BF16) bf16[t0 + b] = 0xFF80;
                else f32[t0 + b] = -INFINITY;
            }
        }
    }
}
