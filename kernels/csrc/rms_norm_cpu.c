/* RMSNorm of a few float32 rows on the CPU (the decode step's normalizations).
 *
 * out[i][k] = (x[i][k] * r_i) * w[k] with r_i = 1 / sqrt(mean_k(x[i][k]^2) + eps): the
 * reference's order of roundings (Hugging Face's LlamaRMSNorm in float32: the mean of the
 * squares, the reciprocal square root, the product with x, then the weight). The sum of
 * squares is accumulated in double and rounded once, so the mean is the correctly rounded
 * float32 mean; torch's float32 reduction may differ from it in the last bit.
 * x: row i at x + i * x_stride (elements contiguous); out: [M, K] contiguous.
 */
#include <math.h>
#include <stdint.h>

void radixrt_rms_norm_f32(const float *x, int64_t x_stride, int64_t M, int64_t K, const float *w, float eps,
                          float *out) {
    for (int64_t i = 0; i < M; i++) {
        const float *v = x + i * x_stride;
        float *o = out + i * K;
        double sum[4] = {0.0, 0.0, 0.0, 0.0};
        int64_t k = 0;
        for (; k + 4 <= K; k += 4)
            for (int j = 0; j < 4; j++) sum[j] += (double)v[k + j] * (double)v[k + j];
        for (; k < K; k++) sum[0] += (double)v[k] * (double)v[k];
        const float mean = (float)((sum[0] + sum[1] + sum[2] + sum[3]) / (double)K);
        const float r = 1.0f / sqrtf(mean + eps);
        for (k = 0; k < K; k++) o[k] = (v[k] * r) * w[k];
    }
}
