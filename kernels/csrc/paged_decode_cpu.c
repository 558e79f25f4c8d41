/*
 * Paged decode attention on the CPU: one query token per request attends over
 * that request's KV slots, read in place from the paged pool. Two entry
 * points: radixrt_paged_decode_f32 (a float32 pool) and
 * radixrt_paged_decode_bf16 (a bfloat16 pool, each K/V element widened to
 * float32 as it is read: a bfloat16 is the top half of a float32). Both take
 * a float32 query and write a float32 output, and compute in float32.
 *
 * The torch path gathers every request's K and V into padded [B, max_kv]
 * tensors and then calls scaled_dot_product_attention, so each step writes
 * and re-reads a copy of the batch's whole KV; this kernel reads each slot's
 * K and V rows once, where they are.
 *
 * Contract (checked by the caller, radixrt.kernels.cpu_decode):
 *   q        [B, Hq, D]        heads and D contiguous, rows q_stride floats apart;
 *                              query head hd reads KV head hd / (Hq / Hkv)
 *   k_cache  [num_slots, Hkv, D] contiguous (one layer of the pool; float32 or bfloat16
 *            as the entry point says), v_cache likewise
 *   table    [B, max_kv] int64 contiguous; row b holds request b's slot ids in order,
 *            only the first lens[b] are read (the rest may be anything)
 *   lens     [B] int64, 1 <= lens[b] <= max_kv, and every slot id read is < num_slots
 *   out      [B, Hq, D]        contiguous, written, never read
 *   D is a multiple of 8.
 * Returns 0, or -1 when scratch memory cannot be allocated, -2 for a D that is
 * not a multiple of 8 (out is then left untouched).
 *
 * Built with -ffast-math at compile time only (it lets the exp loop use glibc's
 * vector expf and the dot products reassociate); the shared object is linked
 * without it, so loading it does not switch the process to flush-to-zero.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* eight floats; the compiler maps it onto AVX / AVX-512 / NEON registers */
/* slot rows are scattered over the pool: ask for the row this many tokens ahead early,
   into L2 rather than L1 (locality 2): prefetching into L1 was slower on the embedded
   model's decode shape and no faster on the tiny model's (python -m radixrt.bench.decode_kernel;
   figures: docs/benchmarks.md, "CPU decode attention") */
#define PREFETCH_DISTANCE 16

static inline void prefetch_row(const void *row, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)row + i, 0, 2);  /* one line each */
}

typedef float vec8 __attribute__((vector_size(32)));
typedef uint32_t u32x8 __attribute__((vector_size(32)));
/* the same vectors at any address a float (a bfloat16) may have: loads and stores through
   these are single unaligned moves. (Not memcpy into a vec8: gcc 12 tuned for Zen 3 splits
   it into two 16-byte loads, stores them to the stack and reloads 32 bytes, a store-forwarding
   stall on every row that made this kernel 20x slower there.) */
typedef float vec8_unaligned __attribute__((vector_size(32), aligned(4), may_alias));
typedef uint16_t u16x8_unaligned __attribute__((vector_size(16), aligned(2), may_alias));
typedef uint16_t u16x8 __attribute__((vector_size(16)));

static inline vec8 load8(const float *p) { return *(const vec8_unaligned *)p; }
static inline void store8(float *p, vec8 v) { *(vec8_unaligned *)p = v; }

/* eight bfloat16 widened to float32: each is the high half of its float */
static inline vec8 load8_bf16(const uint16_t *p) {
    u16x8 h = *(const u16x8_unaligned *)p;
    u32x8 w = __builtin_convertvector(h, u32x8) << 16;
    return (vec8)w;
}

static inline float sum8(vec8 x) {
    float s = 0.f;
    for (int i = 0; i < 8; i++) s += x[i];
    return s;
}

/* One request: scores [Hq, len] is scratch; NV = D / 8. KV_T is the pool's element
   type and LOAD_KV8 reads eight of them as floats. */
#define DEFINE_ATTEND(NAME, KV_T, LOAD_KV8)                                                               \
    static inline __attribute__((always_inline)) void NAME(                                               \
        const float *restrict q, const KV_T *restrict k_cache, const KV_T *restrict v_cache,             \
        const int64_t *restrict slots, int64_t len, int64_t hq, int64_t hkv, int64_t NV, float scale,    \
        float *restrict scores, float *restrict out)                                                     \
    {                                                                                                     \
        const int64_t G = hq / hkv, D = NV * 8, row = hkv * D, row_bytes = row * (int64_t)sizeof(KV_T);  \
        for (int64_t t = 0; t < len; t++) {                                                               \
            if (t + PREFETCH_DISTANCE < len) prefetch_row(k_cache + slots[t + PREFETCH_DISTANCE] * row, row_bytes); \
            const KV_T *restrict k_row = k_cache + slots[t] * row;                                        \
            for (int64_t h = 0; h < hkv; h++)                                                             \
                for (int64_t g = 0; g < G; g++) {                                                         \
                    const int64_t head = h * G + g;                                                       \
                    vec8 acc = {0};                                                                       \
                    for (int64_t c = 0; c < NV; c++)                                                      \
                        acc += load8(q + head * D + c * 8) * LOAD_KV8(k_row + h * D + c * 8);             \
                    scores[head * len + t] = sum8(acc) * scale;                                           \
                }                                                                                         \
        }                                                                                                 \
        for (int64_t head = 0; head < hq; head++) {                                                       \
            float *restrict s = scores + head * len;                                                      \
            float m = s[0];                                                                               \
            for (int64_t t = 1; t < len; t++) m = s[t] > m ? s[t] : m;                                    \
            float total = 0.f;                                                                            \
            for (int64_t t = 0; t < len; t++) { s[t] = expf(s[t] - m); total += s[t]; }                   \
            const float inv = 1.f / total;                                                                \
            for (int64_t t = 0; t < len; t++) s[t] *= inv;                                                \
        }                                                                                                 \
        memset(out, 0, sizeof(float) * hq * D);                                                           \
        for (int64_t t = 0; t < len; t++) {                                                               \
            if (t + PREFETCH_DISTANCE < len) prefetch_row(v_cache + slots[t + PREFETCH_DISTANCE] * row, row_bytes); \
            const KV_T *restrict v_row = v_cache + slots[t] * row;                                        \
            for (int64_t h = 0; h < hkv; h++)                                                             \
                for (int64_t g = 0; g < G; g++) {                                                         \
                    const int64_t head = h * G + g;                                                       \
                    const float p = scores[head * len + t];                                               \
                    for (int64_t c = 0; c < NV; c++) {                                                    \
                        float *o = out + head * D + c * 8;                                                \
                        store8(o, load8(o) + p * LOAD_KV8(v_row + h * D + c * 8));                        \
                    }                                                                                     \
                }                                                                                         \
        }                                                                                                 \
    }

DEFINE_ATTEND(attend_request_f32, float, load8)
DEFINE_ATTEND(attend_request_bf16, uint16_t, load8_bf16)

/* The batch, requests split over the OpenMP threads (torch's own runtime:
   radixrt.kernels.cpu_decode); ATTEND is one of the attend_request_* above. */
#define DEFINE_DECODE(NAME, KV_T, ATTEND)                                                                 \
    int NAME(const float *q, int64_t q_stride, const KV_T *k_cache, const KV_T *v_cache,                  \
             const int64_t *table, const int64_t *lens, float *out, int64_t B, int64_t max_kv,            \
             int64_t hq, int64_t hkv, int64_t D, float scale, int64_t parallel_min_pairs)                 \
    {                                                                                                     \
        if (D % 8 != 0) return -2;                                                                        \
        const int64_t NV = D / 8;                                                                         \
        int failed = 0;                                                                                   \
        _Pragma("omp parallel if (B > 1 && B * max_kv * hq >= parallel_min_pairs)")                       \
        {                                                                                                 \
            float *scores = (float *)malloc(sizeof(float) * (size_t)(hq * max_kv));                       \
            if (scores == NULL) {                                                                         \
                _Pragma("omp atomic write")                                                               \
                failed = 1;                                                                               \
            }                                                                                             \
            _Pragma("omp for schedule(static)")                                                           \
            for (int64_t b = 0; b < B; b++) {                                                             \
                if (scores == NULL) continue;                                                             \
                const float *qb = q + b * q_stride;                                                       \
                const int64_t *slots = table + b * max_kv;                                                \
                float *ob = out + b * hq * D;                                                             \
                /* the common head sizes get loops of constant length */                                 \
                switch (NV) {                                                                             \
                case 2: ATTEND(qb, k_cache, v_cache, slots, lens[b], hq, hkv, 2, scale, scores, ob); break;  \
                case 4: ATTEND(qb, k_cache, v_cache, slots, lens[b], hq, hkv, 4, scale, scores, ob); break;  \
                case 8: ATTEND(qb, k_cache, v_cache, slots, lens[b], hq, hkv, 8, scale, scores, ob); break;  \
                case 16: ATTEND(qb, k_cache, v_cache, slots, lens[b], hq, hkv, 16, scale, scores, ob); break; \
                default: ATTEND(qb, k_cache, v_cache, slots, lens[b], hq, hkv, NV, scale, scores, ob);   \
                }                                                                                         \
            }                                                                                             \
            free(scores);                                                                                 \
        }                                                                                                 \
        return failed ? -1 : 0;                                                                           \
    }

DEFINE_DECODE(radixrt_paged_decode_f32, float, attend_request_f32)
DEFINE_DECODE(radixrt_paged_decode_bf16, uint16_t, attend_request_bf16)
