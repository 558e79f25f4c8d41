/* Weight-only quantized linear layer on the CPU: out = x @ dequant(W)^T (+ bias).
 *
 * Weight layouts (the caller, kernels/quant_linear_cpu.py, checks shapes and dtypes):
 *   bits 8: qw int8 [N, K]; w[n][k] = qw[n][k] * scales[n]; mins unused
 *   bits 4: qw uint8 [N, K / 2]; each run of 32 weights of a row is 16 bytes,
 *           byte j holding weight j in its low nibble and weight 16 + j in its
 *           high nibble; scales, mins IEEE float16 [N, K / group] (as llama.cpp's
 *           Q4_1: 20 bytes per 32 weights with group 32, against 24 with float32);
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
/* the AVX2 paths also convert the int4 scales with F16C (every AVX2 CPU has it) */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QL_AVX2 1
#endif
#if defined(QL_AVX2) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define ROWS 4

typedef uint16_t half_t; /* an IEEE float16, as stored */

static inline float half_to_float(half_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 31u, man = h & 1023u;
    if (exp == 0) { /* zero or subnormal: man * 2^-24 */
        const float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    const uint32_t bits = exp == 31 ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112u) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

#if defined(QL_AVX2)
static void dequant_row(const void *qw, const half_t *scales, const half_t *mins, int64_t n, int64_t K,
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
    const half_t *s = scales + n * (K / group), *m = mins + n * (K / group);
    const __m128i low = _mm_set1_epi8(15);
    for (int64_t c = 0; c < K; c += 32) {
        const __m256 sc = _mm256_set1_ps(half_to_float(s[c / group])), mn = _mm256_set1_ps(half_to_float(m[c / group]));
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
static void dequant_row(const void *qw, const half_t *scales, const half_t *mins, int64_t n, int64_t K,
                        int64_t group, int bits, float *dst) {
    if (bits == 8) {
        const int8_t *q = (const int8_t *)qw + n * K;
        for (int64_t k = 0; k < K; k++) dst[k] = (float)q[k]; /* the scale is applied to the sums */
        return;
    }
    const uint8_t *p = (const uint8_t *)qw + n * (K / 2);
    const half_t *s = scales + n * (K / group), *m = mins + n * (K / group);
    for (int64_t c = 0; c < K; c += 32) {
        const float sc = half_to_float(s[c / group]), mn = half_to_float(m[c / group]);
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
 * a dense matrix product over the dequantized weight is faster than the kernel above. scales
 * and mins as the layout says: float32 for int8, float16 for int4. */
void radixrt_quant_dequant_f32(const void *qw, const void *scales, const void *mins, int64_t K, int64_t group,
                               int bits, float *out, int64_t n_lo, int64_t n_hi) {
    for (int64_t n = n_lo; n < n_hi; n++) {
        float *row = out + n * K;
        dequant_row(qw, (const half_t *)scales, (const half_t *)mins, n, K, group, bits, row);
        if (bits == 8)
            for (int64_t k = 0; k < K; k++) row[k] *= ((const float *)scales)[n];
    }
}


/* ---- the linear layer: activations quantized to int8 per run of 32 (llama.cpp's Q8 blocks) ----
 * A row of x becomes xq int8 [K], xd float32 [K / 32] (x ~ xq * xd per run) and xs float32
 * [K / 32] (xd times the run's sum of xq: what a weight minimum multiplies). Per run of 32,
 * int4: dot(w, x) = scale * xd * sum(q * xq) + min * xs; int8: scale[n] * xd * sum(q * xq)
 * (the scale applied once per row). The integer sums are exact (maddubs pairs stay below
 * 2^15: 15 * 127 * 2 and 127 * 127 * 2). */

#define RUN 32

static void quantize_row_q8(const float *v, int64_t K, int8_t *q, float *xd, float *xs, int32_t *xsum) {
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
        xsum[b] = sum;
    }
}

/* The M rows of x quantized into one allocation (free the returned pointer; NULL when out of
 * memory): xq int8 [M, K], then per row and run xd, xs (float32) and xsum (the int sum of xq). */
static int8_t *quantize_rows(const float *x, int64_t x_stride, int64_t M, int64_t K, float **xd, float **xs,
                             int32_t **xsum) {
    const int64_t runs = K / RUN;
    int8_t *xq = (int8_t *)malloc((size_t)(M * K) + (2 * sizeof(float) + sizeof(int32_t)) * (size_t)(M * runs) + 64);
    if (xq == NULL) return NULL;
    *xd = (float *)(((uintptr_t)(xq + M * K) + 63) & ~(uintptr_t)63);
    *xs = *xd + M * runs;
    *xsum = (int32_t *)(*xs + M * runs);
    for (int64_t i = 0; i < M; i++)
        quantize_row_q8(x + i * x_stride, K, xq + i * K, *xd + i * runs, *xs + i * runs, *xsum + i * runs);
    return xq;
}

/* quantized activation rows */
typedef struct {
    const int8_t *q;
    const float *d, *s;
} QRow;

#if defined(QL_AVX2)
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

/* res[i * ROWS + r] = dot(x row i, int8 weight row n + r) for NX (1 or 2) activation rows:
 * each weight run is loaded once for all NX rows (int4 weights take q4_linear below) */
static inline __attribute__((always_inline)) void q8_block(const QRow *x, const int NX, int64_t K,
                                                           const void *qw, const float *scales,
                                                           const half_t *mins, int64_t group, int bits,
                                                           int64_t n, int rows, float *res) {
    (void)mins, (void)group, (void)bits; /* the portable build's signature, which int4 also takes */
    const int64_t runs = K / RUN;
    __m256 acc[2][ROWS];
    for (int i = 0; i < NX; i++)
        for (int r = 0; r < ROWS; r++) acc[i][r] = _mm256_setzero_ps();
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
}

/* ---- int4 in pairs of runs (AVX2): a quarter of the instructions per weight of q8_block ----
 * The 32 bytes of two consecutive runs a, b unpack to [a 0..15 | b 0..15] (low nibbles) and
 * [a 16..31 | b 16..31] (high nibbles); the activations of the first 8 * (K / 256) runs are
 * stored in that order (`pair_runs`). Per pair, the two maddubs products add in int16 (at most
 * 2 * 2 * 15 * 127 < 2^15) and one madd widens them: 4 int32 partial sums per run. Two hadd
 * levels fold the 4 pairs of a block of 8 runs into one vector, a run per lane, in the order
 * RUN_LANES; the run scales (weight scale times activation scale) multiply it once per block.
 * Runs past the last whole block keep the natural order and q8_block's per-run product. */

static const int RUN_LANES[8] = {0, 2, 4, 6, 1, 3, 5, 7};

/* the activation runs of the first `pairs` pairs: [a | b] halves of 16 bytes -> [a lo, b lo, a hi, b hi] */
static void pair_runs(int8_t *q, int64_t pairs) {
    int8_t tmp[16];
    for (int64_t p = 0; p < pairs; p++, q += 2 * RUN) {
        memcpy(tmp, q + 16, 16);
        memcpy(q + 16, q + 32, 16);
        memcpy(q + 32, tmp, 16);
    }
}

/* the 8 run scales of block blk, in RUN_LANES order (per-group scales repeated per run) */
static inline __m256 block_scales(const half_t *s, int64_t blk, int64_t group) {
    if (group == RUN)
        return _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 8 * blk))),
                                        _mm256_loadu_si256((const __m256i *)RUN_LANES));
    float v[8];
    for (int l = 0; l < 8; l++) v[l] = half_to_float(s[(8 * blk + RUN_LANES[l]) * RUN / group]);
    return _mm256_loadu_ps(v);
}

/* dot(a, b) of float16 a and float32 b */
static inline float dot_half_f32(const half_t *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= n; k += 8)
        acc = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + k))), _mm256_loadu_ps(b + k), acc);
    float sum = hsum(acc);
    for (; k < n; k++) sum += half_to_float(a[k]) * b[k];
    return sum;
}

/* res[i] = dot(x row i, weight row) for NX (1 or 2) activation rows; w, s, m: the row's codes,
 * scales and minimums; xsg[i]: row i's xs summed per weight group */
static inline __attribute__((always_inline)) void q4_row(const QRow *x, const float *const *xsg, const int NX,
                                                         int64_t K, const uint8_t *w, const half_t *s,
                                                         const half_t *m, int64_t group, float *res) {
    const int64_t runs = K / RUN, blocks = runs / 8;
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256i lanes = _mm256_loadu_si256((const __m256i *)RUN_LANES);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t blk = 0; blk < blocks; blk++) {
        __m256i h01[2], h2[2], h[2];
        for (int p = 0; p < 4; p++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + blk * 128 + p * 32));
            const __m256i wl = _mm256_and_si256(v, low), wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
            for (int i = 0; i < NX; i++) {
                const int8_t *xb = x[i].q + blk * 256 + p * 64;
                const __m256i t = _mm256_madd_epi16(
                    _mm256_add_epi16(_mm256_maddubs_epi16(wl, _mm256_loadu_si256((const __m256i *)xb)),
                                     _mm256_maddubs_epi16(wh, _mm256_loadu_si256((const __m256i *)(xb + 32)))),
                    ones);
                if (p == 0) h01[i] = t;
                else if (p == 1) h01[i] = _mm256_hadd_epi32(h01[i], t);
                else if (p == 2) h2[i] = t;
                else h[i] = _mm256_hadd_epi32(h01[i], _mm256_hadd_epi32(h2[i], t));
            }
        }
        const __m256 sc = block_scales(s, blk, group);
        for (int i = 0; i < NX; i++) {
            const __m256 xd = _mm256_permutevar8x32_ps(_mm256_loadu_ps(x[i].d + 8 * blk), lanes);
            acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(h[i]), _mm256_mul_ps(sc, xd), acc[i]);
        }
    }
    const __m128i low4 = _mm_set1_epi8(15);
    for (int64_t b = 8 * blocks; b < runs; b++) {
        const __m256i wv = unpack_q4(w + b * (RUN / 2), low4);
        const float sc = half_to_float(s[b * RUN / group]);
        for (int i = 0; i < NX; i++)
            acc[i] = _mm256_fmadd_ps(dot_u8s8(wv, _mm256_loadu_si256((const __m256i *)(x[i].q + b * RUN))),
                                     _mm256_set1_ps(sc * x[i].d[b]), acc[i]);
    }
    for (int i = 0; i < NX; i++) res[i] = hsum(acc[i]) + dot_half_f32(m, xsg[i], K / group);
}

/* radixrt_quant_linear for int4 weights: each weight row against pairs of activation rows */
static int q4_linear(const float *x, int64_t x_stride, int64_t M, int64_t K, const uint8_t *qw,
                     const half_t *scales, const half_t *mins, int64_t group, const float *bias, float *out,
                     int64_t out_stride, int64_t N, int64_t parallel_min_macs) {
    const int64_t runs = K / RUN, ng = K / group;
    float *xd, *xs;
    int32_t *xsum;
    int8_t *xq = quantize_rows(x, x_stride, M, K, &xd, &xs, &xsum);
    if (xq == NULL) return 1;
    float *xsg = (float *)calloc((size_t)(M * ng), sizeof(float));
    if (xsg == NULL) {
        free(xq);
        return 1;
    }
    for (int64_t i = 0; i < M; i++) {
        pair_runs(xq + i * K, 4 * (runs / 8));
        for (int64_t b = 0; b < runs; b++) xsg[i * ng + b * RUN / group] += xs[i * runs + b];
    }
#pragma omp parallel for schedule(static) if (M * N * K >= parallel_min_macs)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t *w = qw + n * (K / 2);
        const half_t *s = scales + n * ng, *m = mins + n * ng;
        if (n + 4 < N) {
            /* 4 rows ahead, non-temporal: the weights stream past what the rest of the step keeps cached */
            for (int64_t o = 0; o < K / 2; o += 64) __builtin_prefetch(w + 4 * (K / 2) + o, 0, 0);
            __builtin_prefetch(s + 4 * ng, 0, 0);
            __builtin_prefetch(m + 4 * ng, 0, 0);
        }
        for (int64_t i = 0; i < M; i += 2) {
            const QRow rw[2] = {{xq + i * K, xd + i * runs, NULL}, {xq + (i + 1) * K, xd + (i + 1) * runs, NULL}};
            const float *sg[2] = {xsg + i * ng, xsg + (i + 1) * ng};
            float res[2];
            const int nx = i + 1 < M ? 2 : 1;
            if (nx == 2)
                q4_row(rw, sg, 2, K, w, s, m, group, res);
            else
                q4_row(rw, sg, 1, K, w, s, m, group, res);
            for (int j = 0; j < nx; j++) out[(i + j) * out_stride + n] = res[j] + (bias ? bias[n] : 0.0f);
        }
    }
    free(xsg);
    free(xq);
    return 0;
}
#else
static inline void q8_block(const QRow *x, const int NX, int64_t K, const void *qw, const float *scales,
                            const half_t *mins, int64_t group, int bits, int64_t n, int rows, float *res) {
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
                    acc += half_to_float(((const half_t *)scales)[g]) * x[i].d[b] * (float)sum +
                           half_to_float(mins[g]) * x[i].s[b];
                }
            }
            res[i * ROWS + r] = bits == 8 ? acc * scales[n + r] : acc;
        }
}
#endif

/* out [M, N] = x [M, K] @ dequant(W)^T (+ bias), x float32 with row i at x + i * x_stride and
 * out row i at out + i * out_stride; scales and mins as the layout says (int8: float32 scales,
 * int4: float16 scales and mins). Blocks of ROWS weight rows are split over OpenMP threads
 * when M * N * K >= parallel_min_macs (the OpenMP runtime torch itself runs on: see
 * kernels/quant_linear_cpu.py). Returns 0, or 1 when scratch memory cannot be allocated. */
int radixrt_quant_linear(const float *x, int64_t x_stride, int64_t M, int64_t K, const void *qw,
                         const void *scales, const void *mins, int64_t group, int bits, const float *bias,
                         float *out, int64_t out_stride, int64_t N, int64_t parallel_min_macs) {
#if defined(QL_AVX2)
    if (bits == 4)
        return q4_linear(x, x_stride, M, K, (const uint8_t *)qw, (const half_t *)scales, (const half_t *)mins, group,
                         bias, out, out_stride, N, parallel_min_macs);
#endif
    const int64_t runs = K / RUN;
    float *xd, *xs;
    int32_t *xsum;
    int8_t *xq = quantize_rows(x, x_stride, M, K, &xd, &xs, &xsum);
    if (xq == NULL) return 1;
    const int64_t blocks = (N + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(static) if (M * N * K >= parallel_min_macs)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int64_t n0 = blk * ROWS;
        const int rows = N - n0 < ROWS ? (int)(N - n0) : ROWS;
        if (bits == 8 && n0 + 2 * ROWS <= N) /* the next block's int8 rows, past the caches' other contents */
            for (int64_t o = 0; o < ROWS * K; o += 64)
                __builtin_prefetch((const char *)qw + (n0 + ROWS) * K + o, 0, 0);
        for (int64_t i = 0; i < M; i += 2) {
            const QRow rw[2] = {{xq + i * K, xd + i * runs, xs + i * runs},
                                {xq + (i + 1) * K, xd + (i + 1) * runs, xs + (i + 1) * runs}};
            const int nx = i + 1 < M ? 2 : 1;
            float res[2 * ROWS];
            if (nx == 2)
                q8_block(rw, 2, K, qw, (const float *)scales, (const half_t *)mins, group, bits, n0, rows, res);
            else
                q8_block(rw, 1, K, qw, (const float *)scales, (const half_t *)mins, group, bits, n0, rows, res);
            for (int j = 0; j < nx; j++)
                for (int r = 0; r < rows; r++)
                    out[(i + j) * out_stride + n0 + r] = res[j * ROWS + r] + (bias ? bias[n0 + r] : 0.0f);
        }
    }
    free(xq);
    return 0;
}


/* ---- the tiled layout: 16 weight rows per tile, for AVX-512 VNNI (vpdpbusd) ----
 * One vpdpbusd multiplies 4 bytes of 16 weight rows (one row per 32-bit lane) by the same 4
 * activation bytes (broadcast) and adds into 16 int32 sums: a decode step's product walks a
 * tile's runs with a few instructions per 512 weights, where the row layout above spends
 * about 12 per 32. N is padded to whole tiles with zero rows (their outputs are not stored).
 *   bits 4: tile t, run b (32 weights of k) is 256 bytes: 4 groups j of 64 bytes; in group j
 *           lane l's 4 bytes hold rows 16t + l's weights k = 32b + 8j + i (low nibble) and
 *           32b + 8j + 4 + i (high nibble), i = 0..3. scales, mins float32 [N / 16, K / group, 16].
 *   bits 8: tile t, run b is 512 bytes: 8 steps s of 64 bytes, lane l holding row 16t + l's
 *           weights k = 32b + 4s + i as q + 128 (unsigned). scales float32 [N / 16 * 16].
 * Tiles are laid out t-major: tile t's runs at qw + t * (K / 32) * (bytes per run). */

#define TILE 16

int radixrt_quant_tiles(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
static inline int32_t four_bytes(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* rows n_lo .. n_hi - 1 of the float32 weight [N, K] (the "rows" layout's dequantization, for
 * the tiled one): each row's run is gathered from its 4-byte pieces, then widened as above */
void radixrt_quant_tiles_dequant_f32(const uint8_t *qw, const float *scales, const float *mins, int64_t K,
                                     int64_t group, int bits, float *out, int64_t n_lo, int64_t n_hi) {
    const int64_t runs = K / RUN, ng = bits == 4 ? K / group : 0, run_bytes = bits == 4 ? 256 : 512;
    const __m128i low = _mm_set1_epi8(15), flip = _mm_set1_epi8((char)0x80);
    for (int64_t n = n_lo; n < n_hi; n++) {
        const int64_t t = n / TILE, l = n % TILE;
        const int8_t *tile = (const int8_t *)qw + t * runs * run_bytes + l * 4;
        float *row = out + n * K;
        for (int64_t b = 0; b < runs; b++) {
            const int8_t *r = tile + b * run_bytes;
            float *d = row + b * RUN;
            if (bits == 8) { /* q + 128 -> q: flipping the top bit of each byte */
                const __m256 sc = _mm256_set1_ps(scales[n]);
                for (int h = 0; h < 2; h++) {
                    const int8_t *p = r + 256 * h;
                    const __m128i v = _mm_xor_si128(
                        _mm_set_epi32(four_bytes(p + 192), four_bytes(p + 128), four_bytes(p + 64), four_bytes(p)),
                        flip);
                    _mm256_storeu_ps(d + 16 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), sc));
                    _mm256_storeu_ps(d + 16 * h + 8, _mm256_mul_ps(
                        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8))), sc));
                }
                continue;
            }
            const int64_t gi = (t * ng + b * RUN / group) * TILE + l;
            const __m256 sc = _mm256_set1_ps(scales[gi]), mn = _mm256_set1_ps(mins[gi]);
            const __m128i v = _mm_set_epi32(four_bytes(r + 192), four_bytes(r + 128), four_bytes(r + 64), four_bytes(r));
            const __m128i lo = _mm_and_si128(v, low), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low);
            const __m128i k_lo = _mm_unpacklo_epi32(lo, hi), k_hi = _mm_unpackhi_epi32(lo, hi); /* k 0..15, 16..31 */
            const __m128i parts[4] = {k_lo, _mm_srli_si128(k_lo, 8), k_hi, _mm_srli_si128(k_hi, 8)};
            for (int c = 0; c < 4; c++)
                _mm256_storeu_ps(d + 8 * c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[c])), sc, mn));
        }
    }
}

/* out[i][16 t + l] for NX activation rows i of x against tile t (only the first `rows` lanes
 * are stored). Integer sums per run are exact; the int8 format's +128 offset is taken off in
 * integers (xsum: each run's sum of the quantized activations). */
static inline __attribute__((always_inline)) void tile_product(const QRow *x, const int32_t *const *xsum,
                                                               const int NX, int64_t K, const uint8_t *qw,
                                                               const float *scales, const float *mins,
                                                               int64_t group, int bits, int64_t t, int rows,
                                                               const float *bias, float *const *out) {
    const int64_t runs = K / RUN, ng = bits == 4 ? K / group : 0;
    const int64_t run_bytes = bits == 4 ? 256 : 512;
    const uint8_t *tile = qw + t * runs * run_bytes;
    __m512 facc[4], macc[4];
    for (int i = 0; i < NX; i++) facc[i] = macc[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(15);
    for (int64_t b = 0; b < runs; b++) {
        const uint8_t *w = tile + b * run_bytes;
        __m512i iacc[4];
        for (int i = 0; i < NX; i++) iacc[i] = _mm512_setzero_si512();
        if (bits == 4) {
            for (int j = 0; j < 4; j++) {
                const __m512i v = _mm512_loadu_si512((const void *)(w + 64 * j));
                const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                for (int i = 0; i < NX; i++) {
                    const int8_t *xq = x[i].q + b * RUN + 8 * j;
                    iacc[i] = _mm512_dpbusd_epi32(iacc[i], lo, _mm512_set1_epi32(four_bytes(xq)));
                    iacc[i] = _mm512_dpbusd_epi32(iacc[i], hi, _mm512_set1_epi32(four_bytes(xq + 4)));
                }
            }
            const int64_t g = (t * ng + b * RUN / group) * TILE;
            const __m512 sc = _mm512_loadu_ps(scales + g), mn = _mm512_loadu_ps(mins + g);
            for (int i = 0; i < NX; i++) {
                const __m512 dot = _mm512_cvtepi32_ps(iacc[i]);
                facc[i] = _mm512_fmadd_ps(_mm512_mul_ps(dot, _mm512_set1_ps(x[i].d[b])), sc, facc[i]);
                macc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x[i].s[b]), macc[i]);
            }
        } else {
            for (int s = 0; s < 8; s++) {
                const __m512i v = _mm512_loadu_si512((const void *)(w + 64 * s));
                for (int i = 0; i < NX; i++) {
                    const int8_t *xq = x[i].q + b * RUN + 4 * s;
                    iacc[i] = _mm512_dpbusd_epi32(iacc[i], v, _mm512_set1_epi32(four_bytes(xq)));
                }
            }
            for (int i = 0; i < NX; i++) {
                const __m512i exact = _mm512_sub_epi32(iacc[i], _mm512_set1_epi32(128 * xsum[i][b]));
                facc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(exact), _mm512_set1_ps(x[i].d[b]), facc[i]);
            }
        }
    }
    const __mmask16 keep = (__mmask16)((1u << rows) - 1u);
    const __m512 bv = bias ? _mm512_maskz_loadu_ps(keep, bias + t * TILE) : _mm512_setzero_ps();
    for (int i = 0; i < NX; i++) {
        __m512 r = bits == 4 ? _mm512_add_ps(facc[i], macc[i])
                             : _mm512_mul_ps(facc[i], _mm512_loadu_ps(scales + t * TILE));
        _mm512_mask_storeu_ps(out[i] + t * TILE, keep, _mm512_add_ps(r, bv));
    }
}

/* as radixrt_quant_linear, for the tiled layout (callers check radixrt_quant_tiles() first) */
int radixrt_quant_linear_tiles(const float *x, int64_t x_stride, int64_t M, int64_t K, const uint8_t *qw,
                               const float *scales, const float *mins, int64_t group, int bits,
                               const float *bias, float *out, int64_t out_stride, int64_t N,
                               int64_t parallel_min_macs) {
    const int64_t runs = K / RUN;
    float *xd, *xs;
    int32_t *xsum;
    int8_t *xq = quantize_rows(x, x_stride, M, K, &xd, &xs, &xsum);
    if (xq == NULL) return 1;
    const int64_t tiles = (N + TILE - 1) / TILE;
#pragma omp parallel for schedule(static) if (M * N * K >= parallel_min_macs)
    for (int64_t t = 0; t < tiles; t++) {
        const int rows = N - t * TILE < TILE ? (int)(N - t * TILE) : TILE;
        for (int64_t i0 = 0; i0 < M; i0 += 4) {
            QRow rw[4];
            const int32_t *sums[4];
            float *dst[4];
            const int nx = M - i0 < 4 ? (int)(M - i0) : 4;
            for (int i = 0; i < nx; i++) {
                const int64_t r = i0 + i;
                rw[i] = (QRow){xq + r * K, xd + r * runs, xs + r * runs};
                sums[i] = xsum + r * runs;
                dst[i] = out + r * out_stride;
            }
            switch (nx) {
            case 1: tile_product(rw, sums, 1, K, qw, scales, mins, group, bits, t, rows, bias, dst); break;
            case 2: tile_product(rw, sums, 2, K, qw, scales, mins, group, bits, t, rows, bias, dst); break;
            case 3: tile_product(rw, sums, 3, K, qw, scales, mins, group, bits, t, rows, bias, dst); break;
            default: tile_product(rw, sums, 4, K, qw, scales, mins, group, bits, t, rows, bias, dst); break;
            }
        }
    }
    free(xq);
    return 0;
}
#endif
