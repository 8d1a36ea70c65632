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

#include "attention_forward.h"

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
