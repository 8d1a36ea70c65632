/* The native CPU kernels of max pooling, on C-contiguous NCHW float32 or float64
 * arrays, with the semantics of the numpy kernels of kernels/cpu/pool2d.py, the
 * reference. The gradient (pool2d_grad with pool_type "max", not global): dout
 * routed to each window's first max:
 * - taps are visited in row-major order, padding reading as -inf; a window's max is
 *   its first tap, replaced by a later one only where that one is strictly greater
 *   (so a NaN is chosen only as the first tap, and a window whose first max is
 *   padding passes nothing on);
 * - where windows overlap, each element's contributions are added in the order of
 *   their taps (windows visited in reverse raster order), starting from 0.
 * And the forward of 2x2 windows at stride 2 that tile the plane exactly (the
 * common pooling layer), as the numpy kernel's two passes: the max of each pair of
 * rows, then of each pair of neighbours in that row, NaN propagating (numpy's
 * maximum); both passes are vectorized loops. Other forwards stay on numpy: one
 * window at a time was no faster than its vectorized passes.
 * Built and loaded by native.py, launched by pool_native.py.
 *
 * Planes (one image's channel) are split in contiguous ranges over up to
 * `threads` threads (native_pool.h); each plane is computed by one thread in
 * one way, so results do not depend on the number of threads. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "native_pool.h"

#define MAX_THREADS 64

typedef struct {
    const void *x, *dout;
    void *dx;
    int64_t begin, end;                /* planes */
    int64_t h, w, ho, wo, kh, kw, sh, sw, ph, pw;
    int f64;
} job_t;

/* One tap at offset o of a window inside the plane: the best value and its offset. */
#define TAP(T, xr, o, best, off)                                                        \
    {                                                                                   \
        const T v = (xr)[o];                                                            \
        const int64_t greater = -(int64_t)(v > best);                                   \
        off = (off & ~greater) | ((int64_t)(o) & greater);                              \
        best = v > best ? v : best;                                                     \
    }

/* The offset in the plane of the first strictly greatest tap of the window whose
 * top-left tap is (r0, c0), or -1 where that is padding. Inside the plane: no bounds
 * checks, and masks and selects instead of branches (which tap wins is data, and
 * mispredicted branches cost more than the comparisons). */
#define WINDOW(T)                                                                       \
    static inline int64_t window_##T(const T *x, int64_t h, int64_t w, int64_t r0,      \
                                     int64_t c0, int64_t kh, int64_t kw) {              \
        if (r0 >= 0 && c0 >= 0 && r0 + kh <= h && c0 + kw <= w) {                       \
            const T *xr = x + r0 * w + c0;                                              \
            T best = xr[0];                                                             \
            int64_t off = 0;                                                            \
            if (kh == 2 && kw == 2) {                                                   \
                TAP(T, xr, 1, best, off)                                                \
                TAP(T, xr, w, best, off)                                                \
                TAP(T, xr, w + 1, best, off)                                            \
            } else {                                                                    \
                for (int64_t i = 0; i < kh; i++)                                        \
                    for (int64_t k = (i == 0); k < kw; k++)                             \
                        TAP(T, xr, i * w + k, best, off)                                \
            }                                                                           \
            return r0 * w + c0 + off;                                                   \
        }                                                                               \
        T best = 0;                                                                     \
        int64_t at = -1;                                                                \
        for (int64_t i = 0; i < kh; i++)                                                \
            for (int64_t k = 0; k < kw; k++) {                                          \
                const int64_t r = r0 + i, c = c0 + k;                                   \
                const int inside = r >= 0 && r < h && c >= 0 && c < w;                  \
                const T v = inside ? x[r * w + c] : (T)-INFINITY;                       \
                if ((i == 0 && k == 0) || v > best) {                                   \
                    best = v;                                                           \
                    at = inside ? r * w + c : -1;                                       \
                }                                                                       \
            }                                                                           \
        return at;                                                                      \
    }

#define KERNELS(T)                                                                      \
    WINDOW(T)                                                                           \
    static void gradient_##T(const job_t *j) {                                          \
        const int64_t h = j->h, w = j->w, ho = j->ho, wo = j->wo, kh = j->kh, kw = j->kw;\
        const int64_t sh = j->sh, sw = j->sw, ph = j->ph, pw = j->pw;                   \
        const int disjoint = sh >= kh && sw >= kw;                                      \
        for (int64_t p = j->begin; p < j->end; p++) {                                   \
            const T *x = (const T *)j->x + p * h * w;                                   \
            const T *dout = (const T *)j->dout + p * ho * wo;                           \
            T *dx = (T *)j->dx + p * h * w;                                             \
            for (int64_t e = 0; e < h * w; e++) dx[e] = 0;                              \
            for (int64_t oh = ho - 1; oh >= 0; oh--)                                    \
                for (int64_t ow = wo - 1; ow >= 0; ow--) {                              \
                    const int64_t at = window_##T(x, h, w, oh * sh - ph, ow * sw - pw, kh, kw);\
                    if (at >= 0)                                                        \
                        dx[at] = disjoint ? dout[oh * wo + ow] : dx[at] + dout[oh * wo + ow];\
                }                                                                       \
        }                                                                               \
    }

KERNELS(float)
KERNELS(double)

static void *run(void *arg) {
    const job_t *j = arg;
    if (j->f64)
        gradient_double(j);
    else
        gradient_float(j);
    return 0;
}

/* dx (planes, h, w) of max pooling over `planes` planes of h x w, from x and dout
 * (planes, ho, wo) (see the file comment). geometry: ho, wo, kh, kw, sh, sw, ph, pw.
 * Returns 0. */
int max_pool_grad(int f64, const void *x, const void *dout, void *dx, int64_t planes,
             int64_t h, int64_t w, const int64_t *geometry, int threads) {
    job_t jobs[MAX_THREADS];
    int64_t parts = threads < 1 ? 1 : threads > MAX_THREADS ? MAX_THREADS : threads;
    if (parts > planes) parts = planes > 0 ? planes : 1;
    const int64_t chunk = (planes + parts - 1) / parts;
    for (int64_t t = 0; t < parts; t++) {
        job_t *j = &jobs[t];
        j->x = x; j->dout = dout; j->dx = dx;
        j->begin = t * chunk < planes ? t * chunk : planes;
        j->end = (t + 1) * chunk < planes ? (t + 1) * chunk : planes;
        j->h = h; j->w = w;
        j->ho = geometry[0]; j->wo = geometry[1]; j->kh = geometry[2]; j->kw = geometry[3];
        j->sh = geometry[4]; j->sw = geometry[5]; j->ph = geometry[6]; j->pw = geometry[7];
        j->f64 = f64;
    }
    pool_run(run, jobs, sizeof(job_t), parts);
    return 0;
}

/* numpy's maximum: NaN when either is NaN */
#define MAX_NAN(a, b) (((a) > (b) || (a) != (a)) ? (a) : (b))

/* rows of pairs per block: pass 1 fills `pair` block by block, and pass 2 runs over a
 * whole block's outputs at once (one long loop, not one of w / 2 per row) */
#define TILE_BLOCK 64

#define TILES(T)                                                                        \
    static void tiles_##T(const T *restrict x, T *restrict out, int64_t rows, int64_t w,\
                          T *restrict pair) {                                           \
        for (int64_t r0 = 0; r0 < rows; r0 += TILE_BLOCK) {                             \
            const int64_t block = rows - r0 < TILE_BLOCK ? rows - r0 : TILE_BLOCK;      \
            for (int64_t r = 0; r < block; r++) {                                       \
                const T *top = x + 2 * (r0 + r) * w, *bottom = top + w;                 \
                T *p = pair + r * w;                                                    \
                for (int64_t c = 0; c < w; c++)                                         \
                    p[c] = MAX_NAN(top[c], bottom[c]);                                  \
            }                                                                           \
            T *o = out + r0 * (w / 2);                                                  \
            for (int64_t q = 0; q < block * (w / 2); q++)                               \
                o[q] = MAX_NAN(pair[2 * q], pair[2 * q + 1]);                           \
        }                                                                               \
    }

TILES(float)
TILES(double)

/* out (rows, w / 2): the max of each 2x2 window of x (2 rows, w) per output row,
 * rows = planes * h / 2, w even (see the file comment). Returns 0, or 1 where the
 * row buffer could not be allocated. */
int max_pool_tiles(int f64, const void *x, void *out, int64_t rows, int64_t w) {
    void *pair = malloc((size_t)TILE_BLOCK * (w > 0 ? w : 1)
                        * (f64 ? sizeof(double) : sizeof(float)));
    if (!pair) return 1;
    if (f64)
        tiles_double(x, out, rows, w, pair);
    else
        tiles_float(x, out, rows, w, pair);
    free(pair);
    return 0;
}
