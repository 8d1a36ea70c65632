/* Native CPU kernels of scaled_dot_product_attention (attention_native.py holds the
 * contract; kernels/cpu/attention.py's numpy engine is the reference), float32 and
 * float64, built and loaded by native.py.
 *
 * Forward (FlashAttention's): a unit of work is one head and ATT_BR query rows. Its
 * keys are packed (a single row, a cached pass's token, reads them in place instead;
 * K transposed, V row by row, both zero-padded to whole vectors) and
 * visited ATT_BC at a time: the block's scores S = scale q k^T (+ the mask; -inf where
 * a bool mask, the causal rule or the end of the keys excludes a pair), the rows'
 * running maximum m and sum l of exp(S - m) (the online softmax: earlier sums and
 * outputs are rescaled by exp(m_old - m_new)), then out += P v with P = exp(S - m)
 * (times the kept pairs' 1 / (1 - p) under dropout). At the end out /= l and
 * lse = m + log(l); a row with no key left has out 0 and lse -inf. Only a block of
 * scores is ever held: memory grows with T, not T^2.
 *
 * Backward: attention_backward.h. A single query row: attention_rows.h. Dropout's
 * Philox words: attention_philox.h.
 *
 * Every product is one routine (mm below): rows of C += A (scalars, any strides)
 * times rows of a packed B, four rows by two vectors at a time. Dropout: pair f =
 * ((n H + h) Tq + i) Tk + j is kept when (word f % 4 of Philox4x32-10(f / 4, stream,
 * seed64)) >> 8 / 2^24 >= p, the draw of dropout_native.c. Each value is computed by
 * one thread in one order (dQ's per-thread sums are added in thread order), so the
 * results depend on the number of threads only through that last sum. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_pool.h"
#include "vector_math.h"
#include "attention_philox.h"
#include "attention_backward.h"

#define ATT_BR 64                /* query rows per block */
#define ATT_BC 64                /* keys per block */
#define ATT_ALIGN 64

/* The products' and scans' vectors: one AVX-512 register where the build target has
 * them (16 floats, 8 doubles), else 32 bytes. */
#if defined(__AVX512F__)
#define ATT_VBYTES 64
#else
#define ATT_VBYTES 32
#endif
typedef float va __attribute__((vector_size(ATT_VBYTES)));
typedef float vau __attribute__((vector_size(ATT_VBYTES), aligned(4)));
typedef int32_t vai __attribute__((vector_size(ATT_VBYTES)));
typedef double vd __attribute__((vector_size(ATT_VBYTES)));
typedef int64_t vl __attribute__((vector_size(ATT_VBYTES)));
typedef double vdu __attribute__((vector_size(ATT_VBYTES), aligned(8)));

/* Indices into the strides array the launcher passes (elements, not bytes): batch,
 * head and row strides of each tensor (its last axis is contiguous), then the mask's
 * four (0 along a broadcast axis). */
enum { S_Q = 0, S_K = 3, S_V = 6, S_O = 9, S_DO = 12, S_DQ = 15, S_DK = 18, S_DV = 21,
       S_M = 24, S_COUNT = 28 };

typedef struct {
    const void *q, *k, *v, *mask, *o, *lse_in, *dout;
    void *out, *lse, *dq, *dk, *dv, *ds;
    int64_t n, h, tq, tk, hd, vd, dp, dvp, nh, qblocks, kblocks;
    const int64_t *st;
    int mask_kind, causal, f64, split;
    int64_t offset;
    double scale, p, factor;
    uint64_t seed64;
    uint32_t stream, threshold;          /* keep a pair when (word >> 8) >= threshold */
    int64_t next;                        /* the next unit (shared counter) */
    int64_t units;
    int failed;
} att_t;

typedef struct {
    att_t *a;
    int64_t index;                       /* this job's number (its dQ buffer) */
    void *dq_sum;                        /* split backward: its dQ sums (nh x tq x dp) */
} att_job_t;

/* after the vector types and att_t, which it uses */
#include "attention_rows.h"

static int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

static void *aligned_zeros(size_t bytes)
{
    void *p;
    if (bytes == 0) bytes = ATT_ALIGN;
    p = aligned_alloc(ATT_ALIGN, (bytes + ATT_ALIGN - 1) / ATT_ALIGN * ATT_ALIGN);
    if (p == NULL) return NULL;
    memset(p, 0, bytes);
    return p;
}

/* The keys a query row i sees of the block j0 .. j0 + kc: those before the returned
 * count (the causal rule; a mask may drop more). */
static inline int64_t row_keys(const att_t *a, int64_t i, int64_t j0, int64_t kc)
{
    if (!a->causal) return kc;
    const int64_t lim = i + a->offset - j0 + 1;
    return lim < 0 ? 0 : lim < kc ? lim : kc;
}

#define DEFINE_KERNELS(T, S, V, VU, VW, VI)                                                \
/* The largest of the ATT_BC values of a row and `top`, VW lanes at a time. */           \
static inline T row_max_##S(const T *row, T top)                                          \
{                                                                                         \
    V m = *(const VU *)row;                                                               \
    for (int64_t c = VW; c < ATT_BC; c += VW) {                                           \
        const V x = *(const VU *)(row + c);                                               \
        const VI bigger = (VI)(x > m);                                                    \
        m = (V)(((VI)x & bigger) | ((VI)m & ~bigger));                                    \
    }                                                                                     \
    T lanes[VW];                                                                          \
    memcpy(lanes, &m, sizeof lanes);                                                      \
    for (int i = 0; i < VW; i++) top = lanes[i] > top ? lanes[i] : top;                  \
    return top;                                                                           \
}                                                                                         \
                                                                                          \
/* C[r][x] (+)= sum_t A[r*ars + t*acs] * B[t*bs + x] for r < R, t < K, x < X (X a      \
 * multiple of 2*VW; B's rows and C's rows vector-aligned or not). */                     \
static void mm_##S(int64_t R, int64_t K, int64_t X, const T *A, int64_t ars, int64_t acs, \
                   const T *B, int64_t bs, T *C, int64_t cs, int acc)                     \
{                                                                                         \
    int64_t r = 0;                                                                        \
    for (; r + 4 <= R; r += 4) {                                                          \
        const T *a0 = A + r * ars, *a1 = a0 + ars, *a2 = a1 + ars, *a3 = a2 + ars;        \
        for (int64_t x = 0; x < X; x += 2 * VW) {                                         \
            T *c = C + r * cs + x;                                                        \
            V c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0},           \
              c30 = {0}, c31 = {0};                                                       \
            if (acc) {                                                                    \
                c00 = *(VU *)c; c01 = *(VU *)(c + VW);                                    \
                c10 = *(VU *)(c + cs); c11 = *(VU *)(c + cs + VW);                        \
                c20 = *(VU *)(c + 2 * cs); c21 = *(VU *)(c + 2 * cs + VW);                \
                c30 = *(VU *)(c + 3 * cs); c31 = *(VU *)(c + 3 * cs + VW);                \
            }                                                                             \
            const T *b = B + x;                                                           \
            for (int64_t t = 0; t < K; t++, b += bs) {                                    \
                const V b0 = *(const VU *)b, b1 = *(const VU *)(b + VW);                  \
                const T w0 = a0[t * acs], w1 = a1[t * acs], w2 = a2[t * acs],             \
                        w3 = a3[t * acs];                                                 \
                c00 += w0 * b0; c01 += w0 * b1; c10 += w1 * b0; c11 += w1 * b1;           \
                c20 += w2 * b0; c21 += w2 * b1; c30 += w3 * b0; c31 += w3 * b1;           \
            }                                                                             \
            *(VU *)c = c00; *(VU *)(c + VW) = c01;                                        \
            *(VU *)(c + cs) = c10; *(VU *)(c + cs + VW) = c11;                            \
            *(VU *)(c + 2 * cs) = c20; *(VU *)(c + 2 * cs + VW) = c21;                    \
            *(VU *)(c + 3 * cs) = c30; *(VU *)(c + 3 * cs + VW) = c31;                    \
        }                                                                                 \
    }                                                                                     \
    for (; r < R; r++) {                                                                  \
        const T *a0 = A + r * ars;                                                        \
        for (int64_t x = 0; x < X; x += 2 * VW) {                                         \
            T *c = C + r * cs + x;                                                        \
            V c00 = {0}, c01 = {0};                                                       \
            if (acc) { c00 = *(VU *)c; c01 = *(VU *)(c + VW); }                           \
            const T *b = B + x;                                                           \
            for (int64_t t = 0; t < K; t++, b += bs) {                                    \
                const T w0 = a0[t * acs];                                                 \
                c00 += w0 * *(const VU *)b; c01 += w0 * *(const VU *)(b + VW);            \
            }                                                                             \
            *(VU *)c = c00; *(VU *)(c + VW) = c01;                                        \
        }                                                                                 \
    }                                                                                     \
}                                                                                         \
                                                                                          \
/* Keys j0 .. j0 + kc of head (n, h) packed: kt (dp x ATT_BC, K transposed), kp (ATT_BC  \
 * x dp) and vt (dvp x ATT_BC) or vp (ATT_BC x dvp), zeros past the data; NULL: skip. */ \
static void pack_keys_##S(const att_t *a, int64_t n, int64_t h, int64_t j0, int64_t kc,   \
                          T *kt, T *kp, T *vt, T *vp)                                     \
{                                                                                         \
    const int64_t *st = a->st;                                                            \
    const T *k = (const T *)a->k + n * st[S_K] + h * st[S_K + 1] + j0 * st[S_K + 2];      \
    const T *v = (const T *)a->v + n * st[S_V] + h * st[S_V + 1] + j0 * st[S_V + 2];      \
    if (kt) memset(kt, 0, sizeof(T) * a->dp * ATT_BC);                                    \
    if (kp) memset(kp, 0, sizeof(T) * a->dp * ATT_BC);                                    \
    if (vt) memset(vt, 0, sizeof(T) * a->dvp * ATT_BC);                                   \
    if (vp) memset(vp, 0, sizeof(T) * a->dvp * ATT_BC);                                   \
    for (int64_t j = 0; j < kc; j++) {                                                    \
        const T *kr = k + j * st[S_K + 2], *vr = v + j * st[S_V + 2];                     \
        if (kt) for (int64_t c = 0; c < a->hd; c++) kt[c * ATT_BC + j] = kr[c];            \
        if (kp) memcpy(kp + j * a->dp, kr, sizeof(T) * a->hd);                             \
        if (vt) for (int64_t c = 0; c < a->vd; c++) vt[c * ATT_BC + j] = vr[c];           \
        if (vp) memcpy(vp + j * a->dvp, vr, sizeof(T) * a->vd);                           \
    }                                                                                     \
}                                                                                         \
                                                                                          \
/* z[0 .. count) = the dropout factors (factor, or 0 where dropped) of the pairs        \
 * first, first + 1, ... (count <= ATT_BC). */                                            \
static void keep_factors_##S(const att_t *a, uint64_t first, int64_t count, T *z)         \
{                                                                                         \
    uint32_t words[4 * PHX_LANES * ((ATT_BC + 3 + 4 * PHX_LANES - 1) / (4 * PHX_LANES))]; \
    const uint32_t k0 = (uint32_t)a->seed64, k1 = (uint32_t)(a->seed64 >> 32);            \
    const int64_t skip = (int64_t)(first & 3), calls = (skip + count + 3) / 4;             \
    for (int64_t c = 0; c < calls; c += PHX_LANES)                                        \
        philox_lanes((first >> 2) + (uint64_t)c, a->stream, k0, k1, words + 4 * c);       \
    const T factor = (T)a->factor;                                                        \
    const uint32_t *w = words + skip;                                                     \
    for (int64_t j = 0; j < count; j++) z[j] = (w[j] >> 8) >= a->threshold ? factor : (T)0; \
}                                                                                         \
                                                                                          \
/* The scores s (rows x ATT_BC) of query rows i0.. against keys j0 .. j0 + kc: scaled,   \
 * the mask added or applied, the causal rule, -inf past the keys. s holds q k^T. */     \
static void finish_scores_##S(const att_t *a, int64_t n, int64_t h, int64_t i0,           \
                              int64_t rows, int64_t j0, int64_t kc, T *s)                 \
{                                                                                         \
    const int64_t *ms = a->st + S_M;                                                      \
    const T scale = (T)a->scale, ninf = (T)-INFINITY;                                     \
    for (int64_t r = 0; r < rows; r++) {                                                  \
        T *row = s + r * ATT_BC;                                                          \
        const int64_t i = i0 + r;                                                         \
        const int64_t last = row_keys(a, i, j0, kc);      /* keys j0 + c, c < last, pass */ \
        for (int64_t c = 0; c < ATT_BC; c++) row[c] *= scale;                             \
        if (a->mask_kind == 1) {                                                          \
            const uint8_t *m = (const uint8_t *)a->mask + n * ms[0] + h * ms[1] + i * ms[2] \
                               + j0 * ms[3];                                              \
            for (int64_t c = 0; c < last; c++)                                            \
                if (!m[c * ms[3]]) row[c] = ninf;                                         \
        } else if (a->mask_kind == 2) {                                                   \
            const T *m = (const T *)a->mask + n * ms[0] + h * ms[1] + i * ms[2]           \
                         + j0 * ms[3];                                                    \
            for (int64_t c = 0; c < last; c++) row[c] += m[c * ms[3]];                    \
        }                                                                                 \
        for (int64_t c = last; c < ATT_BC; c++) row[c] = ninf;                            \
    }                                                                                     \
}                                                                                         \
                                                                                          \
/* The keys a block of query rows i0 .. i0 + rows can see: [0, the returned end). */     \
static int64_t keys_seen_##S(const att_t *a, int64_t i0, int64_t rows)                    \
{                                                                                         \
    if (!a->causal) return a->tk;                                                         \
    int64_t end = i0 + rows - 1 + a->offset + 1;                                          \
    return end < 0 ? 0 : end < a->tk ? end : a->tk;                                       \
}                                                                                         \
                                                                                          \
/* sum of x[t] y[t] for t < n: VW lanes at a time, then the lanes and the rest. */        \
DEFINE_ROW_KERNELS(T, S, V, VU, VW)                                                       \
                                                                                          \
static void forward_unit_##S(att_t *a, T *kt, T *vp, T *s, T *o, T *z, int64_t unit)    \
{                                                                                         \
    const int64_t *st = a->st;                                                            \
    const int64_t hh = unit / a->qblocks, n = hh / a->h, h = hh % a->h;                   \
    const int64_t i0 = unit % a->qblocks * ATT_BR;                                        \
    const int64_t rows = a->tq - i0 < ATT_BR ? a->tq - i0 : ATT_BR;                       \
    const T *q = (const T *)a->q + n * st[S_Q] + h * st[S_Q + 1] + i0 * st[S_Q + 2];      \
    T m[ATT_BR], l[ATT_BR];                                                               \
    for (int64_t r = 0; r < rows; r++) { m[r] = (T)-INFINITY; l[r] = 0; }                 \
    memset(o, 0, sizeof(T) * rows * a->dvp);                                              \
    const int64_t seen = keys_seen_##S(a, i0, rows);                                      \
    for (int64_t j0 = 0; j0 < seen; j0 += ATT_BC) {                                       \
        const int64_t kc = a->tk - j0 < ATT_BC ? a->tk - j0 : ATT_BC;                     \
        if (rows == 1) {                      /* a cached pass's token: no packing */    \
            row_scores_##S(a, n, h, q, j0, kc, s);                                        \
        } else {                                                                          \
            pack_keys_##S(a, n, h, j0, kc, kt, NULL, NULL, vp);                           \
            mm_##S(rows, a->hd, ATT_BC, q, st[S_Q + 2], 1, kt, ATT_BC, s, ATT_BC, 0);      \
        }                                                                                 \
        finish_scores_##S(a, n, h, i0, rows, j0, kc, s);                                  \
        for (int64_t r = 0; r < rows; r++) {                                              \
            T *row = s + r * ATT_BC;                                                      \
            const T top = row_max_##S(row, m[r]);                                         \
            if (top == (T)-INFINITY) {                 /* nothing here for this row */   \
                memset(row, 0, sizeof(T) * ATT_BC);                                       \
                continue;                                                                 \
            }                                                                             \
            const T alpha = m[r] == (T)-INFINITY ? (T)0 : (T)exp(m[r] - top);             \
            m[r] = top;                                                                   \
            T sum = exp_row_##S(row, top);                                                \
            l[r] = l[r] * alpha + sum;                                                    \
            if (alpha != (T)1) {                                                          \
                T *orow = o + r * a->dvp;                                                 \
                for (int64_t c = 0; c < a->dvp; c++) orow[c] *= alpha;                    \
            }                                                                             \
            if (a->p > 0) {                    /* past `last`, the row is 0 already */   \
                const int64_t last = row_keys(a, i0 + r, j0, kc);                         \
                keep_factors_##S(a, (uint64_t)((hh * a->tq + i0 + r) * a->tk + j0), last, z); \
                for (int64_t c = 0; c < last; c++) row[c] *= z[c];                        \
            }                                                                             \
        }                                                                                 \
        if (rows == 1)                                                                    \
            row_values_##S(a, n, h, s, j0, kc, o);                                        \
        else                                                                              \
            mm_##S(rows, kc, a->dvp, s, ATT_BC, 1, vp, a->dvp, o, a->dvp, 1);             \
    }                                                                                     \
    T *out = (T *)a->out + n * st[S_O] + h * st[S_O + 1] + i0 * st[S_O + 2];              \
    T *lse = a->lse ? (T *)a->lse + hh * a->tq + i0 : NULL;                               \
    for (int64_t r = 0; r < rows; r++) {                                                  \
        T *dst = out + r * st[S_O + 2];                                                   \
        const T *orow = o + r * a->dvp;                                                   \
        if (l[r] > 0) {                                                                   \
            const T inv = (T)1 / l[r];                                                    \
            for (int64_t c = 0; c < a->vd; c++) dst[c] = orow[c] * inv;                   \
            if (lse) lse[r] = m[r] + (T)log(l[r]);                                        \
        } else {                                                                          \
            for (int64_t c = 0; c < a->vd; c++) dst[c] = 0;                               \
            if (lse) lse[r] = (T)-INFINITY;                                               \
        }                                                                                 \
    }                                                                                     \
}                                                                                         \
                                                                                          \
static void *forward_job_##S(void *arg)                                                   \
{                                                                                         \
    att_job_t *job = arg;                                                                 \
    att_t *a = job->a;                                                                    \
    /* a pass of single query rows (a cached token) packs nothing: no kt, vp */          \
    const int64_t br = a->tq < ATT_BR ? a->tq : ATT_BR, packs = br > 1;                   \
    T *kt = packs ? aligned_zeros(sizeof(T) * a->dp * ATT_BC) : NULL;                     \
    T *vp = packs ? aligned_zeros(sizeof(T) * a->dvp * ATT_BC) : NULL;                    \
    T *s = aligned_zeros(sizeof(T) * br * ATT_BC);                                        \
    T *o = aligned_zeros(sizeof(T) * br * a->dvp);                                        \
    T *z = aligned_zeros(sizeof(T) * ATT_BC);                                             \
    if ((packs && (!kt || !vp)) || !s || !o || !z) {                                      \
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);                                \
    } else {                                                                              \
        for (;;) {                                                                        \
            const int64_t unit = __atomic_fetch_add(&a->next, 1, __ATOMIC_RELAXED);       \
            if (unit >= a->units) break;                                                  \
            forward_unit_##S(a, kt, vp, s, o, z, unit);                                   \
        }                                                                                 \
    }                                                                                     \
    free(kt); free(vp); free(s); free(o); free(z);                                        \
    return NULL;                                                                          \
}

/* exp(row[c] - top) in place for the ATT_BC values of a row, their sum returned. */
static inline float exp_row_f32(float *row, float top)
{
    vf sum = {0};
    for (int64_t c = 0; c < ATT_BC; c += 8) {
        vf e = exp_vf(*(vfu *)(row + c) - top);
        *(vfu *)(row + c) = e;
        sum += e;
    }
    float total = 0;
    for (int i = 0; i < 8; i++) total += sum[i];
    return total;
}

static inline double exp_row_f64(double *row, double top)
{
    double total = 0;
    for (int64_t c = 0; c < ATT_BC; c++) {
        const double e = exp(row[c] - top);
        row[c] = e;
        total += e;
    }
    return total;
}

DEFINE_KERNELS(float, f32, va, vau, ATT_VBYTES / 4, vai)
DEFINE_KERNELS(double, f64, vd, vdu, ATT_VBYTES / 8, vl)
DEFINE_WRITE_DQ(float, f32)
DEFINE_WRITE_DQ(double, f64)
DEFINE_BACKWARD_KERNELS(float, f32, va, vau, ATT_VBYTES / 4, vai)
DEFINE_BACKWARD_KERNELS(double, f64, vd, vdu, ATT_VBYTES / 8, vl)

static void setup(att_t *a, int f64, const int64_t *dims, const int64_t *strides, int mask_kind,
                  int causal, int64_t offset, double scale, double p, uint64_t seed64,
                  uint32_t stream)
{
    memset(a, 0, sizeof(*a));
    a->f64 = f64;
    a->n = dims[0]; a->h = dims[1]; a->tq = dims[2]; a->tk = dims[3]; a->hd = dims[4];
    a->vd = dims[5];
    const int64_t vw2 = 2 * ATT_VBYTES / (f64 ? 8 : 4);  /* two vectors */
    a->dp = round_up(a->hd, vw2);
    a->dvp = round_up(a->vd, vw2);
    a->nh = a->n * a->h;
    a->qblocks = (a->tq + ATT_BR - 1) / ATT_BR;
    a->kblocks = (a->tk + ATT_BC - 1) / ATT_BC;
    a->st = strides;
    a->mask_kind = mask_kind;
    a->causal = causal;
    a->offset = offset;
    a->scale = scale;
    a->p = p;
    a->factor = p > 0 ? 1.0 / (1.0 - p) : 1.0;
    a->threshold = (uint32_t)ceil(p * 16777216.0);  /* (w >> 8) / 2^24 >= p, exactly */
    a->seed64 = seed64;
    a->stream = stream;
}

/* out (and lse, when not NULL) of the attention; dims: n, h, tq, tk, d, dv (each > 0);
 * strides: see S_*; mask_kind 0 none, 1 bool bytes, 2 the dtype's floats; p > 0:
 * dropout. Returns 0, or 1 when scratch memory could not be had. */
int attention_forward(int f64, const void *q, const void *k, const void *v, const void *mask,
                      int mask_kind, void *out, void *lse, const int64_t *dims,
                      const int64_t *strides, int causal, int64_t offset, double scale,
                      double p, uint64_t seed64, uint32_t stream, int threads)
{
    att_t a;
    setup(&a, f64, dims, strides, mask_kind, causal, offset, scale, p, seed64, stream);
    a.q = q; a.k = k; a.v = v; a.mask = mask; a.out = out; a.lse = lse;
    a.units = a.nh * a.qblocks;
    att_job_t jobs[POOL_MAX_THREADS];
    int64_t parts = pool_parts(threads, a.units);
    for (int64_t t = 0; t < parts; t++) {
        jobs[t].a = &a;
        jobs[t].index = t;
        jobs[t].dq_sum = NULL;
    }
    pool_run(f64 ? forward_job_f64 : forward_job_f32, jobs, sizeof(att_job_t), parts);
    return a.failed;
}

/* dq, dk, dv (each may be NULL: not computed) and ds (NULL, or the full (n, h, tq, tk)
 * gradient of the scores, for a float mask's), from o, lse and dout; the rest as
 * attention_forward's. Returns 0, or 1 when scratch memory could not be had. */
int attention_backward(int f64, const void *q, const void *k, const void *v, const void *mask,
                       int mask_kind, const void *o, const void *lse, const void *dout,
                       void *dq, void *dk, void *dv, void *ds, const int64_t *dims,
                       const int64_t *strides, int causal, int64_t offset, double scale,
                       double p, uint64_t seed64, uint32_t stream, int threads)
{
    att_t a;
    setup(&a, f64, dims, strides, mask_kind, causal, offset, scale, p, seed64, stream);
    a.q = q; a.k = k; a.v = v; a.mask = mask; a.o = o; a.lse_in = lse; a.dout = dout;
    a.dq = dq; a.dk = dk; a.dv = dv; a.ds = ds;
    if (threads < 1) threads = 1;
    if (threads > POOL_MAX_THREADS) threads = POOL_MAX_THREADS;
    a.split = a.nh < 2 * threads && a.kblocks > 1;
    a.units = a.split ? a.nh * a.kblocks : a.nh;
    int64_t parts = pool_parts(threads, a.units);
    att_job_t jobs[POOL_MAX_THREADS];
    const size_t item = f64 ? sizeof(double) : sizeof(float);
    const size_t sum_bytes = item * (size_t)(a.nh * a.tq * a.dp);
    int failed = 0;
    for (int64_t t = 0; t < parts; t++) {
        jobs[t].a = &a;
        jobs[t].index = t;
        jobs[t].dq_sum = NULL;
        if (a.split && dq) {
            jobs[t].dq_sum = aligned_zeros(sum_bytes);
            failed |= jobs[t].dq_sum == NULL;
        }
    }
    if (!failed) pool_run(f64 ? backward_job_f64 : backward_job_f32, jobs, sizeof(att_job_t), parts);
    if (!failed && !a.failed && a.split && dq) {      /* the threads' dQ sums, in order */
        for (int64_t hh = 0; hh < a.nh; hh++) {
            const int64_t n = hh / a.h, h = hh % a.h;
            for (int64_t i = 0; i < a.tq; i++) {
                const size_t at = (size_t)((hh * a.tq + i) * a.dp);
                const int64_t off = n * strides[S_DQ] + h * strides[S_DQ + 1] + i * strides[S_DQ + 2];
                if (f64) {
                    double *dst = (double *)dq + off;
                    for (int64_t c = 0; c < a.hd; c++) {
                        double total = 0;
                        for (int64_t t = 0; t < parts; t++) total += ((double *)jobs[t].dq_sum)[at + c];
                        dst[c] = total;
                    }
                } else {
                    float *dst = (float *)dq + off;
                    for (int64_t c = 0; c < a.hd; c++) {
                        float total = 0;
                        for (int64_t t = 0; t < parts; t++) total += ((float *)jobs[t].dq_sum)[at + c];
                        dst[c] = total;
                    }
                }
            }
        }
    }
    for (int64_t t = 0; t < parts; t++) free(jobs[t].dq_sum);
    return failed | a.failed;
}

/* attention_forward with its arguments in two arrays (one foreign call converts two
 * pointers, not seventeen values: a cached pass's attention is a few microseconds of
 * work). ints: f64, q, k, v, mask, mask_kind, out, lse, causal, offset, seed64,
 * stream, threads, then the 6 dims and the S_COUNT strides; reals: scale, p. */
int attention_forward_packed(const int64_t *ints, const double *reals)
{
    return attention_forward((int)ints[0], (const void *)ints[1], (const void *)ints[2],
                             (const void *)ints[3], (const void *)ints[4], (int)ints[5],
                             (void *)ints[6], (void *)ints[7], ints + 13, ints + 19,
                             (int)ints[8], ints[9], reals[0], reals[1], (uint64_t)ints[10],
                             (uint32_t)ints[11], (int)ints[12]);
}

/* attention_backward likewise. ints: f64, q, k, v, mask, mask_kind, o, lse, dout, dq, dk,
 * dv, ds, causal, offset, seed64, stream, threads, then the 6 dims and the S_COUNT
 * strides; reals: scale, p. */
int attention_backward_packed(const int64_t *ints, const double *reals)
{
    return attention_backward((int)ints[0], (const void *)ints[1], (const void *)ints[2],
                              (const void *)ints[3], (const void *)ints[4], (int)ints[5],
                              (const void *)ints[6], (const void *)ints[7],
                              (const void *)ints[8], (void *)ints[9], (void *)ints[10],
                              (void *)ints[11], (void *)ints[12], ints + 18, ints + 24,
                              (int)ints[13], ints[14], reals[0], reals[1],
                              (uint64_t)ints[15], (uint32_t)ints[16], (int)ints[17]);
}
