#include "common.h"

/*
 * rms_norm (twin of HF's LlamaRMSNorm): one pass per row where F.rms_norm in bf16 runs eight tensor ops.
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
