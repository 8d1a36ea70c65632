/* The native CPU kernels of layer_norm, group_norm and instance_norm (float32 and
 * float64, C-contiguous arrays). Built and loaded by native.py, launched by
 * norm_native.py (the contract is there).
 *
 * x is viewed as `rows` rows of `len` values, each row normalised on its own
 * statistics. Value e of the flat array takes the affine scale[a], bias[a] with
 * a = (e / post) % A (layer_norm: post 1, A = len; group_norm: post the spatial
 * size, A = C). A run is a stretch of a row where a is constant (post > 1) or
 * steps by one (post 1).
 *
 * Statistics: sums of d = x - shift and d^2, the shift being the mean of the
 * row's first 16 float32 or 8 float64 values rounded to T, so that M2 = S2 - S1^2 / n
 * keeps its digits on offset data. Sums are taken in vectors of T over at most
 * BLOCK values, then added in double. The outputs use x - m with m the mean
 * rounded to T (exact for values near the mean), and fold the rounding of m
 * into their constants.
 *
 * Backward, with g = dy * scale[a]: per row S_g = sum g and S_gx = sum g (x -
 * mean), then dx = invstd scale[a] dy + k_x (x - mean) + k_c; per affine index
 * the sums of dy (x - mean) invstd (dscale) and dy (dbias), in double.
 *
 * Threads: with enough rows each thread takes a range of whole rows and does
 * each row's sums and outputs at once, while the row is in cache. Otherwise
 * the flat array is split evenly: rows cut between threads leave partial sums
 * that are added in thread order, then a second pass writes the outputs. The
 * per-affine-index sums are kept per thread and added in thread order. Results
 * depend on the thread count only through the rounding of those sums. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_pool.h"

#define MAX_THREADS 64
#define BLOCK 1024          /* values summed in vectors of T before the sums go to double */
#define TILE 2048           /* values per tile of a run whose sums go to per-index arrays */
#define SHORT_ROW 1024      /* rows of at most this many values are normalised in groups */
#define GROUP 4
#define ACC_BYTES (64 << 20) /* the threads' per-index sums: fewer threads where more need more */

typedef struct norm norm_t;

/* The type-specific kernels; lo..hi are positions in row r. */
typedef struct {
    double (*stats)(const norm_t *, int64_t r, int64_t lo, int64_t hi, double out[2]);
    double (*shift)(const norm_t *, int64_t r);
    double (*round)(double);
    void (*apply)(const norm_t *, int64_t r, int64_t lo, int64_t hi);
    void (*grad)(const norm_t *, int64_t r, int64_t lo, int64_t hi, double *acc, double out[2]);
    void (*dx)(const norm_t *, int64_t r, int64_t lo, int64_t hi);
    void (*store_stats)(const norm_t *, int64_t r, double mean, double var);
    void (*load_stats)(const norm_t *, int64_t r, double *mean, double *var);
    void (*store)(void *to, const double *from, int64_t n);
} kind_t;

typedef struct {
    int64_t row;
    double s[2];
} edge_t;

struct norm {
    const kind_t *k;
    const void *x, *dy, *scale, *bias, *mean_in, *var_in;
    void *y, *dx, *mean_out, *var_out, *dscale, *dbias;
    int64_t rows, len, post, A, parts;
    int whole;                     /* each part takes whole rows (else a flat range) */
    double eps;
    double *sums;                  /* per row: its two sums */
    double *mean, *cen, *invstd, *kx, *kc;  /* per row; cen: the mean rounded to T */
    double *acc;                   /* per part: A dscale sums, then A dbias sums */
    edge_t edge[MAX_THREADS][2];   /* per part: the sums of rows it holds only part of */
    int edges[MAX_THREADS];
};

/* The run of row r that starts at position i and ends before hi: its end, and
 * its (first) affine index in *idx. */
static inline int64_t run_end(const norm_t *a, int64_t r, int64_t i, int64_t hi, int64_t *idx)
{
    int64_t f = r * a->len + i, end;
    *idx = (f / a->post) % a->A;
    end = a->post == 1 ? i + (a->A - *idx) : i + (a->post - f % a->post);
    return end < hi ? end : hi;
}

/* The per-row work of one element type, as the macro NORM_KIND. */
#include "norm_kind.h"

typedef float vf __attribute__((vector_size(32)));
typedef float vfu __attribute__((vector_size(32), aligned(4)));
typedef double vd __attribute__((vector_size(32)));
typedef double vdu __attribute__((vector_size(32), aligned(8)));

NORM_KIND(float, f32, vf, vfu)
NORM_KIND(double, f64, vd, vdu)

/* ---- threads (native_pool.h) ---------------------------------------------------------- */

typedef struct {
    norm_t *a;
    int64_t part;
    void (*fn)(norm_t *, int64_t);
} job_t;

static void *run_job(void *p)
{
    job_t *job = p;
    job->fn(job->a, job->part);
    return NULL;
}

/* fn(a, p) for every part p, on a->parts threads (this one runs part 0). */
static void run_parts(norm_t *a, void (*fn)(norm_t *, int64_t))
{
    job_t jobs[MAX_THREADS];
    for (int64_t t = 0; t < a->parts; t++) jobs[t] = (job_t){a, t, fn};
    pool_run(run_job, jobs, sizeof(job_t), a->parts);
}

/* ---- the passes --------------------------------------------------------------------------- */

static void finish_stats(norm_t *a, int64_t r, double shift)
{
    double per = 1.0 / (double)a->len, s1 = a->sums[2 * r], s2 = a->sums[2 * r + 1];
    double mean = shift + s1 * per, var = (s2 - s1 * (s1 * per)) * per;
    if (var < 0) var = 0;
    a->mean[r] = mean;
    a->cen[r] = a->k->round(mean);
    a->invstd[r] = 1.0 / sqrt(var + a->eps);
    a->k->store_stats(a, r, mean, var);
}

/* finish_stats of a row whose sums were added up from parts. */
static void finish_shared_stats(norm_t *a, int64_t r) { finish_stats(a, r, a->k->shift(a, r)); }

static void finish_grad(norm_t *a, int64_t r)
{
    double per = 1.0 / (double)a->len, inv = a->invstd[r], delta = a->mean[r] - a->cen[r];
    double s_g = a->sums[2 * r], s_gx = a->sums[2 * r + 1] - delta * s_g;
    double kx = -inv * inv * inv * s_gx * per;
    a->kx[r] = kx;
    a->kc[r] = -inv * s_g * per - kx * delta;      /* dx uses x - cen, not x - mean */
}

static int64_t first_row(const norm_t *a, int64_t p) { return p * a->rows / a->parts; }
static int64_t first_value(const norm_t *a, int64_t p)
{
    return p * (a->rows * a->len) / a->parts;
}

/* Short rows go in groups: their statistics (whose last steps wait on divisions) side
 * by side, then their outputs, the group still in L1. */
static void forward_rows(norm_t *a, int64_t p)
{
    int64_t last = first_row(a, p + 1), group = a->len <= SHORT_ROW ? GROUP : 1;
    for (int64_t r0 = first_row(a, p); r0 < last; r0 += group) {
        int64_t r1 = r0 + group < last ? r0 + group : last;
        double shift[GROUP];
        for (int64_t r = r0; r < r1; r++)
            shift[r - r0] = a->k->stats(a, r, 0, a->len, a->sums + 2 * r);
        for (int64_t r = r0; r < r1; r++) finish_stats(a, r, shift[r - r0]);
        for (int64_t r = r0; r < r1 && a->y; r++) a->k->apply(a, r, 0, a->len);
    }
}

static void backward_rows(norm_t *a, int64_t p)
{
    double *acc = a->acc ? a->acc + 2 * a->A * p : NULL;
    for (int64_t r = first_row(a, p); r < first_row(a, p + 1); r++) {
        a->k->grad(a, r, 0, a->len, acc, a->sums + 2 * r);
        if (!a->dx) continue;
        finish_grad(a, r);
        a->k->dx(a, r, 0, a->len);
    }
}

/* Part p of the flat split: the sums of every row it covers (whole rows finished
 * here, parts of rows kept in its edges); `grad` picks the backward's sums. */
static void sums_flat(norm_t *a, int64_t p, int grad)
{
    int64_t e0 = first_value(a, p), e1 = first_value(a, p + 1), len = a->len;
    double *acc = a->acc ? a->acc + 2 * a->A * p : NULL;
    a->edges[p] = 0;
    for (int64_t r = e0 / len; r * len < e1; r++) {
        int64_t lo = e0 > r * len ? e0 - r * len : 0, hi = e1 < (r + 1) * len ? e1 - r * len : len;
        int whole = lo == 0 && hi == len;
        double *out = whole ? a->sums + 2 * r : a->edge[p][a->edges[p]].s;
        if (!whole) a->edge[p][a->edges[p]++].row = r;
        if (grad) {
            a->k->grad(a, r, lo, hi, acc, out);
            if (whole && a->dx) finish_grad(a, r);
        } else {
            double shift = a->k->stats(a, r, lo, hi, out);
            if (whole) finish_stats(a, r, shift);
        }
    }
}

static void stats_flat(norm_t *a, int64_t p) { sums_flat(a, p, 0); }
static void grad_flat(norm_t *a, int64_t p) { sums_flat(a, p, 1); }

/* The rows the parts share: their sums added in part order, then finished. */
static void merge_edges(norm_t *a, void (*finish)(norm_t *, int64_t))
{
    int64_t row = -1;
    for (int64_t p = 0; p < a->parts; p++)
        for (int e = 0; e < a->edges[p]; e++) {
            edge_t *edge = &a->edge[p][e];
            if (edge->row != row) {
                if (row >= 0 && finish) finish(a, row);
                row = edge->row;
                a->sums[2 * row] = a->sums[2 * row + 1] = 0;
            }
            a->sums[2 * row] += edge->s[0];
            a->sums[2 * row + 1] += edge->s[1];
        }
    if (row >= 0 && finish) finish(a, row);
}

static void outputs_flat(norm_t *a, int64_t p)
{
    int64_t e0 = first_value(a, p), e1 = first_value(a, p + 1), len = a->len;
    for (int64_t r = e0 / len; r * len < e1; r++) {
        int64_t lo = e0 > r * len ? e0 - r * len : 0, hi = e1 < (r + 1) * len ? e1 - r * len : len;
        if (a->y) a->k->apply(a, r, lo, hi);
        else a->k->dx(a, r, lo, hi);
    }
}

/* The parts and whether each takes whole rows; the per-row arrays. 0, or 1 when
 * memory ran out. */
static int setup(norm_t *a, int64_t threads, int per_index)
{
    int64_t values = a->rows * a->len, rows = a->rows;
    threads = threads > MAX_THREADS ? MAX_THREADS : threads < 1 ? 1 : threads;
    if (threads > values) threads = values;
    if (per_index && threads > 1 && threads * 2 * a->A * (int64_t)sizeof(double) > ACC_BYTES) {
        int64_t fit = ACC_BYTES / (2 * a->A * (int64_t)sizeof(double));
        threads = fit > 1 ? fit : 1;
    }
    a->parts = threads;
    a->whole = rows % threads == 0 || rows >= 4 * threads;
    a->sums = malloc(7 * rows * sizeof(double));
    a->acc = per_index ? calloc(2 * a->A * threads, sizeof(double)) : NULL;
    if (!a->sums || (per_index && !a->acc)) {
        free(a->sums);
        free(a->acc);
        return 1;
    }
    a->mean = a->sums + 2 * rows;
    a->cen = a->mean + rows;
    a->invstd = a->cen + rows;
    a->kx = a->invstd + rows;
    a->kc = a->kx + rows;
    return 0;
}

static int forward(norm_t *a, int64_t threads)
{
    if (a->rows <= 0 || a->len <= 0) return 0;
    if (setup(a, threads, 0)) return 1;
    if (a->whole) {
        run_parts(a, forward_rows);
    } else {
        run_parts(a, stats_flat);
        merge_edges(a, finish_shared_stats);
        if (a->y) run_parts(a, outputs_flat);
    }
    free(a->sums);
    return 0;
}

static int backward(norm_t *a, int64_t threads)
{
    if (a->rows <= 0 || a->len <= 0) return 0;
    if (setup(a, threads, a->dscale || a->dbias)) return 1;
    for (int64_t r = 0; r < a->rows; r++) {
        double var;
        a->k->load_stats(a, r, &a->mean[r], &var);
        a->cen[r] = a->k->round(a->mean[r]);
        a->invstd[r] = 1.0 / sqrt(var + a->eps);
    }
    if (a->whole) {
        run_parts(a, backward_rows);
    } else {
        run_parts(a, grad_flat);
        merge_edges(a, a->dx ? finish_grad : NULL);
        if (a->dx) run_parts(a, outputs_flat);
    }
    if (a->acc) {
        /* locals: through a->acc, a store may alias a's own fields (-fno-strict-aliasing),
         * which kept this loop scalar */
        double *acc = a->acc;
        const int64_t n = 2 * a->A, parts = a->parts;
        for (int64_t p = 1; p < parts; p++) {
            const double *part = acc + n * p;
            for (int64_t i = 0; i < n; i++) acc[i] += part[i];
        }
        if (a->dscale) a->k->store(a->dscale, a->acc, a->A);
        if (a->dbias) a->k->store(a->dbias, a->acc + a->A, a->A);
    }
    free(a->sums);
    free(a->acc);
    return 0;
}

/* ---- entry points --------------------------------------------------------------------------- */

/* Per row of x (rows, len): mean and biased variance into mean, var (rows,); when y
 * is not NULL, y = (x - mean) / sqrt(var + eps) * scale[a] + bias[a] (scale, bias
 * NULL: 1, 0). Returns 0, or 1 when memory ran out. */
#define FORWARD(T, S)                                                                          \
int norm_forward_##S(const T *x, T *y, const T *scale, const T *bias, T *mean, T *var,         \
                     int64_t rows, int64_t len, int64_t post, int64_t A, double eps,           \
                     int64_t threads)                                                          \
{                                                                                              \
    norm_t a = {.k = &kind_##S, .x = x, .y = y, .scale = scale, .bias = bias,                  \
                .mean_out = mean, .var_out = var, .rows = rows, .len = len, .post = post,      \
                .A = A, .eps = eps};                                                           \
    return forward(&a, threads);                                                               \
}                                                                                              \
                                                                                               \
/* norm_forward_##S with its arguments in two arrays (a prepared call's: one foreign call      \
 * converts two pointers, not twelve values, for a token's row). ints: x, y, scale, bias,      \
 * mean, var (as integers), rows, len, post, A, threads; reals: eps. */                      \
int norm_forward_packed_##S(const int64_t *ints, const double *reals)                          \
{                                                                                              \
    return norm_forward_##S((const T *)ints[0], (T *)ints[1], (const T *)ints[2],              \
                            (const T *)ints[3], (T *)ints[4], (T *)ints[5], ints[6], ints[7],  \
                            ints[8], ints[9], reals[0], ints[10]);                             \
}

/* From x, dy (rows, len) and the saved mean, var (rows,): dx, and dscale, dbias (A,)
 * summed over every value of each affine index; each output NULL when not wanted.
 * Returns 0, or 1 when memory ran out. */
#define BACKWARD(T, S)                                                                         \
int norm_backward_##S(const T *x, const T *dy, const T *mean, const T *var, const T *scale,    \
                      T *dx, T *dscale, T *dbias, int64_t rows, int64_t len, int64_t post,     \
                      int64_t A, double eps, int64_t threads)                                  \
{                                                                                              \
    norm_t a = {.k = &kind_##S, .x = x, .dy = dy, .mean_in = mean, .var_in = var,              \
                .scale = scale, .dx = dx, .dscale = dscale, .dbias = dbias, .rows = rows,      \
                .len = len, .post = post, .A = A, .eps = eps};                                 \
    return backward(&a, threads);                                                              \
}

FORWARD(float, f32)
FORWARD(double, f64)
BACKWARD(float, f32)
BACKWARD(double, f64)
