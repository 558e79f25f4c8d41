/* Elementwise row operations of the CPU decode step, on a few float32 rows.
 *
 * Each replaces several torch operations by one call, with the reference's order of
 * roundings (compiled as ISO C: no fused multiply-adds are contracted):
 *   radixrt_rms_norm_f32: out[i][k] = (x[i][k] * r_i) * w[k], r_i = 1 / sqrt(mean_k(x[i][k]^2) + eps)
 *     (Hugging Face's LlamaRMSNorm in float32). The sum of squares is accumulated in double and
 *     rounded once, so the mean is the correctly rounded float32 mean; torch's float32
 *     reduction may differ from it in the last bit.
 *   radixrt_add_rms_norm_f32: sum = h + d (one float32 rounding, as torch's add), then
 *     out = rms_norm(sum): a residual add and the next norm.
 *   radixrt_rope_f32: out = x * cos + roll(x, rd / 2) * sin over the first rd dims of every
 *     head (sin's first half negated by the caller's table: transformers' rotate_half), the
 *     other dims copied; bitwise torch's `x * cos + x.roll(rd // 2, -1) * sin`.
 * Inputs are rows with contiguous elements at a row stride; outputs are contiguous.
 */
#include <math.h>
#include <stdint.h>

static void rms_row(const float *v, int64_t K, const float *w, float eps, float *o) {
    double sum[4] = {0.0, 0.0, 0.0, 0.0};
    int64_t k = 0;
    for (; k + 4 <= K; k += 4)
        for (int j = 0; j < 4; j++) sum[j] += (double)v[k + j] * (double)v[k + j];
    for (; k < K; k++) sum[0] += (double)v[k] * (double)v[k];
    const float mean = (float)((sum[0] + sum[1] + sum[2] + sum[3]) / (double)K);
    const float r = 1.0f / sqrtf(mean + eps);
    for (k = 0; k < K; k++) o[k] = (v[k] * r) * w[k];
}

/* x: row i at x + i * x_stride; out [M, K] */
void radixrt_rms_norm_f32(const float *x, int64_t x_stride, int64_t M, int64_t K, const float *w, float eps,
                          float *out) {
    for (int64_t i = 0; i < M; i++) rms_row(x + i * x_stride, K, w, eps, out + i * K);
}

/* h, d: rows at their strides; sum, out [M, K] */
void radixrt_add_rms_norm_f32(const float *h, int64_t h_stride, const float *d, int64_t d_stride, int64_t M,
                              int64_t K, const float *w, float eps, float *sum, float *out) {
    for (int64_t i = 0; i < M; i++) {
        float *s = sum + i * K;
        for (int64_t k = 0; k < K; k++) s[k] = h[i * h_stride + k] + d[i * d_stride + k];
        rms_row(s, K, w, eps, out + i * K);
    }
}

/* x [T, H, D]: token t's head j at x + t * x_stride + j * D; cos, sin [T, rd] at cs_stride;
 * out [T, H, D] */
void radixrt_rope_f32(const float *x, int64_t x_stride, int64_t T, int64_t H, int64_t D, const float *cos_t,
                      const float *sin_t, int64_t cs_stride, int64_t rd, float *out) {
    const int64_t half = rd / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos_t + t * cs_stride, *s = sin_t + t * cs_stride;
        for (int64_t j = 0; j < H; j++) {
            const float *v = x + t * x_stride + j * D;
            float *o = out + (t * H + j) * D;
            for (int64_t k = 0; k < half; k++) o[k] = v[k] * c[k] + v[k + half] * s[k];
            for (int64_t k = half; k < rd; k++) o[k] = v[k] * c[k] + v[k - half] * s[k];
            for (int64_t k = rd; k < D; k++) o[k] = v[k];
        }
    }
}

/* gu: rows [g (I floats) | u (I floats)] at gu_stride; out [M, I] */
void radixrt_silu_mul_f32(const float *gu, int64_t gu_stride, int64_t M, int64_t I, float *out) {
    for (int64_t i = 0; i < M; i++) {
        const float *g = gu + i * gu_stride, *u = g + I;
        float *o = out + i * I;
        for (int64_t j = 0; j < I; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}
