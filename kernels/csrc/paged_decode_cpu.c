/*
 * Paged decode attention on the CPU: one query token per row attends over that
 * row's KV slots, read in place from the paged pool; rows that share their first
 * slots (the tokens of one request's draft) read them once. Two entry
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
 *   shared   [B] int64 or NULL: shared[b] > 0 says that row b's first shared[b] slots are
 *            row b - 1's (rows of one request's short extend or draft); those K and V rows are
 *            then read once for both. shared[b] <= min(lens[b - 1], lens[b]); shared[0] is unused
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
#ifdef _OPENMP
#include <omp.h>
#define MAX_THREADS() omp_get_max_threads()
#else
#define MAX_THREADS() 1
#endif
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
   stall on every row that made this kernel about 10x slower there.) */
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

/* The scores of query row q (all Hq heads) against one K row, at column t of each head's
   score row (score rows len apart). */
#define SCORE_ROW(KV_T, LOAD_KV8, q, k_row, scores, len, t)                                                \
    for (int64_t h = 0; h < hkv; h++)                                                                     \
        for (int64_t g = 0; g < G; g++) {                                                                 \
            const int64_t head = h * G + g;                                                               \
            vec8 acc = {0};                                                                               \
            for (int64_t c = 0; c < NV; c++)                                                              \
                acc += load8((q) + head * D + c * 8) * LOAD_KV8((k_row) + h * D + c * 8);                 \
            (scores)[head * (len) + (t)] = sum8(acc) * scale;                                             \
        }

/* Row q's output (all heads) += its probabilities at column t times one V row. */
#define ACCUMULATE_ROW(KV_T, LOAD_KV8, out, v_row, scores, len, t)                                         \
    for (int64_t h = 0; h < hkv; h++)                                                                     \
        for (int64_t g = 0; g < G; g++) {                                                                 \
            const int64_t head = h * G + g;                                                               \
            const float p = (scores)[head * (len) + (t)];                                                 \
            for (int64_t c = 0; c < NV; c++) {                                                            \
                float *o = (out) + head * D + c * 8;                                                      \
                store8(o, load8(o) + p * LOAD_KV8((v_row) + h * D + c * 8));                              \
            }                                                                                             \
        }

/* keys a grouped row's output takes at a time, head by head: their V rows (32 x Hkv x D values)
   stay in L1 while the heads that share them take their turns */
#define ACC_BLOCK 32
/* output vectors a head keeps in registers while it walks a block (D up to 64 floats at once) */
#define ACC_VECS 8

/* ACCUMULATE_ROW over the keys t0..t1 (slots[t]), for a row of a group: the same terms added
   to each output element in the same order (t = t0, t0 + 1, ...), so the same result, but per
   block of keys each head's output stays in registers instead of being loaded and stored
   again for every key (the loop a lone row's decode is bound by memory enough not to mind,
   and a group's rows, walking blocks already in cache, are not). V rows up to prefetch_end
   are asked for a block ahead. */
#define DEFINE_ACCUMULATE_KEYS(NAME, KV_T, LOAD_KV8)                                                      \
    static inline __attribute__((always_inline)) void NAME(                                               \
        float *restrict out, const KV_T *restrict v_cache, const int64_t *slots, int64_t t0, int64_t t1,  \
        int64_t len, int64_t hq, int64_t hkv, int64_t NV, const float *restrict scores,                   \
        int64_t prefetch_end)                                                                             \
    {                                                                                                     \
        const int64_t G = hq / hkv, D = NV * 8, row = hkv * D, row_bytes = row * (int64_t)sizeof(KV_T);  \
        for (int64_t b0 = t0; b0 < t1; b0 += ACC_BLOCK) {                                                 \
            const int64_t b1 = b0 + ACC_BLOCK < t1 ? b0 + ACC_BLOCK : t1;                                 \
            for (int64_t head = 0; head < hq; head++) {                                                   \
                const int64_t h = head / G;                                                               \
                const float *restrict p = scores + head * len;                                            \
                for (int64_t c0 = 0; c0 < NV; c0 += ACC_VECS) {                                           \
                    const int64_t cn = NV - c0 < ACC_VECS ? NV - c0 : ACC_VECS;                           \
                    float *o = out + head * D + c0 * 8;                                                   \
                    vec8 acc[ACC_VECS];                                                                   \
                    for (int64_t c = 0; c < cn; c++) acc[c] = load8(o + c * 8);                           \
                    for (int64_t t = b0; t < b1; t++) {                                                   \
                        if (head == 0 && c0 == 0 && t + ACC_BLOCK < prefetch_end)                         \
                            prefetch_row(v_cache + slots[t + ACC_BLOCK] * row, row_bytes);                \
                        const KV_T *restrict v_row = v_cache + slots[t] * row + h * D + c0 * 8;           \
                        for (int64_t c = 0; c < cn; c++) acc[c] += p[t] * LOAD_KV8(v_row + c * 8);        \
                    }                                                                                     \
                    for (int64_t c = 0; c < cn; c++) store8(o + c * 8, acc[c]);                           \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
    }

DEFINE_ACCUMULATE_KEYS(accumulate_keys_f32, float, load8)
DEFINE_ACCUMULATE_KEYS(accumulate_keys_bf16, uint16_t, load8_bf16)

/* shared K / V rows a group's rows take in turn: a block stays in L1 / L2 while each row
   walks it (a row's own score rows are then its only write streams) */
#define SHARED_BLOCK 64

/* A group of n query rows (rows i of q, out, slots and lens, n <= MAX_GROUP) whose first
   `common` slots are the same slots (the tokens of one request's short extend or draft):
   each of those K and V rows is read once for the whole group. scores is scratch
   [n][Hq][max_kv]; NV = D / 8. Every row's arithmetic is that of a group of one, in the
   same order (its scores by column, its output accumulated over t = 0, 1, ...), so a row's
   result does not depend on the rows grouped with it. KV_T is the pool's element type,
   LOAD_KV8 reads eight of them as floats, and ACCUMULATE_KEYS is its DEFINE_ACCUMULATE_KEYS
   (the value loop of a group of two or more rows; a lone row's is ACCUMULATE_ROW). */
#define DEFINE_ATTEND(NAME, KV_T, LOAD_KV8, ACCUMULATE_KEYS)                                              \
    static inline __attribute__((always_inline)) void NAME(                                               \
        const float *const *q, const KV_T *restrict k_cache, const KV_T *restrict v_cache,               \
        const int64_t *const *slots, const int64_t *lens, int64_t n, int64_t common, int64_t max_kv,     \
        int64_t hq, int64_t hkv, int64_t NV, float scale, float *restrict scores, float *const *out)     \
    {                                                                                                     \
        const int64_t G = hq / hkv, D = NV * 8, row = hkv * D, row_bytes = row * (int64_t)sizeof(KV_T);  \
        const int64_t *shared = slots[0];                                                                 \
        for (int64_t t0 = 0; t0 < common; t0 += SHARED_BLOCK) {                                           \
            const int64_t t1 = t0 + SHARED_BLOCK < common ? t0 + SHARED_BLOCK : common;                   \
            for (int64_t i = 0; i < n; i++)                                                               \
                for (int64_t t = t0; t < t1; t++) {                                                       \
                    if (i == 0 && t + PREFETCH_DISTANCE < common)                                         \
                        prefetch_row(k_cache + shared[t + PREFETCH_DISTANCE] * row, row_bytes);           \
                    const KV_T *restrict k_row = k_cache + shared[t] * row;                               \
                    SCORE_ROW(KV_T, LOAD_KV8, q[i], k_row, scores + i * hq * max_kv, lens[i], t)          \
                }                                                                                         \
        }                                                                                                 \
        for (int64_t i = 0; i < n; i++) {                                                                 \
            const int64_t len = lens[i];                                                                  \
            float *s_i = scores + i * hq * max_kv;                                                        \
            for (int64_t t = common; t < len; t++) {                                                      \
                if (t + PREFETCH_DISTANCE < len) prefetch_row(k_cache + slots[i][t + PREFETCH_DISTANCE] * row, row_bytes); \
                const KV_T *restrict k_row = k_cache + slots[i][t] * row;                                 \
                SCORE_ROW(KV_T, LOAD_KV8, q[i], k_row, s_i, len, t)                                       \
            }                                                                                             \
            for (int64_t head = 0; head < hq; head++) {                                                   \
                float *restrict s = s_i + head * len;                                                     \
                float m = s[0];                                                                           \
                for (int64_t t = 1; t < len; t++) m = s[t] > m ? s[t] : m;                                \
                float total = 0.f;                                                                        \
                for (int64_t t = 0; t < len; t++) { s[t] = expf(s[t] - m); total += s[t]; }               \
                const float inv = 1.f / total;                                                            \
                for (int64_t t = 0; t < len; t++) s[t] *= inv;                                            \
            }                                                                                             \
            memset(out[i], 0, sizeof(float) * hq * D);                                                    \
        }                                                                                                 \
        if (n > 1) {                                                                                      \
            for (int64_t t0 = 0; t0 < common; t0 += SHARED_BLOCK) {                                       \
                const int64_t t1 = t0 + SHARED_BLOCK < common ? t0 + SHARED_BLOCK : common;               \
                for (int64_t i = 0; i < n; i++)                                                           \
                    ACCUMULATE_KEYS(out[i], v_cache, shared, t0, t1, lens[i], hq, hkv, NV,                 \
                                    scores + i * hq * max_kv, i == 0 ? common : 0);                       \
            }                                                                                             \
            for (int64_t i = 0; i < n; i++)                                                               \
                ACCUMULATE_KEYS(out[i], v_cache, slots[i], common, lens[i], lens[i], hq, hkv, NV,          \
                                scores + i * hq * max_kv, lens[i]);                                       \
            return;                                                                                       \
        }                                                                                                 \
        for (int64_t t0 = 0; t0 < common; t0 += SHARED_BLOCK) {                                           \
            const int64_t t1 = t0 + SHARED_BLOCK < common ? t0 + SHARED_BLOCK : common;                   \
            for (int64_t i = 0; i < n; i++)                                                               \
                for (int64_t t = t0; t < t1; t++) {                                                       \
                    if (i == 0 && t + PREFETCH_DISTANCE < common)                                         \
                        prefetch_row(v_cache + shared[t + PREFETCH_DISTANCE] * row, row_bytes);           \
                    const KV_T *restrict v_row = v_cache + shared[t] * row;                               \
                    ACCUMULATE_ROW(KV_T, LOAD_KV8, out[i], v_row, scores + i * hq * max_kv, lens[i], t)   \
                }                                                                                         \
        }                                                                                                 \
        for (int64_t i = 0; i < n; i++) {                                                                 \
            const int64_t len = lens[i];                                                                  \
            for (int64_t t = common; t < len; t++) {                                                      \
                if (t + PREFETCH_DISTANCE < len) prefetch_row(v_cache + slots[i][t + PREFETCH_DISTANCE] * row, row_bytes); \
                const KV_T *restrict v_row = v_cache + slots[i][t] * row;                                 \
                ACCUMULATE_ROW(KV_T, LOAD_KV8, out[i], v_row, scores + i * hq * max_kv, len, t)           \
            }                                                                                             \
        }                                                                                                 \
    }

DEFINE_ATTEND(attend_group_f32, float, load8, accumulate_keys_f32)
DEFINE_ATTEND(attend_group_bf16, uint16_t, load8_bf16, accumulate_keys_bf16)

/* rows of one group at most (the scratch: the widest group's rows * Hq * max_kv floats a thread) */
#define MAX_GROUP 16

/* The batch in groups of rows: row b joins row b - 1's group when shared[b] > 0 (its first
   shared[b] slots are row b - 1's), up to MAX_GROUP rows; a group's common slots are the
   fewest any of its rows shares. Groups are split over the OpenMP threads (torch's own
   runtime: radixrt.kernels.cpu_decode); ATTEND is one of the attend_group_* above. */
#define DEFINE_DECODE(NAME, KV_T, ATTEND)                                                                 \
    int NAME(const float *q, int64_t q_stride, const KV_T *k_cache, const KV_T *v_cache,                  \
             const int64_t *table, const int64_t *lens, const int64_t *shared, float *out, int64_t B,     \
             int64_t max_kv, int64_t hq, int64_t hkv, int64_t D, float scale, int64_t parallel_min_pairs) \
    {                                                                                                     \
        if (D % 8 != 0) return -2;                                                                        \
        const int64_t NV = D / 8;                                                                         \
        int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B + 1));                            \
        if (first == NULL) return -1;                                                                     \
        const int parallel = B > 1 && B * max_kv * hq >= parallel_min_pairs;                              \
        const int64_t threads = parallel ? MAX_THREADS() : 1;                                     \
        int64_t groups = 0, widest = 1;                                                                   \
        /* groups of at most MAX_GROUP rows; fewer groups than threads: smaller groups, so that   \
           every thread has rows (each group reads its shared rows again) */                       \
        for (int64_t cap = MAX_GROUP;; cap = (B + threads - 1) / threads) {                               \
            groups = 0;                                                                                   \
            for (int64_t b = 0; b < B; b++)                                                               \
                if (b == 0 || shared == NULL || shared[b] <= 0 || b - first[groups - 1] >= cap)           \
                    first[groups++] = b;                                                                  \
            if (groups >= threads || cap <= (B + threads - 1) / threads) break;                           \
        }                                                                                                 \
        first[groups] = B;                                                                                \
        for (int64_t gi = 0; gi < groups; gi++)                                                           \
            if (first[gi + 1] - first[gi] > widest) widest = first[gi + 1] - first[gi];                   \
        int failed = 0;                                                                                   \
        _Pragma("omp parallel if (parallel && groups > 1)")                                               \
        {                                                                                                 \
            float *scores = (float *)malloc(sizeof(float) * (size_t)(widest * hq * max_kv));              \
            if (scores == NULL) {                                                                         \
                _Pragma("omp atomic write")                                                               \
                failed = 1;                                                                               \
            }                                                                                             \
            _Pragma("omp for schedule(dynamic)")                                                          \
            for (int64_t gi = 0; gi < groups; gi++) {                                                     \
                if (scores == NULL) continue;                                                             \
                const int64_t b0 = first[gi], n = first[gi + 1] - b0;                                     \
                const float *qs[MAX_GROUP];                                                               \
                const int64_t *ss[MAX_GROUP];                                                             \
                float *os[MAX_GROUP];                                                                     \
                int64_t common = lens[b0];                                                                \
                for (int64_t i = 0; i < n; i++) {                                                         \
                    qs[i] = q + (b0 + i) * q_stride;                                                      \
                    ss[i] = table + (b0 + i) * max_kv;                                                    \
                    os[i] = out + (b0 + i) * hq * D;                                                      \
                    if (i > 0 && shared[b0 + i] < common) common = shared[b0 + i];                        \
                    if (lens[b0 + i] < common) common = lens[b0 + i];                                     \
                }                                                                                         \
                /* the common head sizes get loops of constant length */                                 \
                switch (NV) {                                                                             \
                case 2: ATTEND(qs, k_cache, v_cache, ss, lens + b0, n, common, max_kv, hq, hkv, 2, scale, scores, os); break;  \
                case 4: ATTEND(qs, k_cache, v_cache, ss, lens + b0, n, common, max_kv, hq, hkv, 4, scale, scores, os); break;  \
                case 8: ATTEND(qs, k_cache, v_cache, ss, lens + b0, n, common, max_kv, hq, hkv, 8, scale, scores, os); break;  \
                case 16: ATTEND(qs, k_cache, v_cache, ss, lens + b0, n, common, max_kv, hq, hkv, 16, scale, scores, os); break; \
                default: ATTEND(qs, k_cache, v_cache, ss, lens + b0, n, common, max_kv, hq, hkv, NV, scale, scores, os); \
                }                                                                                         \
            }                                                                                             \
            free(scores);                                                                                 \
        }                                                                                                 \
        free(first);                                                                                      \
        return failed ? -1 : 0;                                                                           \
    }

DEFINE_DECODE(radixrt_paged_decode_f32, float, attend_group_f32)
DEFINE_DECODE(radixrt_paged_decode_bf16, uint16_t, attend_group_bf16)
