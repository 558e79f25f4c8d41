/* Float32 linear layer for a few rows on the CPU: out = x @ W^T (+ bias).
 *
 *   x     float32, M rows of K at x + i * x_stride (elements contiguous)
 *   W     float32 [N, K], contiguous (an nn.Linear weight, or tied embeddings)
 *   bias  float32 [N] or NULL
 *   out   float32 [M, N], contiguous
 *
 * A decode step or a draft's verification multiplies a handful of rows by
 * every weight of the model. A BLAS tuned for other shapes reads the weights
 * several times for 4 to 32 rows on some CPUs (MKL on AMD Zen 3: 9 rows cost
 * 2.6x one row). This kernel reads each block of WROWS weight rows from memory
 * once and multiplies it by every activation row while it sits in L1/L2, so
 * the product costs the larger of reading the weights and its arithmetic,
 * not their sum: the next block is prefetched into L2 a slice per pass over
 * the activation rows, spread over the whole block's work (one burst in the
 * first pass left most of it unfetched when the later passes began, and the
 * hardware prefetcher does not run ahead while they hit L1: 16 rows ran at
 * half the arithmetic peak, 70-80% with the spread).
 *
 * Registers (AVX2: 16 of 8 floats): XROWS x WROWS accumulators, WROWS weight
 * vectors and one activation vector, so 8 columns cost WROWS + XROWS loads
 * for XROWS x WROWS FMAs (12 FMAs to 7 loads: bound by the FMA units, not the
 * two load ports).
 *
 * Every output element is the same sequence of operations whatever M is and
 * wherever its row falls in a block (one 8-lane FMA accumulator walked over K
 * in order, a fixed horizontal sum, the K % 8 tail, then the bias), so a
 * row's result never depends on the other rows of the call: a verified draft
 * token gets the bits a one-row decode step would give it.
 *
 * Returns 0, or 1 when built without AVX2 and FMA (the caller keeps torch's
 * product).
 */
#include <stdint.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

#define WROWS 3 /* weight rows per block: read once from memory per call */
#define XROWS 4 /* activation rows multiplied at once: 12 accumulators + 3 weight vectors + 1 */
#define LINE 64

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* The bytes [lo, hi) of the next block that one pass prefetches, `per_step` lines per 8 columns. */
typedef struct {
    const char *lo, *hi;
    int per_step;
} Prefetch;

/* out[i][j] for the nx activation rows at x and the nw weight rows at w (nx <= XROWS, nw <= WROWS;
 * called with constants, so the accumulators stay in registers). */
static inline __attribute__((always_inline)) void block(const float *x, int64_t x_stride, int nx, const float *w,
                                                        int64_t K, int nw, const float *bias, float *out,
                                                        int64_t out_stride, Prefetch pf) {
    __m256 acc[XROWS][WROWS];
    for (int i = 0; i < nx; i++)
        for (int j = 0; j < nw; j++) acc[i][j] = _mm256_setzero_ps();
    const int64_t k8 = K & ~(int64_t)7;
    for (int64_t k = 0; k < k8; k += 8) {
        for (int t = 0; t < pf.per_step && pf.lo < pf.hi; t++, pf.lo += LINE) _mm_prefetch(pf.lo, _MM_HINT_T1);
        __m256 wv[WROWS];
        for (int j = 0; j < nw; j++) {
            wv[j] = _mm256_loadu_ps(w + j * K + k);
            __asm__("" : "+x"(wv[j])); /* held in a register: not reloaded as an FMA operand per row */
        }
        for (int i = 0; i < nx; i++) {
            __m256 xv = _mm256_loadu_ps(x + i * x_stride + k);
            __asm__("" : "+x"(xv));
            for (int j = 0; j < nw; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < nx; i++)
        for (int j = 0; j < nw; j++) {
            float s = hsum(acc[i][j]);
            for (int64_t k = k8; k < K; k++) s += x[i * x_stride + k] * w[j * K + k];
            out[i * out_stride + j] = bias ? s + bias[j] : s;
        }
}

/* nx activation rows (a constant) times the block's nw weight rows (the partial last block: fewer). */
#define ROWS_TIMES_BLOCK(nx)                                                   \
    do {                                                                       \
        if (nw == WROWS) block(xi, x_stride, nx, w, K, WROWS, bias, oi, N, pf); \
        else if (nw == 2) block(xi, x_stride, nx, w, K, 2, bias, oi, N, pf);    \
        else block(xi, x_stride, nx, w, K, 1, bias, oi, N, pf);                 \
    } while (0)

/* One block of nw weight rows times every activation row, XROWS at a time; pass p prefetches
 * its share of the `next` block (NULL: none). */
static void weight_block(const float *x, int64_t x_stride, int64_t M, const float *w, int64_t K, int nw,
                         const float *bias, float *out, int64_t N, const char *next) {
    const int64_t passes = (M + XROWS - 1) / XROWS, bytes = (int64_t)WROWS * K * sizeof(float);
    const int64_t share = (bytes + LINE * passes - 1) / (LINE * passes) * LINE;
    const int64_t steps = K / 8 > 0 ? K / 8 : 1;
    const int per_step = (int)((share / LINE + steps - 1) / steps);
    for (int64_t i = 0; i < M; i += XROWS) {
        const float *xi = x + i * x_stride;
        float *oi = out + i * N;
        const int64_t p = i / XROWS, rows = M - i < XROWS ? M - i : XROWS;
        Prefetch pf = {0, 0, 0};
        if (next && p * share < bytes) {
            pf.lo = next + p * share;
            pf.hi = next + ((p + 1) * share < bytes ? (p + 1) * share : bytes);
            pf.per_step = per_step;
        }
        if (rows == XROWS) ROWS_TIMES_BLOCK(XROWS);
        else if (rows == 3) ROWS_TIMES_BLOCK(3);
        else if (rows == 2) ROWS_TIMES_BLOCK(2);
        else ROWS_TIMES_BLOCK(1);
    }
}

int radixrt_dense_linear(const float *x, int64_t x_stride, int64_t M, int64_t K, const float *w, int64_t N,
                         const float *bias, float *out, int64_t parallel_min_macs) {
    const int64_t blocks = (N + WROWS - 1) / WROWS;
#pragma omp parallel for schedule(static) if (M * N * K >= parallel_min_macs)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * WROWS;
        const int nw = (int)(N - n0 < WROWS ? N - n0 : WROWS);
        const char *next = n0 + 2 * WROWS <= N ? (const char *)(w + (n0 + WROWS) * K) : 0;
        weight_block(x, x_stride, M, w + n0 * K, K, nw, bias ? bias + n0 : 0, out + n0, N, next);
    }
    return 0;
}
#else
int radixrt_dense_linear(const float *x, int64_t x_stride, int64_t M, int64_t K, const float *w, int64_t N,
                         const float *bias, float *out, int64_t parallel_min_macs) {
    (void)x, (void)x_stride, (void)M, (void)K, (void)w, (void)N, (void)bias, (void)out, (void)parallel_min_macs;
    return 1;
}
#endif
