/* Weight-only quantized linear layer on the CPU: out = x @ dequant(W)^T (+ bias).
 *
 * Contract (the caller, kernels/quant_linear_cpu.py, checks shapes and dtypes):
 *   x     float32 [M, K], row i at x + i * x_stride (elements), contiguous rows
 *   out   float32, row i at out + i * out_stride; columns n_lo .. n_hi - 1 written
 *   bits 8: qw int8 [N, K]; w[n][k] = qw[n][k] * scales[n]; mins unused
 *   bits 4: qw uint8 [N, K / 2]; each run of 32 weights of a row is 16 bytes,
 *           byte j holding weight j in its low nibble and weight 16 + j in its
 *           high nibble; scales, mins float32 [N, K / group];
 *           w[n][k] = q * scales[n][k / group] + mins[n][k / group]
 *   bias  float32 [N] or NULL
 *   K a multiple of 32 (and of group, itself a multiple of 32).
 * Returns 0, or 1 when the scratch buffer cannot be allocated.
 *
 * Weight rows are read once per call: a block of ROWS rows is dequantized into
 * a small float buffer (cache resident), then every activation row is
 * multiplied against it, so the cost stays close to reading the quantized
 * weights for small M (decode batches, verification rows).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#define ROWS 4

#if defined(__AVX2__) && defined(__FMA__)
static void dequant_row(const void *qw, const float *scales, const float *mins, int64_t n, int64_t K,
                        int64_t group, int bits, float *dst) {
    if (bits == 8) {
        const int8_t *q = (const int8_t *)qw + n * K;
        for (int64_t k = 0; k < K; k += 8) { /* the scale is applied to the sums */
            __m128i b = _mm_loadl_epi64((const __m128i *)(q + k));
            _mm256_storeu_ps(dst + k, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)));
        }
        return;
    }
    const uint8_t *p = (const uint8_t *)qw + n * (K / 2);
    const float *s = scales + n * (K / group), *m = mins + n * (K / group);
    const __m128i low = _mm_set1_epi8(15);
    for (int64_t c = 0; c < K; c += 32) {
        const __m256 sc = _mm256_set1_ps(s[c / group]), mn = _mm256_set1_ps(m[c / group]);
        __m128i b = _mm_loadu_si128((const __m128i *)(p + c / 2));
        __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
        float *d = dst + c;
        _mm256_storeu_ps(d, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), sc, mn));
        _mm256_storeu_ps(d + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), sc, mn));
        _mm256_storeu_ps(d + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), sc, mn));
        _mm256_storeu_ps(d + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), sc, mn));
    }
}
#else
static void dequant_row(const void *qw, const float *scales, const float *mins, int64_t n, int64_t K,
                        int64_t group, int bits, float *dst) {
    if (bits == 8) {
        const int8_t *q = (const int8_t *)qw + n * K;
        for (int64_t k = 0; k < K; k++) dst[k] = (float)q[k]; /* the scale is applied to the sums */
        return;
    }
    const uint8_t *p = (const uint8_t *)qw + n * (K / 2);
    const float *s = scales + n * (K / group), *m = mins + n * (K / group);
    for (int64_t c = 0; c < K; c += 32) {
        const float sc = s[c / group], mn = m[c / group];
        const uint8_t *b = p + c / 2;
        float *d = dst + c;
        for (int j = 0; j < 16; j++) {
            d[j] = (float)(b[j] & 15) * sc + mn;
            d[j + 16] = (float)(b[j] >> 4) * sc + mn;
        }
    }
}

#endif

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* res[i][r] = dot(x_i, w_r) for ROWS weight rows and 2 activation rows */
static void dot_4x2(const float *w, int64_t K, const float *x0, const float *x1, float *r0, float *r1) {
    __m256 a00 = _mm256_setzero_ps(), a10 = a00, a20 = a00, a30 = a00;
    __m256 a01 = a00, a11 = a00, a21 = a00, a31 = a00;
    for (int64_t k = 0; k < K; k += 8) {
        __m256 u = _mm256_loadu_ps(x0 + k), v = _mm256_loadu_ps(x1 + k);
        __m256 w0 = _mm256_loadu_ps(w + k);
        a00 = _mm256_fmadd_ps(w0, u, a00);
        a01 = _mm256_fmadd_ps(w0, v, a01);
        __m256 w1 = _mm256_loadu_ps(w + K + k);
        a10 = _mm256_fmadd_ps(w1, u, a10);
        a11 = _mm256_fmadd_ps(w1, v, a11);
        __m256 w2 = _mm256_loadu_ps(w + 2 * K + k);
        a20 = _mm256_fmadd_ps(w2, u, a20);
        a21 = _mm256_fmadd_ps(w2, v, a21);
        __m256 w3 = _mm256_loadu_ps(w + 3 * K + k);
        a30 = _mm256_fmadd_ps(w3, u, a30);
        a31 = _mm256_fmadd_ps(w3, v, a31);
    }
    r0[0] = hsum(a00), r0[1] = hsum(a10), r0[2] = hsum(a20), r0[3] = hsum(a30);
    r1[0] = hsum(a01), r1[1] = hsum(a11), r1[2] = hsum(a21), r1[3] = hsum(a31);
}

/* one activation row against ROWS quantized rows, dequantized in registers (no buffer) */
static void direct_4x1(const void *qw, const float *scales, const float *mins, int64_t n, int64_t K,
                       int64_t group, int bits, const float *x0, float *r0) {
    __m256 acc[ROWS];
    for (int r = 0; r < ROWS; r++) acc[r] = _mm256_setzero_ps();
    if (bits == 8) {
        const int8_t *q = (const int8_t *)qw + n * K;
        for (int64_t k = 0; k < K; k += 8) {
            __m256 u = _mm256_loadu_ps(x0 + k);
            for (int r = 0; r < ROWS; r++) {
                __m128i b = _mm_loadl_epi64((const __m128i *)(q + r * K + k));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), u, acc[r]);
            }
        }
    } else {
        const uint8_t *p = (const uint8_t *)qw + n * (K / 2);
        const int64_t ng = K / group;
        const float *s = scales + n * ng, *m = mins + n * ng;
        const __m128i low = _mm_set1_epi8(15);
        for (int64_t c = 0; c < K; c += 32) {
            __m256 u0 = _mm256_loadu_ps(x0 + c), u1 = _mm256_loadu_ps(x0 + c + 8);
            __m256 u2 = _mm256_loadu_ps(x0 + c + 16), u3 = _mm256_loadu_ps(x0 + c + 24);
            for (int r = 0; r < ROWS; r++) {
                const __m256 sc = _mm256_set1_ps(s[r * ng + c / group]), mn = _mm256_set1_ps(m[r * ng + c / group]);
                __m128i b = _mm_loadu_si128((const __m128i *)(p + r * (K / 2) + c / 2));
                __m128i lo = _mm_and_si128(b, low), hi = _mm_and_si128(_mm_srli_epi16(b, 4), low);
                __m256 w0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), sc, mn);
                __m256 w1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), sc, mn);
                __m256 w2 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), sc, mn);
                __m256 w3 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), sc, mn);
                acc[r] = _mm256_fmadd_ps(w0, u0, acc[r]);
                acc[r] = _mm256_fmadd_ps(w1, u1, acc[r]);
                acc[r] = _mm256_fmadd_ps(w2, u2, acc[r]);
                acc[r] = _mm256_fmadd_ps(w3, u3, acc[r]);
            }
        }
    }
    for (int r = 0; r < ROWS; r++) r0[r] = hsum(acc[r]);
}
#define HAVE_DIRECT 1

static void dot_4x1(const float *w, int64_t K, const float *x0, float *r0) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t k = 0; k < K; k += 8) {
        __m256 u = _mm256_loadu_ps(x0 + k);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), u, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + K + k), u, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 2 * K + k), u, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + 3 * K + k), u, a3);
    }
    r0[0] = hsum(a0), r0[1] = hsum(a1), r0[2] = hsum(a2), r0[3] = hsum(a3);
}
#else
static void dot_4x1(const float *w, int64_t K, const float *x0, float *r0) {
    for (int r = 0; r < ROWS; r++) {
        float acc[8] = {0};
        for (int64_t k = 0; k < K; k += 8)
            for (int j = 0; j < 8; j++) acc[j] += w[r * K + k + j] * x0[k + j];
        float s = 0;
        for (int j = 0; j < 8; j++) s += acc[j];
        r0[r] = s;
    }
}

static void dot_4x2(const float *w, int64_t K, const float *x0, const float *x1, float *r0, float *r1) {
    dot_4x1(w, K, x0, r0);
    dot_4x1(w, K, x1, r1);
}
#endif

int radixrt_quant_linear_f32(const float *x, int64_t x_stride, int64_t M, int64_t K, const void *qw,
                             const float *scales, const float *mins, int64_t group, int bits, const float *bias,
                             float *out, int64_t out_stride, int64_t n_lo, int64_t n_hi) {
    float *buf = (float *)aligned_alloc(64, sizeof(float) * ROWS * (size_t)K);
    if (buf == NULL) return 1;
    for (int64_t n0 = n_lo; n0 < n_hi; n0 += ROWS) {
        const int rows = n_hi - n0 < ROWS ? (int)(n_hi - n0) : ROWS;
        float mult[ROWS], add[ROWS];
        for (int r = 0; r < rows; r++) {
            mult[r] = bits == 8 ? scales[n0 + r] : 1.0f;
            add[r] = bias ? bias[n0 + r] : 0.0f;
        }
#ifdef HAVE_DIRECT
        if (M == 1 && rows == ROWS) { /* a single row: no buffer, each weight is used once */
            float r0[ROWS];
            direct_4x1(qw, scales, mins, n0, K, group, bits, x, r0);
            for (int r = 0; r < ROWS; r++) out[n0 + r] = r0[r] * mult[r] + add[r];
            continue;
        }
#endif
        for (int r = 0; r < ROWS; r++) {
            if (r < rows)
                dequant_row(qw, scales, mins, n0 + r, K, group, bits, buf + r * K);
            else
                memset(buf + r * K, 0, sizeof(float) * (size_t)K);
        }
        for (int64_t i = 0; i < M; i += 2) {
            float r0[ROWS], r1[ROWS];
            if (i + 1 < M)
                dot_4x2(buf, K, x + i * x_stride, x + (i + 1) * x_stride, r0, r1);
            else
                dot_4x1(buf, K, x + i * x_stride, r0);
            for (int r = 0; r < rows; r++) {
                out[i * out_stride + n0 + r] = r0[r] * mult[r] + add[r];
                if (i + 1 < M) out[(i + 1) * out_stride + n0 + r] = r1[r] * mult[r] + add[r];
            }
        }
    }
    free(buf);
    return 0;
}

/* The float32 weight rows n_lo .. n_hi - 1 into out [N, K] (int8: scaled), for row counts where
 * a dense matrix product over the dequantized weight is faster than the kernel above. */
void radixrt_quant_dequant_f32(const void *qw, const float *scales, const float *mins, int64_t K, int64_t group,
                               int bits, float *out, int64_t n_lo, int64_t n_hi) {
    for (int64_t n = n_lo; n < n_hi; n++) {
        float *row = out + n * K;
        dequant_row(qw, scales, mins, n, K, group, bits, row);
        if (bits == 8)
            for (int64_t k = 0; k < K; k++) row[k] *= scales[n];
    }
}
