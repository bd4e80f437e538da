#include "common.h"

/*
 * decode_stack: every decoder layer of a decode-only step of at most LINEAR_MAX_T sequences, bf16, in one call:
 * per layer RMSNorm, QKV (linear_small or linear_amx), rotary embedding + K/V write + attention
 * (rope_paged_attention), O plus the residual, RMSNorm, SiLU(gate) * up, down plus the residual; the same C
 * functions the layer-by-layer path calls, so the result is the same to the bit. What it saves is the Python
 * between them: at batch 1 a layer's eight calls and their argument checks cost more than its attention.
 * h: [T, Dm] residual stream, updated in place. Per-layer arrays (num_layers pointers each): the two norms' weights,
 * the QKV, O, gate, up and down weights (pack_linear_weight's layout, which both matmuls read), the QKV bias (NULL
 * entries: none), the K and V pools. wformat 0: bf16 weights, up to small_rows rows the projections run linear_small,
 * above it linear_amx; 1 (Q4_1) or 2 (INT8): quantized weights (linear_quant.c's layouts), run linear_q4_1 or
 * linear_int8 at any row count.
 * Scratch: x [T, Dm], qkv [T, Nqkv], attn [T, H * D], gate and up [T, I]. Returns 0, or -1 if a projection refused.
 */
static int stack_linear(const void* x, int64_t x_st, const void* w, const void* bias, int64_t T, int64_t small_rows,
                        int64_t K, int64_t N, int op, const void* other, int64_t other_st, void* y, int num_threads,
                        int wformat) {
    if (wformat == 1) return linear_q4_1(x, x_st, w, bias, T, K, N, op, other, other_st, y, num_threads);
    if (wformat == 2) return linear_int8(x, x_st, w, bias, T, K, N, op, other, other_st, y, num_threads);
    if (T <= small_rows) return linear_small(x, x_st, w, bias, T, K, N, op, other, other_st, y, num_threads);
    return linear_amx(x, x_st, w, bias, T, K, N, op, other, other_st, y, num_threads);
}

int decode_stack(void* h, int64_t T, int64_t Dm, int64_t num_layers, const void* const* norm1,
                 const void* const* qkv_w, const void* const* qkv_b, const void* const* o_w,
                 const void* const* norm2, const void* const* gate_w, const void* const* up_w,
                 const void* const* down_w, int wformat, int64_t small_rows, int64_t I, float eps,
                 const int64_t* positions,
                 const void* cos, const void* sin_signed, const int64_t* slots, void* const* k_caches,
                 void* const* v_caches,
                 int64_t c_sb, int64_t c_ss, int64_t c_sh, const int32_t* block_tables, int64_t bt_sb,
                 const int32_t* context_lens, int64_t H, int64_t KVH, int64_t D, int64_t block_size, float scale,
                 int64_t max_context, void* x, void* qkv, void* attn, void* gate, void* up, int num_threads) {
    const int64_t Nqkv = (H + 2 * KVH) * D;
    for (int64_t l = 0; l < num_layers; ++l) {
        rms_norm(h, Dm, norm1[l], x, T, Dm, eps, DTYPE_BF16, num_threads);
        if (stack_linear(x, Dm, qkv_w[l], qkv_b[l], T, small_rows, Dm, Nqkv, 0, NULL, 0, qkv, num_threads, wformat))
            return -1;
        rope_paged_attention(qkv, Nqkv, T, positions, cos, sin_signed, slots, k_caches[l], v_caches[l], c_sb, c_ss,
                             c_sh, T, block_tables, bt_sb, context_lens, H, KVH, D, block_size, scale, max_context,
                             attn, H * D, D, DTYPE_BF16, num_threads);
        if (stack_linear(attn, H * D, o_w[l], NULL, T, small_rows, H * D, Dm, 3, h, Dm, h, num_threads, wformat))
            return -1;
        rms_norm(h, Dm, norm2[l], x, T, Dm, eps, DTYPE_BF16, num_threads);
        if (stack_linear(x, Dm, gate_w[l], NULL, T, small_rows, Dm, I, 1, NULL, 0, gate, num_threads, wformat))
            return -1;
        if (stack_linear(x, Dm, up_w[l], NULL, T, small_rows, Dm, I, 2, gate, I, up, num_threads, wformat))
            return -1;
        if (stack_linear(up, I, down_w[l], NULL, T, small_rows, I, Dm, 3, h, Dm, h, num_threads, wformat))
            return -1;
    }
    return 0;
}
