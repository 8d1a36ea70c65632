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

#define BN_KIND(T, S, V, VU, VI)                                                               \
static inline V load_##S(const T *p) { return *(const VU *)p; }                              \
static inline void store_##S(T *p, V v) { *(VU *)p = v; }                                    \
static double round_##S(double v) { return (T)v; }                                            \
/* relu's gradient: g where y > 0, else +0 (the bits of g ANDed with a mask) */             \
static inline V keep_##S(V g, V y) { V z = {0}; return (V)((VI)g & (VI)(y > z)); }            \
static inline T keep1_##S(T g, T y) { return y > 0 ? g : (T)0; }                              \
/* relu: v where v > 0 or v is NaN, else +0 */                                                \
static inline V relu_##S(V v) { V z = {0}; return (V)((VI)v & (VI)((v > z) | (v != v))); }   \
static inline T relu1_##S(T v) { return v > 0 || v != v ? v : (T)0; }                         \
                                                                                               \
/* A channel's sums: vectors of T (p, q; t1, t2 the tails) over at most about BLOCK  \
 * values, then in double (s1, s2). */                                                       \
typedef struct { V p, q; T t1, t2; int64_t count; double s1, s2; } acc_##S;                   \
                                                                                               \
static inline __attribute__((always_inline)) void flush_##S(acc_##S *A)                       \
{                                                                                              \
    const int64_t w = sizeof(V) / sizeof(T);                                                   \
    V p = A->p, q = A->q, z = {0};                                                             \
    for (int64_t h = w / 2; h >= 1; h /= 2)                                                    \
        for (int64_t l = 0; l < h; l++) p[l] += p[l + h], q[l] += q[l + h];                    \
    A->s1 += (double)p[0] + A->t1;                                                             \
    A->s2 += (double)q[0] + A->t2;                                                             \
    A->p = A->q = z;                                                                           \
    A->t1 = A->t2 = 0;                                                                         \
    A->count = 0;                                                                              \
}                                                                                              \
                                                                                               \
/* grad 0: sums of d = x - c and d^2; 1: of g and g d; 2: as 1 with g masked by y > 0. */    \
static inline __attribute__((always_inline)) void step_##S(                                   \
    const T *x, const T *g, const T *y, T c, int grad, V *s1, V *s2)                           \
{                                                                                              \
    V d = load_##S(x) - c, v = grad ? load_##S(g) : d;                                         \
    if (grad == 2) v = keep_##S(v, load_##S(y));                                               \
    *s1 += v;                                                                                  \
    *s2 += v * d;                                                                              \
}                                                                                              \
                                                                                               \
/* Add n (<= BLOCK) values of a run to A (in four pairs of vectors, then A's pair), going   \
 * to double once A holds BLOCK. */                                                            \
static inline __attribute__((always_inline)) void run_##S(                                    \
    acc_##S *A, const T *x, const T *g, const T *y, int64_t n, T c, int grad)                  \
{                                                                                              \
    const int64_t w = sizeof(V) / sizeof(T), step = 4 * w;                                    \
    V p0 = A->p, p1 = {0}, p2 = {0}, p3 = {0}, q0 = A->q, q1 = {0}, q2 = {0}, q3 = {0};       \
    int64_t i = 0;                                                                             \
    for (; i + step <= n; i += step) {                                                         \
        step_##S(x + i, g + i, y + i, c, grad, &p0, &q0);                                      \
        step_##S(x + i + w, g + i + w, y + i + w, c, grad, &p1, &q1);                          \
        step_##S(x + i + 2 * w, g + i + 2 * w, y + i + 2 * w, c, grad, &p2, &q2);              \
        step_##S(x + i + 3 * w, g + i + 3 * w, y + i + 3 * w, c, grad, &p3, &q3);              \
    }                                                                                          \
    for (; i + w <= n; i += w) step_##S(x + i, g + i, y + i, c, grad, &p1, &q1);               \
    A->p = (p0 + p1) + (p2 + p3);                                                              \
    A->q = (q0 + q1) + (q2 + q3);                                                              \
    for (; i < n; i++) {                                                                       \
        T d = x[i] - c, v = grad ? g[i] : d;                                                   \
        if (grad == 2) v = keep1_##S(v, y[i]);                                                 \
        A->t1 += v;                                                                            \
        A->t2 += v * d;                                                                        \
    }                                                                                          \
    A->count += n;                                                                             \
    if (A->count >= BLOCK) flush_##S(A);                                                       \
}                                                                                              \
                                                                                               \
/* n outputs o = (x - m) kx + kc (mode 0; relu: max(o, 0)), g kd + (x - m) kx + kc (1) or  \
 * g kd (2), g masked by y > 0 when `masked`: the constants per value (step 1: a row of C   \
 * channels) or one for all (step 0). o may be g. */                                          \
static inline __attribute__((always_inline)) void apply_body_##S(                             \
    const T *x, const T *g, const T *y, T *o, int64_t n, int mode, int relu, int masked,       \
    const T *m, const T *kd, const T *kx, const T *kc, int step)                               \
{                                                                                              \
    const int64_t w = sizeof(V) / sizeof(T);                                                   \
    V cm = {0}, cd = {0}, cx = {0}, cc = {0};                                                  \
    if (!step) cm += *m, cd += *kd, cx += *kx, cc += *kc;                                      \
    int64_t i = 0;                                                                             \
    for (; i + w <= n; i += w) {                                                               \
        V tm = step ? load_##S(m + i) : cm, td = step ? load_##S(kd + i) : cd;                 \
        V tx = step ? load_##S(kx + i) : cx, tc = step ? load_##S(kc + i) : cc;                \
        V gv = {0};                                                                            \
        if (mode) gv = masked ? keep_##S(load_##S(g + i), load_##S(y + i)) : load_##S(g + i);  \
        V v = mode == 2 ? gv * td : (load_##S(x + i) - tm) * tx + tc;                          \
        if (mode == 1) v += gv * td;                                                           \
        if (mode == 0 && relu) v = relu_##S(v);                                                \
        store_##S(o + i, v);                                                                   \
    }                                                                                          \
    for (; i < n; i++) {                                                                       \
        int64_t k = step ? i : 0;                                                              \
        T gv = mode ? (masked ? keep1_##S(g[i], y[i]) : g[i]) : (T)0;                          \
        T v = mode == 2 ? gv * kd[k] : (x[i] - m[k]) * kx[k] + kc[k];                          \
        if (mode == 0 && relu) v = relu1_##S(v);                                               \
        o[i] = mode == 1 ? v + gv * kd[k] : v;                                                 \
    }                                                                                          \
}                                                                                              \
                                                                                               \
static inline __attribute__((always_inline)) void apply_run_##S(                              \
    const T *x, const T *g, const T *y, T *o, int64_t n, int mode, int relu, const T *m,       \
    const T *kd, const T *kx, const T *kc, int step)                                           \
{                                                                                              \
    if (mode == 0 && relu) apply_body_##S(x, g, y, o, n, 0, 1, 0, m, kd, kx, kc, step);        \
    else if (mode == 0) apply_body_##S(x, g, y, o, n, 0, 0, 0, m, kd, kx, kc, step);           \
    else if (mode == 1 && y) apply_body_##S(x, g, y, o, n, 1, 0, 1, m, kd, kx, kc, step);      \
    else if (mode == 1) apply_body_##S(x, g, y, o, n, 1, 0, 0, m, kd, kx, kc, step);           \
    else if (y) apply_body_##S(x, g, y, o, n, 2, 0, 1, m, kd, kx, kc, step);                   \
    else apply_body_##S(x, g, y, o, n, 2, 0, 0, m, kd, kx, kc, step);                          \
}                                                                                              \
                                                                                               \
/* out[j]: the sums over channel c0 + j (I > 1) of d = x - m[j] and d^2, or (grad) of g  \
 * and g d, for the tile's ct channels, row by row. */                                       \
static inline __attribute__((always_inline)) void tile_sums_body_##S(                         \
    const bn_t *a, int64_t c0, int64_t ct, const T *m, int grad, double (*out)[2])             \
{                                                                                              \
    const int64_t stride = a->C * a->I, I = a->I, R = a->R;                                    \
    const T *x = (const T *)a->x + c0 * I, *g = grad ? (const T *)a->dy + c0 * I : x;          \
    const T *y = grad == 2 ? (const T *)a->mask + c0 * I : x;                                  \
    int64_t ahead, reach;                                                                      \
    prefetch_plan(a, ct * I * (int64_t)sizeof(T), &ahead, &reach);                             \
    acc_##S A[MAX_TILE];                                                                       \
    memset(A, 0, sizeof A);                                                                    \
    for (int64_t r = 0; r < R; r++, x += stride, g += stride, y += stride) {                   \
        if (r + ahead < R)                                                                     \
            for (int64_t b = 0; b < reach; b += 64) {                                          \
                __builtin_prefetch((const char *)(x + ahead * stride) + b);                    \
                if (grad) __builtin_prefetch((const char *)(g + ahead * stride) + b);          \
                if (grad == 2) __builtin_prefetch((const char *)(y + ahead * stride) + b);     \
            }                                                                                  \
        for (int64_t j = 0; j < ct; j++)                                                       \
            for (int64_t lo = j * I, end = lo + I; lo < end; lo += BLOCK)                      \
                run_##S(&A[j], x + lo, g + lo, y + lo, end - lo < BLOCK ? end - lo : BLOCK,    \
                        m[j], grad);                                                           \
    }                                                                                          \
    for (int64_t j = 0; j < ct; j++) {                                                         \
        flush_##S(&A[j]);                                                                      \
        out[j][0] = A[j].s1;                                                                   \
        out[j][1] = A[j].s2;                                                                   \
    }                                                                                          \
}                                                                                              \
                                                                                               \
/* out = (x - m) kx + kc (mode 0), g kd + (x - m) kx + kc (1) or g kd (2) on the tile's ct   \
 * channels from c0, row by row, with k[0..3][j] = m, kd, kx, kc of channel c0 + j. */        \
static void tile_apply_##S(const bn_t *a, int64_t c0, int64_t ct, T k[4][MAX_TILE])            \
{                                                                                              \
    const int64_t stride = a->C * a->I, I = a->I, R = a->R;                                    \
    const T *x = (const T *)a->x + c0 * I, *g = a->dy ? (const T *)a->dy + c0 * I : NULL;      \
    const T *y = a->mask ? (const T *)a->mask + c0 * I : NULL;                                 \
    T *o = (T *)a->out + c0 * I;                                                               \
    int64_t ahead, reach;                                                                      \
    prefetch_plan(a, ct * I * (int64_t)sizeof(T), &ahead, &reach);                             \
    for (int64_t r = 0; r < R; r++, x += stride, o += stride, g = g ? g + stride : g,          \
         y = y ? y + stride : y) {                                                             \
        if (r + ahead < R)                                                                     \
            for (int64_t b = 0; b < reach; b += 64) {                                          \
                __builtin_prefetch((const char *)(o + ahead * stride) + b, 1);                 \
                if (!a->fused && a->mode != 2)                                                 \
                    __builtin_prefetch((const char *)(x + ahead * stride) + b);                \
                if (g && !a->fused) __builtin_prefetch((const char *)(g + ahead * stride) + b); \
                if (y && !a->fused) __builtin_prefetch((const char *)(y + ahead * stride) + b); \
            }                                                                                  \
        for (int64_t j = 0; j < ct; j++)                                                       \
            apply_run_##S(x + j * I, g ? g + j * I : NULL, y ? y + j * I : NULL, o + j * I, I,  \
                          a->mode, a->relu, &k[0][j], &k[1][j], &k[2][j], &k[3][j], 0);        \
    }                                                                                          \
}                                                                                              \
                                                                                               \
/* The mean of channel c's first SHIFT_VALUES values (row by row), rounded to T. */           \
static double shift_##S(const bn_t *a, int64_t c)                                              \
{                                                                                              \
    const T *x = (const T *)a->x + c * a->I;                                                   \
    double s = 0;                                                                              \
    int64_t n = 0;                                                                             \
    for (int64_t r = 0; r < a->R && n < SHIFT_VALUES; r++, x += a->C * a->I)                   \
        for (int64_t i = 0; i < a->I && n < SHIFT_VALUES; i++, n++) s += x[i];                 \
    return (T)(s / (double)n);                                                                 \
}                                                                                              \
                                                                                               \
/* Part p's channels (I > 1) in tiles: their sums and, when fused, their outputs; or     \
 * (not sums) their outputs. */                                                                \
static void channels_##S(bn_t *a, int64_t p)                                                   \
{                                                                                              \
    const int64_t c1 = (p + 1) * a->C / a->parts, tile = tile_channels(a);                     \
    for (int64_t c0 = p * a->C / a->parts; c0 < c1; c0 += tile) {                              \
        int64_t ct = c1 - c0 < tile ? c1 - c0 : tile;                                          \
        T k[4][MAX_TILE];                   /* per channel: m, kd, kx, kc */                   \
        double s[MAX_TILE][2];                                                                 \
        if (a->sums) {                                                                         \
            for (int64_t j = 0; j < ct; j++)                                                   \
                k[0][j] = a->grad ? (T)a->mean[c0 + j] : (T)shift_##S(a, c0 + j);             \
            if (a->grad && a->mask) tile_sums_body_##S(a, c0, ct, k[0], 2, s);                 \
            else if (a->grad) tile_sums_body_##S(a, c0, ct, k[0], 1, s);                       \
            else tile_sums_body_##S(a, c0, ct, k[0], 0, s);                                    \
        }                                                                                      \
        for (int64_t j = 0; j < ct; j++) {                                                     \
            double d[4] = {0, 0, 0, 0};                                                        \
            if (!a->sums) {                                                                    \
                apply_consts(a, c0 + j, round_##S, d, d + 1, d + 2, d + 3);                    \
            } else if (a->grad) {                                                              \
                d[0] = k[0][j];                                                                \
                finish_grad(a, c0 + j, d[0], s[j][0], s[j][1], d + 1, d + 2, d + 3);           \
            } else {                                                                           \
                finish_stats(a, c0 + j, k[0][j], s[j][0], s[j][1], round_##S, d, d + 2, d + 3); \
            }                                                                                  \
            for (int q = 0; q < 4; q++) k[q][j] = (T)d[q];                                     \
        }                                                                                      \
        if (!a->sums || a->fused) tile_apply_##S(a, c0, ct, k);                                \
    }                                                                                          \
}                                                                                              \
                                                                                               \
/* ---- I = 1: rows of C values ---------------------------------------------------------- */ \
                                                                                               \
static inline __attribute__((always_inline)) void row_sums_body_##S(bn_t *a, int64_t p,      \
                                                                     int grad)                 \
{                                                                                              \
    const int64_t C = a->C, r0 = p * a->R / a->parts, r1 = (p + 1) * a->R / a->parts;          \
    const T *sh = a->consts;                                                                   \
    T *f1 = (T *)a->work + 2 * C * p, *f2 = f1 + C;                                            \
    double *d1 = a->partial + 2 * C * p, *d2 = d1 + C;                                         \
    for (int64_t c = 0; c < C; c++) f1[c] = f2[c] = 0, d1[c] = d2[c] = 0;                      \
    const int64_t w = sizeof(V) / sizeof(T), cv = C / w * w;                                  \
    for (int64_t r = r0; r < r1; r++) {                                                        \
        const T *x = (const T *)a->x + r * C, *g = grad ? (const T *)a->dy + r * C : x;        \
        const T *y = grad == 2 ? (const T *)a->mask + r * C : x;                               \
        for (int64_t c = 0; c < cv; c += w) {                                                  \
            V d = load_##S(x + c) - load_##S(sh + c), v = grad ? load_##S(g + c) : d;          \
            if (grad == 2) v = keep_##S(v, load_##S(y + c));                                   \
            store_##S(f1 + c, load_##S(f1 + c) + v);                                           \
            store_##S(f2 + c, load_##S(f2 + c) + v * d);                                       \
        }                                                                                      \
        for (int64_t c = cv; c < C; c++) {                                                     \
            T d = x[c] - sh[c], v = grad ? g[c] : d;                                           \
            if (grad == 2) v = keep1_##S(v, y[c]);                                             \
            f1[c] += v;                                                                        \
            f2[c] += v * d;                                                                    \
        }                                                                                      \
        if ((r - r0) % FLUSH_ROWS == FLUSH_ROWS - 1 || r == r1 - 1)                            \
            for (int64_t c = 0; c < C; c++) d1[c] += f1[c], d2[c] += f2[c], f1[c] = f2[c] = 0;  \
    }                                                                                          \
}                                                                                              \
                                                                                               \
static void row_sums_##S(bn_t *a, int64_t p)                                                   \
{                                                                                              \
    if (a->grad && a->mask) row_sums_body_##S(a, p, 2);                                        \
    else if (a->grad) row_sums_body_##S(a, p, 1);                                              \
    else row_sums_body_##S(a, p, 0);                                                           \
}                                                                                              \
                                                                                               \
static void row_apply_##S(bn_t *a, int64_t p)                                                  \
{                                                                                              \
    const int64_t C = a->C, r0 = p * a->R / a->parts, r1 = (p + 1) * a->R / a->parts;          \
    const T *m = a->consts, *kd = m + C, *kx = kd + C, *kc = kx + C;                           \
    for (int64_t r = r0; r < r1; r++) {                                                        \
        const T *x = (const T *)a->x + r * C, *g = a->dy ? (const T *)a->dy + r * C : NULL;    \
        const T *y = a->mask ? (const T *)a->mask + r * C : NULL;                              \
        apply_run_##S(x, g, y, (T *)a->out + r * C, C, a->mode, a->relu, m, kd, kx, kc, 1);    \
    }                                                                                          \
}                                                                                              \
                                                                                               \
/* consts: the shifts of the statistics (the mean of each channel's first SHIFT_VALUES     \
 * values, taken row by row), or the gradient's m = mean rounded. */                          \
static void row_shifts_##S(bn_t *a)                                                            \
{                                                                                              \
    T *m = a->consts;                                                                          \
    const int64_t C = a->C, rows = a->R < SHIFT_VALUES ? a->R : SHIFT_VALUES;                  \
    if (a->grad) {                                                                             \
        for (int64_t c = 0; c < C; c++) m[c] = (T)a->mean[c];                                  \
        return;                                                                                \
    }                                                                                          \
    double *s = a->partial;                 /* free until the sums */                          \
    for (int64_t c = 0; c < C; c++) s[c] = 0;                                                  \
    for (int64_t r = 0; r < rows; r++)                                                         \
        for (int64_t c = 0; c < C; c++) s[c] += ((const T *)a->x)[r * C + c];                  \
    for (int64_t c = 0; c < C; c++) m[c] = (T)(s[c] / (double)rows);                           \
}                                                                                              \
                                                                                               \
/* Fold the parts' sums in part order, finish every channel and, when fused or for an        \
 * apply, lay its output constants out in consts (m, kd, kx, kc). */                           \
static void row_consts_##S(bn_t *a)                                                            \
{                                                                                              \
    const int64_t C = a->C;                                                                    \
    T *tm = a->consts, *tkd = tm + C, *tkx = tkd + C, *tkc = tkx + C;                          \
    for (int64_t c = 0; c < C; c++) {                                                          \
        double m = 0, kd = 0, kx = 0, kc = 0;                                                  \
        if (a->partial) {                                                                      \
            double s1 = 0, s2 = 0;                                                             \
            for (int64_t p = 0; p < a->parts; p++)                                             \
                s1 += a->partial[2 * C * p + c], s2 += a->partial[2 * C * p + C + c];          \
            if (a->grad) finish_grad(a, c, tm[c], s1, s2, &kd, &kx, &kc), m = tm[c];           \
            else finish_stats(a, c, tm[c], s1, s2, round_##S, &m, &kx, &kc);                   \
        } else {                                                                               \
            apply_consts(a, c, round_##S, &m, &kd, &kx, &kc);                                  \
        }                                                                                      \
        tm[c] = (T)m, tkd[c] = (T)kd, tkx[c] = (T)kx, tkc[c] = (T)kc;                          \
    }                                                                                          \
}                                                                                              \
                                                                                               \
static const kind_t kind_##S = {channels_##S, row_sums_##S, row_apply_##S, row_shifts_##S,      \
                                row_consts_##S, sizeof(T)};

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
