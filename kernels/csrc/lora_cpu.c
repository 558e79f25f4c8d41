/*
 * LoRA deltas of a batch that mixes adapters, on the CPU: for every token row i
 * whose adapter slot s = slots[i] is not negative,
 *
 *     out[i, part] += (A_s x_i)[part's ranks] . B_part + bias_part
 *
 * for each part (an adapted module: an output slice of a fused projection) of
 * adapter s. Each row reads only its own adapter's weights (a gathered
 * matrix-vector product per row, as Punica's BGMV on GPUs), so the cost grows
 * with the rows and their ranks, not with how many adapters the batch mixes;
 * torch's batched products over stacked weights pay a dozen ops per projection
 * and a padded product per adapter instead. Two entry points:
 * radixrt_lora_add_f32 (x, out and weights float32) and radixrt_lora_add_bf16
 * (all bfloat16, widened to float32 as read). Both compute in float32 and round
 * once per output element (bfloat16: to nearest even, as torch's add).
 *
 * Contract (checked by the caller, radixrt.kernels.lora_cpu):
 *   x      [M, K]  rows ldx elements apart, elements contiguous
 *   out    [M, N]  rows ldo elements apart; read and written
 *   slots  [M] int32: the row's adapter slot, -1 for none
 *   descs  [num_slots] int64: the address of slot s's descriptor for this projection,
 *          0 where that adapter does not adapt it. A descriptor is an int64 array:
 *            [R, n_parts, address of A ([R, K] row-major),
 *             then per part: r0, r1, col0, width, address of B_part ([r1 - r0, width]
 *             row-major, scaled), address of bias_part ([width], scaled) or 0]
 *          with 0 <= r0 < r1 <= R <= MAX_RANK and col0 + width <= N.
 * Returns 0, -1 when scratch memory cannot be allocated, -2 for a rank above
 * MAX_RANK (out is then left untouched).
 *
 * Threads: OpenMP (torch's runtime, as the other kernels), rows first (x A), then
 * (row, column block) pairs; calls below parallel_min_macs multiply-adds stay on the
 * calling thread.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_RANK 1024
#define COLUMN_BLOCK 64 /* output columns a work item accumulates in registers */
#define ROW_BLOCK 4     /* rows of one adapter that share each weight read */
#define K_SLICE 512     /* input columns of x widened to float32 at a time */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t w = (uint32_t)h << 16;
    float f;
    memcpy(&f, &w, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t w;
    memcpy(&w, &f, sizeof w);
    if ((w & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((w >> 16) | 0x40); /* NaN stays NaN */
    w += 0x7fffu + ((w >> 16) & 1u);
    return (uint16_t)(w >> 16);
}

static inline float ld_f32(const float *p) { return *p; }
static inline float ld_bf16(const uint16_t *p) { return bf16_to_f32(*p); }
static inline void st_f32(float *p, float v) { *p = v; }
static inline void st_bf16(uint16_t *p, float v) { *p = f32_to_bf16(v); }

typedef struct {
    int64_t r0, r1, col0, width, b, bias;
} part_t;

/* the largest rank of the descriptors, or -1 when one is above MAX_RANK */
static int64_t max_rank(const int64_t *descs, int64_t num_slots) {
    int64_t r = 0;
    for (int64_t s = 0; s < num_slots; s++) {
        const int64_t *d = (const int64_t *)(intptr_t)descs[s];
        if (d == NULL) continue;
        if (d[0] > MAX_RANK) return -1;
        if (d[0] > r) r = d[0];
    }
    return r;
}

/* The rows with an adapter, grouped by slot (order), cut into chunks of at most ROW_BLOCK rows
   of one slot (chunk_start into order, chunk_len); returns the number of chunks. */
static int64_t chunk_rows(const int32_t *slots, int64_t M, const int64_t *descs, int64_t num_slots, int64_t *order,
                          int64_t *chunk_start, int64_t *chunk_len, int64_t *count) {
    memset(count, 0, (size_t)(num_slots + 1) * sizeof *count);
    for (int64_t i = 0; i < M; i++)
        if (slots[i] >= 0 && slots[i] < num_slots && descs[slots[i]] != 0) count[slots[i] + 1]++;
    for (int64_t s = 0; s < num_slots; s++) count[s + 1] += count[s];
    int64_t total = count[num_slots], chunks = 0;
    for (int64_t i = 0; i < M; i++)
        if (slots[i] >= 0 && slots[i] < num_slots && descs[slots[i]] != 0) order[count[slots[i]]++] = i;
    for (int64_t c = 0; c < total;) { /* count[s] now ends slot s's run */
        int64_t s = slots[order[c]], end = c;
        while (end < total && slots[order[end]] == s && end - c < ROW_BLOCK) end++;
        chunk_start[chunks] = c;
        chunk_len[chunks++] = end - c;
        c = end;
    }
    return chunks;
}

/* N rows (a compile-time constant after inlining) share each weight element they read */
#define DEFINE_ROWS(T, LD)                                                                                   \
    static inline void xa_rows_##T(int n, const T *const *xs, const T *a, int64_t R, int64_t K,             \
                                   float *const *xa) {                                                      \
        float xf[ROW_BLOCK][K_SLICE]; /* the rows' slice of x, widened once for all R products */           \
        for (int j = 0; j < n; j++)                                                                          \
            for (int64_t r = 0; r < R; r++) xa[j][r] = 0.0f;                                                 \
        for (int64_t k0 = 0; k0 < K; k0 += K_SLICE) {                                                        \
            const int64_t kl = K - k0 < K_SLICE ? K - k0 : K_SLICE;                                          \
            for (int j = 0; j < n; j++)                                                                      \
                for (int64_t k = 0; k < kl; k++) xf[j][k] = LD(xs[j] + k0 + k);                              \
            for (int64_t r = 0; r < R; r++) {                                                                \
                const T *ar = a + r * K + k0;                                                                \
                float acc[ROW_BLOCK] = {0};                                                                  \
                for (int64_t k = 0; k < kl; k++) {                                                           \
                    const float w = LD(ar + k);                                                              \
                    for (int j = 0; j < n; j++) acc[j] += w * xf[j][k];                                      \
                }                                                                                            \
                for (int j = 0; j < n; j++) xa[j][r] += acc[j];                                              \
            }                                                                                                \
        }                                                                                                    \
    }                                                                                                        \
    static inline void b_rows_##T(int n, const part_t *part, int64_t lo, int64_t hi, float *const *xa,     \
                                  float acc[][COLUMN_BLOCK]) {                                               \
        for (int64_t r = part->r0; r < part->r1; r++) {                                                      \
            const T *b = (const T *)(intptr_t)part->b + (r - part->r0) * part->width - part->col0;           \
            if (hi + COLUMN_BLOCK <= part->col0 + part->width) /* the next block's part of this rank's row */ \
                for (int64_t c = hi; c < hi + COLUMN_BLOCK; c += 64 / (int64_t)sizeof(T))                    \
                    __builtin_prefetch(b + c, 0, 1);                                                         \
            float v[ROW_BLOCK];                                                                              \
            for (int j = 0; j < n; j++) v[j] = xa[j][r];                                                     \
            for (int64_t c = lo; c < hi; c++) {                                                              \
                const float w = LD(b + c);                                                                   \
                for (int j = 0; j < n; j++) acc[j][c - lo] += v[j] * w;                                      \
            }                                                                                                \
        }                                                                                                    \
    }

typedef uint16_t bf16_t;
DEFINE_ROWS(float, ld_f32)
DEFINE_ROWS(bf16_t, ld_bf16)

/* call F(n, ...) with n a literal 1..ROW_BLOCK, so each row count gets its own unrolled copy */
#define WITH_ROWS(F, n, ...)                 \
    switch (n) {                             \
        case 1: F(1, __VA_ARGS__); break;    \
        case 2: F(2, __VA_ARGS__); break;    \
        case 3: F(3, __VA_ARGS__); break;    \
        default: F(4, __VA_ARGS__); break;   \
    }

#define DEFINE_LORA_ADD(NAME, T, LD, ST)                                                                     \
    int NAME(const T *x, int64_t ldx, int64_t M, int64_t K, T *out, int64_t ldo, int64_t N,                  \
             const int32_t *slots, const int64_t *descs, int64_t num_slots, int64_t parallel_min_macs) {     \
        int64_t rmax = max_rank(descs, num_slots);                                                           \
        if (rmax < 0) return -2;                                                                             \
        if (rmax == 0 || M == 0) return 0;                                                                   \
        float *xa = malloc((size_t)(M * rmax) * sizeof(float));                                              \
        int64_t *scratch = malloc((size_t)(3 * M + num_slots + 1) * sizeof(int64_t));                        \
        if (xa == NULL || scratch == NULL) {                                                                 \
            free(xa);                                                                                        \
            free(scratch);                                                                                   \
            return -1;                                                                                       \
        }                                                                                                    \
        int64_t *order = scratch, *chunk_start = scratch + M, *chunk_len = scratch + 2 * M;                  \
        const int64_t chunks = chunk_rows(slots, M, descs, num_slots, order, chunk_start, chunk_len,         \
                                          scratch + 3 * M);                                                  \
        const int64_t blocks = (N + COLUMN_BLOCK - 1) / COLUMN_BLOCK;                                        \
        _Pragma("omp parallel if (M * rmax * (K + N) >= parallel_min_macs)") {                               \
            /* xa[i] = A_s x_i: R dot products of length K per row, A read once per chunk */                 \
            _Pragma("omp for schedule(static)") for (int64_t ch = 0; ch < chunks; ch++) {                    \
                const int64_t *rows = order + chunk_start[ch];                                               \
                const int64_t *d = (const int64_t *)(intptr_t)descs[slots[rows[0]]];                         \
                const T *xs[ROW_BLOCK];                                                                      \
                float *xas[ROW_BLOCK];                                                                       \
                for (int j = 0; j < chunk_len[ch]; j++) {                                                    \
                    xs[j] = x + rows[j] * ldx;                                                               \
                    xas[j] = xa + rows[j] * rmax;                                                            \
                }                                                                                            \
                WITH_ROWS(xa_rows_##T, chunk_len[ch], xs, (const T *)(intptr_t)d[2], d[0], K, xas)           \
            }                                                                                                \
            /* out[i, block] += xa[i] . B over the parts that reach the block, B read once per chunk */      \
            _Pragma("omp for schedule(static)") for (int64_t item = 0; item < chunks * blocks; item++) {     \
                const int64_t ch = item / blocks, c0 = (item % blocks) * COLUMN_BLOCK;                       \
                const int64_t c1 = c0 + COLUMN_BLOCK < N ? c0 + COLUMN_BLOCK : N;                            \
                const int64_t *rows = order + chunk_start[ch];                                               \
                const int64_t *d = (const int64_t *)(intptr_t)descs[slots[rows[0]]];                         \
                const int n = (int)chunk_len[ch];                                                            \
                float *xas[ROW_BLOCK];                                                                       \
                for (int j = 0; j < n; j++) xas[j] = xa + rows[j] * rmax;                                    \
                for (int64_t p = 0; p < d[1]; p++) {                                                         \
                    part_t part;                                                                             \
                    memcpy(&part, d + 3 + 6 * p, sizeof part);                                               \
                    const int64_t lo = part.col0 > c0 ? part.col0 : c0;                                      \
                    const int64_t hi = part.col0 + part.width < c1 ? part.col0 + part.width : c1;            \
                    if (lo >= hi) continue;                                                                  \
                    float acc[ROW_BLOCK][COLUMN_BLOCK] = {{0}};                                              \
                    WITH_ROWS(b_rows_##T, n, &part, lo, hi, xas, acc)                                        \
                    const T *bias = (const T *)(intptr_t)part.bias;                                          \
                    for (int j = 0; j < n; j++) {                                                            \
                        T *o = out + rows[j] * ldo;                                                          \
                        for (int64_t c = lo; c < hi; c++) {                                                  \
                            const float extra = bias ? LD(bias + c - part.col0) : 0.0f;                      \
                            ST(o + c, LD(o + c) + (acc[j][c - lo] + extra));                                 \
                        }                                                                                    \
                    }                                                                                        \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
        free(xa);                                                                                            \
        free(scratch);                                                                                       \
        return 0;                                                                                            \
    }

DEFINE_LORA_ADD(radixrt_lora_add_f32, float, ld_f32, st_f32)
DEFINE_LORA_ADD(radixrt_lora_add_bf16, bf16_t, ld_bf16, st_bf16)
