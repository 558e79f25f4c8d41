/* Weight-only quantized linear layer on the CPU: out = x @ dequant(W)^T (+ bias).
 *
 * Weight layouts (the caller, kernels/quant_linear_cpu.py, checks shapes and dtypes):
 *   bits 8: qw int8 [N, K]; w[n][k] = qw[n][k] * scales[n]; mins unused
 *   bits 4: qw uint8 [N, K / 2]; each run of 32 weights of a row is 16 bytes,
 *           byte j holding weight j in its low nibble and weight 16 + j in its
 *           high nibble; scales, mins float32 [N, K / group];
 *           w[n][k] = q * scales[n][k / group] + mins[n][k / group]
 *   bias  float32 [N] or NULL
 *   K a multiple of 32 (and of group, itself a multiple of 32).
 *
 * radixrt_quant_linear (below) is the decode-sized product: it reads the packed
 * weight once per call whatever the number of activation rows, and multiplies
 * in integers as llama.cpp does (each activation row quantized to int8 per run
 * of 32 first). radixrt_quant_dequant_f32 gives float rows for a prefill-sized
 * product, which torch's float matrix product then computes.
 */
#include <math.h>
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


/* ---- the linear layer: activations quantized to int8 per run of 32 (llama.cpp's Q8 blocks) ----
 * A row of x becomes xq int8 [K], xd float32 [K / 32] (x ~ xq * xd per run) and xs float32
 * [K / 32] (xd times the run's sum of xq: what a weight minimum multiplies). Per run of 32,
 * int4: dot(w, x) = scale * xd * sum(q * xq) + min * xs; int8: scale[n] * xd * sum(q * xq)
 * (the scale applied once per row). The integer sums are exact (maddubs pairs stay below
 * 2^15: 15 * 127 * 2 and 127 * 127 * 2). */

#define RUN 32

static void quantize_row_q8(const float *v, int64_t K, int8_t *q, float *xd, float *xs) {
    for (int64_t b = 0; b < K / RUN; b++, v += RUN, q += RUN) {
        float amax = 0.0f;
        for (int j = 0; j < RUN; j++) amax = fabsf(v[j]) > amax ? fabsf(v[j]) : amax;
        const float d = amax / 127.0f, inv = d > 0 ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < RUN; j++) {
            q[j] = (int8_t)lrintf(v[j] * inv);
            sum += q[j];
        }
        xd[b] = d;
        xs[b] = d * (float)sum;
    }
}

/* quantized activation rows */
typedef struct {
    const int8_t *q;
    const float *d, *s;
} QRow;

#if defined(__AVX2__) && defined(__FMA__)
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256i unpack_q4(const uint8_t *p, __m128i low) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), low), _mm_and_si128(b, low));
}

/* the 8 int32 partial sums of w (unsigned bytes) * x (signed bytes), as floats */
static inline __m256 dot_u8s8(__m256i w, __m256i x) {
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}

/* res[i * ROWS + r] = dot(x row i, weight row n + r) for NX (1 or 2) activation rows: each
 * weight run is loaded (and unpacked) once for all NX rows */
static inline __attribute__((always_inline)) void q8_block(const QRow *x, const int NX, int64_t K,
                                                           const void *qw, const float *scales,
                                                           const float *mins, int64_t group, int bits,
                                                           int64_t n, int rows, float *res) {
    const int64_t runs = K / RUN;
    __m256 acc[2][ROWS];
    float macc[2][ROWS] = {{0}};
    for (int i = 0; i < NX; i++)
        for (int r = 0; r < ROWS; r++) acc[i][r] = _mm256_setzero_ps();
    if (bits == 8) {
        const int8_t *q = (const int8_t *)qw + n * K;
        for (int64_t b = 0; b < runs; b++) {
            __m256i xv[2];
            for (int i = 0; i < NX; i++) xv[i] = _mm256_loadu_si256((const __m256i *)(x[i].q + b * RUN));
            for (int r = 0; r < rows; r++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(q + r * K + b * RUN));
                const __m256i aw = _mm256_sign_epi8(w, w);
                for (int i = 0; i < NX; i++)
                    acc[i][r] = _mm256_fmadd_ps(dot_u8s8(aw, _mm256_sign_epi8(xv[i], w)),
                                                _mm256_set1_ps(x[i].d[b]), acc[i][r]);
            }
        }
        for (int i = 0; i < NX; i++)
            for (int r = 0; r < rows; r++) res[i * ROWS + r] = hsum(acc[i][r]) * scales[n + r];
        return;
    }
    const uint8_t *p = (const uint8_t *)qw + n * (K / 2);
    const int64_t ng = K / group;
    const float *s = scales + n * ng, *m = mins + n * ng;
    const __m128i low = _mm_set1_epi8(15);
    for (int64_t b = 0; b < runs; b++) {
        __m256i xv[2];
        for (int i = 0; i < NX; i++) xv[i] = _mm256_loadu_si256((const __m256i *)(x[i].q + b * RUN));
        const int64_t g = b * RUN / group;
        for (int r = 0; r < rows; r++) {
            const __m256i w = unpack_q4(p + r * (K / 2) + b * (RUN / 2), low);
            const float sc = s[r * ng + g], mn = m[r * ng + g];
            for (int i = 0; i < NX; i++) {
                acc[i][r] = _mm256_fmadd_ps(dot_u8s8(w, xv[i]), _mm256_set1_ps(sc * x[i].d[b]), acc[i][r]);
                macc[i][r] += mn * x[i].s[b];
            }
        }
    }
    for (int i = 0; i < NX; i++)
        for (int r = 0; r < rows; r++) res[i * ROWS + r] = hsum(acc[i][r]) + macc[i][r];
}
#else
static inline void q8_block(const QRow *x, const int NX, int64_t K, const void *qw, const float *scales,
                            const float *mins, int64_t group, int bits, int64_t n, int rows, float *res) {
    const int64_t runs = K / RUN, ng = bits == 4 ? K / group : 0;
    for (int i = 0; i < NX; i++)
        for (int r = 0; r < rows; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < runs; b++) {
                const int8_t *v = x[i].q + b * RUN;
                int sum = 0;
                if (bits == 8) {
                    const int8_t *q = (const int8_t *)qw + (n + r) * K + b * RUN;
                    for (int j = 0; j < RUN; j++) sum += q[j] * v[j];
                    acc += x[i].d[b] * (float)sum;
                } else {
                    const uint8_t *c = (const uint8_t *)qw + (n + r) * (K / 2) + b * (RUN / 2);
                    for (int j = 0; j < RUN / 2; j++) sum += (c[j] & 15) * v[j] + (c[j] >> 4) * v[j + RUN / 2];
                    const int64_t g = (n + r) * ng + b * RUN / group;
                    acc += scales[g] * x[i].d[b] * (float)sum + mins[g] * x[i].s[b];
                }
            }
            res[i * ROWS + r] = bits == 8 ? acc * scales[n + r] : acc;
        }
}
#endif

/* out [M, N] = x [M, K] @ dequant(W)^T (+ bias), x float32 with row i at x + i * x_stride and
 * out row i at out + i * out_stride. Blocks of ROWS weight rows are split over OpenMP threads
 * when M * N * K >= parallel_min_macs (the OpenMP runtime torch itself runs on: see
 * kernels/quant_linear_cpu.py). Returns 0, or 1 when scratch memory cannot be allocated. */
int radixrt_quant_linear(const float *x, int64_t x_stride, int64_t M, int64_t K, const void *qw,
                         const float *scales, const float *mins, int64_t group, int bits, const float *bias,
                         float *out, int64_t out_stride, int64_t N, int64_t parallel_min_macs) {
    const int64_t runs = K / RUN;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K) + 2 * sizeof(float) * (size_t)(M * runs) + 64);
    if (xq == NULL) return 1;
    float *xd = (float *)(((uintptr_t)(xq + M * K) + 63) & ~(uintptr_t)63), *xs = xd + M * runs;
    for (int64_t i = 0; i < M; i++) quantize_row_q8(x + i * x_stride, K, xq + i * K, xd + i * runs, xs + i * runs);
    const int64_t blocks = (N + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static) if (M * N * K >= parallel_min_macs)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t n0 = blk * ROWS;
        const int rows = N - n0 < ROWS ? (int)(N - n0) : ROWS;
        for (int64_t i = 0; i < M; i += 2) {
            const QRow rw[2] = {{xq + i * K, xd + i * runs, xs + i * runs},
                                {xq + (i + 1) * K, xd + (i + 1) * runs, xs + (i + 1) * runs}};
            const int nx = i + 1 < M ? 2 : 1;
            float res[2 * ROWS];
            if (nx == 2)
                q8_block(rw, 2, K, qw, scales, mins, group, bits, n0, rows, res);
            else
                q8_block(rw, 1, K, qw, scales, mins, group, bits, n0, rows, res);
            for (int j = 0; j < nx; j++)
                for (int r = 0; r < rows; r++)
                    out[(i + j) * out_stride + n0 + r] = res[j * ROWS + r] + (bias ? bias[n0 + r] : 0.0f);
        }
    }
    free(xq);
    return 0;
}
