/* The decoder layer stack of a CPU decode step in one call: no Python between the kernels.
 *
 * A decode step of a small model is a few hundred kernel calls of tens of microseconds; driven
 * from Python each pays about 15 us of dispatch (module calls, argument conversion, output
 * allocation), a third of the embedded model's step at batch 1. This driver runs the same
 * kernels, in the same order and on the same arguments as the Python layer stack does
 * (kernels/decode_stack_cpu.py says when it may be used), so its results are those of the
 * Python path: it calls the other CPU kernels through function pointers (Ops: the entry points
 * of quant_linear_cpu, dense_linear_cpu, row_ops_cpu and paged_decode_cpu, whose contracts are
 * in their own sources) and adds only the KV write (a copy) and the residual add (one float32
 * addition per element, as torch's).
 *
 * Per layer, for M token rows of hidden state h [M, hidden] (updated in place):
 *   x = rms_norm(h); qkv = x @ Wqkv^T; qk = rope(qkv[:, :(hq + hkv) d]);
 *   K/V of row i written at slot out_slots[i] of the layer's k/v cache [slots, hkv, d];
 *   a = paged_decode(qk[:, :hq d], table, lens, shared); h = h + a @ Wo^T; x = rms_norm(h);
 *   gu = x @ Wgu^T; h = h + silu_mul(gu) @ Wdown^T.
 * Scratch: float32, `radixrt_decode_stack_scratch` floats per row.
 * Returns 0, or the first non-zero code a kernel returned (h is then partly updated). */
#include <stdint.h>
#include <string.h>

typedef int (*quant_fn)(const float *x, int64_t x_stride, int64_t M, int64_t K, const void *qw, const void *scales,
                        const void *mins, int64_t group, int bits, const float *bias, float *out, int64_t out_stride,
                        int64_t N, int64_t parallel_min_macs);
typedef int (*dense_fn)(const float *x, int64_t x_stride, int64_t M, int64_t K, const float *w, int64_t N,
                        const float *bias, float *out, int64_t parallel_min_macs);
typedef void (*rms_fn)(const float *x, int64_t x_stride, int64_t M, int64_t K, const float *w, float eps, float *out);
typedef void (*add_rms_fn)(const float *h, int64_t h_stride, const float *d, int64_t d_stride, int64_t M, int64_t K,
                           const float *w, float eps, float *sum, float *out);
typedef void (*rope_fn)(const float *x, int64_t x_stride, int64_t T, int64_t H, int64_t D, const float *cos_t,
                        const float *sin_t, int64_t cs_stride, int64_t rd, float *out);
typedef void (*silu_mul_fn)(const float *gu, int64_t gu_stride, int64_t M, int64_t I, float *out);
typedef int (*decode_fn)(const float *q, int64_t q_stride, const float *k, const float *v, const int64_t *table,
                         const int64_t *lens, const int64_t *shared, float *out, int64_t B, int64_t max_kv,
                         int64_t hq, int64_t hkv, int64_t d, float scale, int64_t parallel_min_pairs);

enum { LINEAR_QUANT = 0, LINEAR_DENSE = 1 };

/* one linear layer: fn is a quant_fn (kind LINEAR_QUANT: w, scales, mins, group, bits as that
 * kernel takes them) or a dense_fn (LINEAR_DENSE: w float32 [N, K]) */
typedef struct {
    int64_t kind;
    void *fn;
    const void *w, *scales, *mins;
    const float *bias;
    int64_t group, bits, K, N, parallel_min_macs;
} Linear;

typedef struct {
    const float *input_norm, *post_norm;
    Linear qkv, o, gate_up, down;
    float *k_cache, *v_cache;
} Layer;

typedef struct {
    rms_fn rms;
    add_rms_fn add_rms;
    rope_fn rope;
    silu_mul_fn silu_mul;
    decode_fn decode;
    int64_t decode_parallel_min_pairs;
} Ops;

typedef struct {
    int64_t hidden, hq, hkv, d, rotary_dim, intermediate;
    float eps, scale;
} Dims;

static int linear(const Linear *l, const float *x, int64_t x_stride, int64_t M, float *out) {
    if (l->kind == LINEAR_DENSE)
        return ((dense_fn)l->fn)(x, x_stride, M, l->K, (const float *)l->w, l->N, l->bias, out, l->parallel_min_macs);
    return ((quant_fn)l->fn)(x, x_stride, M, l->K, l->w, l->scales, l->mins, l->group, (int)l->bits, l->bias, out,
                             l->N, l->N, l->parallel_min_macs);
}

/* floats of scratch per token row */
int64_t radixrt_decode_stack_scratch(const Dims *dm) {
    const int64_t qkv = (dm->hq + 2 * dm->hkv) * dm->d, qk = (dm->hq + dm->hkv) * dm->d;
    return 2 * dm->hidden + qkv + qk + dm->hq * dm->d + 3 * dm->intermediate;
}

int radixrt_decode_stack(const Ops *ops, const Layer *layers, int64_t num_layers, const Dims *dm, float *h, int64_t M,
                         const float *cos_t, const float *sin_t, int64_t cs_stride, const int64_t *out_slots,
                         const int64_t *table, const int64_t *lens, const int64_t *shared, int64_t max_kv,
                         float *scratch) {
    const int64_t H = dm->hidden, d = dm->d, I = dm->intermediate;
    const int64_t nqkv = (dm->hq + 2 * dm->hkv) * d, nqk = (dm->hq + dm->hkv) * d, kv_row = dm->hkv * d;
    float *x = scratch, *proj = x + M * H, *qkv = proj + M * H, *qk = qkv + M * nqkv, *attn = qk + M * nqk;
    float *gu = attn + M * dm->hq * d, *act = gu + M * 2 * I;
    int code;
    for (int64_t l = 0; l < num_layers; l++) {
        const Layer *L = layers + l;
        ops->rms(h, H, M, H, L->input_norm, dm->eps, x);
        if ((code = linear(&L->qkv, x, H, M, qkv))) return code;
        ops->rope(qkv, nqkv, M, dm->hq + dm->hkv, d, cos_t, sin_t, cs_stride, dm->rotary_dim, qk);
        for (int64_t i = 0; i < M; i++) {
            memcpy(L->k_cache + out_slots[i] * kv_row, qk + i * nqk + dm->hq * d, sizeof(float) * kv_row);
            memcpy(L->v_cache + out_slots[i] * kv_row, qkv + i * nqkv + nqk, sizeof(float) * kv_row);
        }
        code = ops->decode(qk, nqk, L->k_cache, L->v_cache, table, lens, shared, attn, M, max_kv, dm->hq, dm->hkv, d,
                           dm->scale, ops->decode_parallel_min_pairs);
        if (code) return code;
        if ((code = linear(&L->o, attn, dm->hq * d, M, proj))) return code;
        ops->add_rms(h, H, proj, H, M, H, L->post_norm, dm->eps, h, x);
        if ((code = linear(&L->gate_up, x, H, M, gu))) return code;
        ops->silu_mul(gu, 2 * I, M, I, act);
        if ((code = linear(&L->down, act, I, M, proj))) return code;
        for (int64_t i = 0; i < M * H; i++) h[i] += proj[i];
    }
    return 0;
}
