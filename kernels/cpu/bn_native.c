/* The native CPU kernels of batch_norm and sync_batch_norm (float32 and float64,
 * C-contiguous arrays). Built and loaded by native.py, launched by bn_native.py
 * (the contract is there).
 *
 * x is viewed as (R, C, I): R rows, C channels, I values of a channel in a row
 * (NCHW: I = H * W; NHWC and (N, C): I = 1). Every per-channel quantity reduces
 * over R and I and is returned in double.
 *
 * Statistics: sums of d = x - shift and d^2, the shift being the mean of the
 * channel's first SHIFT_VALUES values rounded to T, so that M2 = S2 - S1^2 / n
 * keeps its digits on offset data. Gradient sums: of dy and dy (x - m), m the
 * mean rounded to T, corrected exactly for the rounding. Sums are taken in
 * vectors of T over at most about BLOCK values, then added in double.
 * Outputs (y, dx) use x - m, m the mean rounded to T, with the rounding folded
 * into their constants: y = (x - m) kx + kc, dx = dy kd + (x - m) kx + kc.
 * batch_norm_relu: `relu` clamps y to max(y, 0) as the relu op does (NaN passes,
 * -0 gives +0); `mask` (its forward output y) makes every gradient pass use dy only
 * where y > 0, as relu's gradient does (dy's bits ANDed with a mask of ones or zeros).
 *
 * Threads: with I > 1 each thread takes a range of whole channels and, per
 * channel, does its sums and then (fused passes) its outputs while the channel
 * is still in cache; results do not depend on the thread count. With I = 1 a
 * channel's values are strided, so each thread takes a range of rows and keeps
 * per-channel partial sums, which are added in thread order; a second pass
 * writes the outputs. Results then depend on the thread count only through the
 * rounding of that addition. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_pool.h"

#define MAX_THREADS 64
#define BLOCK 1024          /* values summed in vectors of T before the sums go to double */
#define SHIFT_VALUES 16     /* values of a channel whose mean is the shift of its sums */
#define FLUSH_ROWS 32       /* rows (I = 1) summed in T before the sums go to double */
#define MAX_TILE 16         /* channels (I > 1) taken together, row by row */
#define SEGMENT_BYTES 2048  /* a tile's values in a row: at least this where TILE_BYTES allows */
#define TILE_BYTES (256 << 10)  /* a tile's values (of x, and dy): at most this */
#define AHEAD_BYTES 2048    /* prefetch the tile's row this many bytes of it ahead */
#define REACH_BYTES 1024    /* bytes of a tile's row prefetched (the hardware does the rest) */

typedef struct bn bn_t;

/* The type-specific passes: part p's channels (I > 1) or rows (I = 1). */
typedef struct {
    void (*channels)(bn_t *, int64_t p);
    void (*row_sums)(bn_t *, int64_t p);
    void (*row_apply)(bn_t *, int64_t p);
    void (*row_shifts)(bn_t *);
    void (*row_consts)(bn_t *);
    size_t size;
} kind_t;

struct bn {
    const kind_t *k;
    const void *x, *dy;
    void *out;                      /* y or dx; may be dy */
    int64_t R, C, I, parts;
    int sums;                       /* a pass of sums (then outputs when fused), else an apply */
    int grad;                       /* sums of dy and dy (x - m), else of d and d^2 */
    int fused;                      /* the sums' pass goes on to write out */
    int mode;                       /* out = 0: (x - m) kx + kc; 1: dy kd + (x - m) kx + kc;
                                       2: dy kd */
    int relu;                       /* mode 0: out = max(out, 0) */
    const void *mask;               /* grad passes: dy counts where mask (y) > 0; or NULL */
    double n, eps;
    const double *mean, *kd, *kx, *kc;   /* per channel (apply); mean: the grad's */
    const double *scale, *bias, *invstd; /* per channel (fused passes) */
    double *s1, *s2;                /* per channel: (mean, M2) or (sum dy, sum dy (x - mean)) */
    double *partial;                /* I = 1: per part 2 C sums */
    void *work;                     /* I = 1: per part 2 C sums in T */
    void *consts;                   /* I = 1: per channel m (or shift), kd, kx, kc in T */
};

/* ---- per channel: statistics, gradient sums and their outputs' constants ---------- */

/* Channels per tile (I > 1): a tile's row is a contiguous run of values, long enough
 * for the prefetchers where its values (and dy's) still fit in cache. */
static int64_t tile_channels(const bn_t *a)
{
    int64_t value = (int64_t)a->k->size, run = a->I * value;
    int64_t channel = a->R * run * (a->sums && a->grad ? 2 : 1);
    int64_t want = (SEGMENT_BYTES + run - 1) / run, fit = TILE_BYTES / (channel ? channel : 1);
    int64_t ct = want < fit ? want : fit;
    return ct < 1 ? 1 : ct > MAX_TILE ? MAX_TILE : ct;
}

/* Rows ahead to prefetch, and the bytes of such a row's tile, for tile rows of `bytes`. */
static void prefetch_plan(const bn_t *a, int64_t bytes, int64_t *ahead, int64_t *reach)
{
    (void)a;
    *ahead = (AHEAD_BYTES + bytes - 1) / bytes;
    *reach = bytes < REACH_BYTES ? bytes : REACH_BYTES;
}

/* (mean, M2) of channel c from its sums about `shift`; when fused, the constants of
 * y = (x - m) kx + kc. */
static void finish_stats(bn_t *a, int64_t c, double shift, double s1, double s2,
                         double rnd(double), double *m, double *kx, double *kc)
{
    double mean = shift + s1 / a->n, m2 = s2 - s1 * (s1 / a->n);
    if (m2 < 0) m2 = 0;                             /* NaN stays NaN */
    a->s1[c] = mean;
    a->s2[c] = m2;
    if (!a->fused) return;
    double invstd = 1.0 / sqrt(m2 / a->n + a->eps), k = invstd * a->scale[c];
    *m = rnd(mean);
    *kx = k;
    *kc = a->bias[c] - (mean - *m) * k;
}

/* (sum dy, sum dy (x - mean)) of channel c from the sums about m = mean rounded; when
 * fused, the constants of dx = dy kd + (x - m) kx + kc. */
static void finish_grad(bn_t *a, int64_t c, double m, double s1, double s2,
                        double *kd, double *kx, double *kc)
{
    double mean = a->mean[c], s_dyx = s2 - s1 * (mean - m);
    a->s1[c] = s1;
    a->s2[c] = s_dyx;
    if (!a->fused) return;
    double inv = a->invstd[c], sc = a->scale[c];
    *kd = sc * inv;
    *kx = -sc * inv * inv * inv * s_dyx / a->n;
    *kc = -sc * inv * s1 / a->n - *kx * (mean - m);
}

/* The constants of an unfused apply (normalize, input_grad) for channel c. */
static void apply_consts(const bn_t *a, int64_t c, double rnd(double),
                         double *m, double *kd, double *kx, double *kc)
{
    double mean = a->mean ? a->mean[c] : 0;
    *m = a->mode == 2 ? 0 : rnd(mean);
    *kd = a->mode == 0 ? 0 : a->kd[c];
    *kx = a->mode == 2 ? 0 : a->kx[c];
    *kc = a->mode == 2 ? 0 : a->kc[c] - *kx * (mean - *m);
}

/* The passes of one element type, as the macro BN_KIND. */
#include "bn_kind.h"

typedef float vf __attribute__((vector_size(32)));
typedef float vfu __attribute__((vector_size(32), aligned(4)));
typedef int32_t vfi __attribute__((vector_size(32)));
typedef double vd __attribute__((vector_size(32)));
typedef double vdu __attribute__((vector_size(32), aligned(8)));
typedef int64_t vdi __attribute__((vector_size(32)));

BN_KIND(float, f32, vf, vfu, vfi)
BN_KIND(double, f64, vd, vdu, vdi)

/* ---- threads (native_pool.h) ---------------------------------------------------------- */

typedef struct {
    bn_t *a;
    int64_t part;
    void (*fn)(bn_t *, int64_t);
} job_t;

static void *run_job(void *p)
{
    job_t *job = p;
    job->fn(job->a, job->part);
    return NULL;
}

/* fn(a, p) for every part p, on a->parts threads (this one runs part 0). */
static void run_parts(bn_t *a, void (*fn)(bn_t *, int64_t))
{
    job_t jobs[MAX_THREADS];
    for (int64_t t = 0; t < a->parts; t++) jobs[t] = (job_t){a, t, fn};
    pool_run(run_job, jobs, sizeof(job_t), a->parts);
}

/* ---- the passes --------------------------------------------------------------------------- */

/* The pass `a` describes over the whole array. 0, or 1 when memory ran out. */
static int run(bn_t *a, int64_t threads)
{
    int64_t limit = a->I > 1 ? a->C : a->R;
    if (a->R <= 0 || a->C <= 0 || a->I <= 0) return 0;
    threads = threads > MAX_THREADS ? MAX_THREADS : threads < 1 ? 1 : threads;
    a->parts = threads < limit ? threads : limit;
    a->n = (double)a->R * (double)a->I;
    if (a->I > 1) {
        run_parts(a, a->k->channels);
        return 0;
    }
    size_t t = a->k->size, C = (size_t)a->C, parts = (size_t)a->parts;
    a->consts = malloc(4 * C * t);
    a->partial = a->sums ? malloc(2 * C * parts * sizeof(double)) : NULL;
    a->work = a->sums ? malloc(2 * C * parts * t) : NULL;
    if (!a->consts || (a->sums && (!a->partial || !a->work))) {
        free(a->consts);
        free(a->partial);
        free(a->work);
        return 1;
    }
    if (a->sums) {
        a->k->row_shifts(a);
        run_parts(a, a->k->row_sums);
    }
    a->k->row_consts(a);
    if (!a->sums || a->fused) run_parts(a, a->k->row_apply);
    free(a->consts);
    free(a->partial);
    free(a->work);
    return 0;
}

/* ---- entry points --------------------------------------------------------------------------- */

/* Per channel of x (R, C, I): mean and M2 = sum (x - mean)^2 into mean, m2 (C,
 * double). When y is not NULL, also y = (x - mean) / sqrt(M2 / n + eps) * scale +
 * bias (scale, bias: C doubles), then max(y, 0) when relu. Returns 0, or 1 when
 * memory ran out. */
#define STATS(T, S)                                                                            \
int bn_stats_##S(const T *x, T *y, int64_t R, int64_t C, int64_t I, const double *scale,       \
                 const double *bias, double eps, double *mean, double *m2, int64_t threads,    \
                 int relu)                                                                     \
{                                                                                              \
    bn_t a = {.k = &kind_##S, .x = x, .out = y, .R = R, .C = C, .I = I, .sums = 1,             \
              .fused = y != NULL, .mode = 0, .relu = relu, .eps = eps, .scale = scale,         \
              .bias = bias, .s1 = mean, .s2 = m2};                                             \
    return run(&a, threads);                                                                   \
}

/* Per channel of x, dy (R, C, I) with its mean (C, double): sum dy and sum dy (x - mean)
 * into s_dy, s_dyx (C, double). When dx is not NULL (it may be dy), also dx = k_dy dy +
 * k_x (x - mean) + k_c with k_dy = scale invstd, k_x = -scale invstd^3 s_dyx / n, k_c =
 * -scale invstd s_dy / n, n = R I. With mask (batch_norm_relu's y), dy counts only
 * where mask > 0. Returns 0, or 1 when memory ran out. */
#define GRAD(T, S)                                                                             \
int bn_grad_##S(const T *x, const T *dy, T *dx, int64_t R, int64_t C, int64_t I,               \
                const double *mean, const double *invstd, const double *scale, double *s_dy,   \
                double *s_dyx, int64_t threads, const T *mask)                                 \
{                                                                                              \
    bn_t a = {.k = &kind_##S, .x = x, .dy = dy, .out = dx, .R = R, .C = C, .I = I,             \
              .sums = 1, .grad = 1, .fused = dx != NULL, .mode = 1, .mask = mask,              \
              .mean = mean, .invstd = invstd, .scale = scale, .s1 = s_dy, .s2 = s_dyx};        \
    return run(&a, threads);                                                                   \
}

/* out (R, C, I) per channel: (x - mean) k_x + k_c when dy is NULL (then max(out, 0)
 * when relu), else k_dy dy + (x - mean) k_x + k_c, or k_dy dy when k_x is NULL (then x
 * and mean are not read), dy counting only where mask > 0 when mask is not NULL; out
 * may be dy. Returns 0, or 1 when memory ran out. */
#define APPLY(T, S)                                                                            \
int bn_apply_##S(const T *x, const T *dy, T *out, int64_t R, int64_t C, int64_t I,             \
                 const double *mean, const double *k_dy, const double *k_x,                    \
                 const double *k_c, int64_t threads, int relu, const T *mask)                  \
{                                                                                              \
    bn_t a = {.k = &kind_##S, .x = x, .dy = dy, .out = out, .R = R, .C = C, .I = I,            \
              .mode = !dy ? 0 : k_x ? 1 : 2, .relu = relu, .mask = dy ? mask : NULL,           \
              .mean = mean, .kd = k_dy, .kx = k_x, .kc = k_c};                                 \
    return run(&a, threads);                                                                   \
}

STATS(float, f32)
STATS(double, f64)
GRAD(float, f32)
GRAD(double, f64)
APPLY(float, f32)
APPLY(double, f64)
