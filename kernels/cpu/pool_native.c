/* The native CPU kernels of max pooling (and float32 global average pooling), on C-contiguous NCHW float32 or float64
 * arrays, with the semantics of the numpy kernels of kernels/cpu/pool2d.py, the
 * reference (channels-last arrays: pool_native_nhwc.h, the same semantics). The gradient (pool2d_grad with pool_type "max", not global): dout
 * routed to each window's first max:
 * - taps are visited in row-major order, padding reading as -inf; a window's max is
 *   its first tap, replaced by a later one only where that one is strictly greater
 *   (so a NaN is chosen only as the first tap, and a window whose first max is
 *   padding passes nothing on);
 * - where windows overlap, each element's contributions are added in the order of
 *   their taps (windows visited in reverse raster order), starting from 0;
 * - float32 2x2 windows at stride 2 without padding (each element in one window at
 *   most, the common pooling layer) go eight windows at a time (tiles8): the same
 *   choice made with vector masks instead of one window at a time.
 * And the forward of 2x2 windows at stride 2 that tile the plane exactly (the
 * common pooling layer), as the numpy kernel's two passes: the max of each pair of
 * rows, then of each pair of neighbours in that row, NaN propagating (numpy's
 * maximum); float32 in one pass, eight windows at a time (the neighbours paired by
 * shuffles) on the pool's threads, float64 in two vectorized passes. And the
 * float32 NCHW forward of global average pooling (global_avg_pool), and float32 NCHW
 * average pooling and its gradient (pool_avg.h). Other forwards stay on numpy: one window at a time was no faster than its vectorized passes.
 * Built and loaded by native.py, launched by pool_native.py.
 *
 * Planes (one image's channel) are split in contiguous ranges over up to
 * `threads` threads (native_pool.h); each plane is computed by one thread in
 * one way, so results do not depend on the number of threads. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "native_pool.h"
#include "native_simd.h"

typedef v8f v8;
typedef v8fu v8u;
typedef int v8i __attribute__((vector_size(32)));

typedef struct {
    const void *x, *dout;
    void *dx;
    int64_t begin, end;                /* planes (NHWC: images) */
    int64_t h, w, ho, wo, kh, kw, sh, sw, ph, pw, c;
    int f64, failed;
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

WINDOW(float)
WINDOW(double)

static v8 load8(const float *p) { return *(const v8u *)p; }
static void store8(float *p, v8 v) { *(v8u *)p = v; }
static v8 pick(v8i mask, v8 a, v8 b) { return (v8)(((v8i)a & mask) | ((v8i)b & ~mask)); }

/* The dx of eight 2x2 windows (stride 2), float32, given their taps as vectors (the
 * even and odd columns of their top and bottom rows) and dout d: the first strictly
 * greatest tap chosen as TAP does (masks, no branches), d at it and zeros at the
 * other three, as the rows were read (top: t0, t1; bottom: b0, b1). */
static inline void tiles8_dx(v8 t0, v8 t1, v8 b0, v8 b1, v8 d, v8 *dt0, v8 *dt1, v8 *db0,
                             v8 *db1) {
    v8 x00 = __builtin_shufflevector(t0, t1, 0, 2, 4, 6, 8, 10, 12, 14);
    v8 x01 = __builtin_shufflevector(t0, t1, 1, 3, 5, 7, 9, 11, 13, 15);
    v8 x10 = __builtin_shufflevector(b0, b1, 0, 2, 4, 6, 8, 10, 12, 14);
    v8 x11 = __builtin_shufflevector(b0, b1, 1, 3, 5, 7, 9, 11, 13, 15);
    v8i m1 = x01 > x00;
    v8 best = pick(m1, x01, x00);
    v8i m2 = x10 > best;
    best = pick(m2, x10, best);
    v8i m3 = x11 > best;
    m2 &= ~m3;
    m1 &= ~(m2 | m3);
    v8i m0 = ~(m1 | m2 | m3), dv = (v8i)d;
    v8 d00 = (v8)(dv & m0), d01 = (v8)(dv & m1), d10 = (v8)(dv & m2), d11 = (v8)(dv & m3);
    *dt0 = __builtin_shufflevector(d00, d01, 0, 8, 1, 9, 2, 10, 3, 11);
    *dt1 = __builtin_shufflevector(d00, d01, 4, 12, 5, 13, 6, 14, 7, 15);
    *db0 = __builtin_shufflevector(d10, d11, 0, 8, 1, 9, 2, 10, 3, 11);
    *db1 = __builtin_shufflevector(d10, d11, 4, 12, 5, 13, 6, 14, 7, 15);
}

/* Eight 2x2 windows: four whose top and bottom rows start at top0 and bottom0, four
 * at top1 and bottom1 (8 floats on from top0 and bottom0 within one row; or two rows
 * of 4 windows each), dout d (8); dx written at dtop0 .. dbottom1 as the rows were
 * read. */
static inline void tiles8_at(const float *top0, const float *top1, const float *bottom0,
                             const float *bottom1, const float *d, float *dtop0, float *dtop1,
                             float *dbottom0, float *dbottom1) {
    v8 o0, o1, o2, o3;
    tiles8_dx(load8(top0), load8(top1), load8(bottom0), load8(bottom1), load8(d), &o0, &o1,
              &o2, &o3);
    store8(dtop0, o0);
    store8(dtop1, o1);
    store8(dbottom0, o2);
    store8(dbottom1, o3);
}

/* Eight windows side by side in rows top and bottom. */
static inline void tiles8(const float *top, const float *bottom, const float *d, float *dtop,
                          float *dbottom) {
    tiles8_at(top, top + 8, bottom, bottom + 8, d, dtop, dtop + 8, dbottom, dbottom + 8);
}

/* n windows side by side: tiles8 on each eight, the last n % 8 with masked loads and
 * stores (lanes past them read as zeros and are not written, so every window is
 * chosen the same way). */
static void row_tiles(const float *top, const float *bottom, const float *d, float *dtop,
                      float *dbottom, int64_t n) {
    int64_t q = 0;
    for (; q + 8 <= n; q += 8)
        tiles8(top + 2 * q, bottom + 2 * q, d + q, dtop + 2 * q, dbottom + 2 * q);
    if (q < n) {
        const int64_t r = n - q, lo = 2 * r < 8 ? 2 * r : 8, hi = 2 * r - lo;
        v8 o0, o1, o2, o3;
        tiles8_dx(v8f_load_part(top + 2 * q, lo), v8f_load_part(top + 2 * q + 8, hi),
                  v8f_load_part(bottom + 2 * q, lo), v8f_load_part(bottom + 2 * q + 8, hi),
                  v8f_load_part(d + q, r), &o0, &o1, &o2, &o3);
        v8f_store_part(dtop + 2 * q, o0, lo);
        v8f_store_part(dtop + 2 * q + 8, o1, hi);
        v8f_store_part(dbottom + 2 * q, o2, lo);
        v8f_store_part(dbottom + 2 * q + 8, o3, hi);
    }
}

/* dx of one float32 plane for 2x2 windows at stride 2, no padding, 2 ho <= h and
 * 2 wo <= w (each element in at most one window): row_tiles on each pair of rows
 * (planes 8 wide: two output rows of 4 windows at a time); the rows and columns no
 * window covers get zeros. */
static void tiles_grad_float(const float *x, const float *dout, float *dx, int64_t h,
                             int64_t w, int64_t ho, int64_t wo) {
    int64_t oh = 0;
    if (w == 8 && wo == 4)
        for (; oh + 2 <= ho; oh += 2) {
            const float *xr = x + 2 * oh * w;
            float *dr = dx + 2 * oh * w;
            tiles8_at(xr, xr + 2 * w, xr + w, xr + 3 * w, dout + oh * wo, dr, dr + 2 * w, dr + w,
                      dr + 3 * w);
        }
    for (; oh < ho; oh++) {
        float *dtop = dx + 2 * oh * w;
        row_tiles(x + 2 * oh * w, x + (2 * oh + 1) * w, dout + oh * wo, dtop, dtop + w, wo);
        for (int64_t c = 2 * wo; c < w; c++) dtop[c] = dtop[w + c] = 0;
    }
    for (int64_t e = 2 * ho * w; e < h * w; e++) dx[e] = 0;
}

static int tiles_2x2(const job_t *j) {
    return j->kh == 2 && j->kw == 2 && j->sh == 2 && j->sw == 2 && j->ph == 0 && j->pw == 0
           && 2 * j->ho <= j->h && 2 * j->wo <= j->w;
}

#define KERNELS(T)                                                                      \
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
    if (j->f64) {
        gradient_double(j);
    } else if (tiles_2x2(j)) {
        for (int64_t p = j->begin; p < j->end; p++)
            tiles_grad_float((const float *)j->x + p * j->h * j->w,
                             (const float *)j->dout + p * j->ho * j->wo,
                             (float *)j->dx + p * j->h * j->w, j->h, j->w, j->ho, j->wo);
    } else {
        gradient_float(j);
    }
    return 0;
}

/* dx (planes, h, w) of max pooling over `planes` planes of h x w, from x and dout
 * (planes, ho, wo) (see the file comment). geometry: ho, wo, kh, kw, sh, sw, ph, pw.
 * Returns 0. */
int max_pool_grad(int f64, const void *x, const void *dout, void *dx, int64_t planes,
             int64_t h, int64_t w, const int64_t *geometry, int threads) {
    job_t jobs[POOL_MAX_THREADS];
    int64_t parts = pool_parts(threads, planes);
    for (int64_t t = 0; t < parts; t++) {
        job_t *j = &jobs[t];
        j->x = x; j->dout = dout; j->dx = dx;
        pool_share(planes, parts, t, &j->begin, &j->end);
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

TILES(double)

/* MAX_NAN lane by lane: a where a > b or a is NaN, else b. */
static inline v8 max_nan8(v8 a, v8 b) { return pick((a > b) | (a != a), a, b); }

/* Eight windows' max from the 16 columns of their top and bottom rows: MAX_NAN of
 * the rows, then of each pair of neighbours, as the two passes do it. */
static inline v8 tiles8_max(v8 t0, v8 t1, v8 b0, v8 b1) {
    v8 m0 = max_nan8(t0, b0), m1 = max_nan8(t1, b1);
    return max_nan8(__builtin_shufflevector(m0, m1, 0, 2, 4, 6, 8, 10, 12, 14),
                    __builtin_shufflevector(m0, m1, 1, 3, 5, 7, 9, 11, 13, 15));
}

typedef struct {
    const float *x;
    float *out;
    int64_t begin, end, w;   /* items [begin, end): output rows of w / 2 values (2x2 tiles)
                                or planes of w values (global average) */
} tiles_job_t;

/* fn on jobs of contiguous ranges of `items` (tiles_job_t: x, out, w) over up to
 * `threads` threads. */
static void run_ranges(void *(*fn)(void *), const void *x, void *out, int64_t items,
                       int64_t w, int threads) {
    tiles_job_t jobs[POOL_MAX_THREADS];
    int64_t parts = pool_parts(threads, items);
    for (int64_t t = 0; t < parts; t++) {
        jobs[t] = (tiles_job_t){.x = x, .out = out, .w = w};
        pool_share(items, parts, t, &jobs[t].begin, &jobs[t].end);
    }
    pool_run(fn, jobs, sizeof(tiles_job_t), parts);
}

/* float32 output rows of one job in one pass, eight windows at a time, a row's last
 * ones through masked loads and stores; rows 8 wide two at a time (their 4 windows
 * each side by side: the 32 values of the two row pairs lie in a row). */
static void *tiles_float_rows(void *arg) {
    const tiles_job_t *j = arg;
    const int64_t w = j->w, wo = w / 2;
    int64_t r = j->begin;
    if (w == 8)
        for (; r + 2 <= j->end; r += 2) {
            const float *top = j->x + 2 * r * w;
            store8(j->out + r * wo, tiles8_max(load8(top), load8(top + 2 * w), load8(top + w),
                                               load8(top + 3 * w)));
        }
    for (; r < j->end; r++) {
        const float *top = j->x + 2 * r * w, *bottom = top + w;
        float *o = j->out + r * wo;
        int64_t q = 0;
        for (; q + 8 <= wo; q += 8)
            store8(o + q, tiles8_max(load8(top + 2 * q), load8(top + 2 * q + 8),
                                     load8(bottom + 2 * q), load8(bottom + 2 * q + 8)));
        if (q < wo) {
            const int64_t left = wo - q, lo = 2 * left < 8 ? 2 * left : 8, hi = 2 * left - lo;
            v8f_store_part(o + q, tiles8_max(v8f_load_part(top + 2 * q, lo),
                                             v8f_load_part(top + 2 * q + 8, hi),
                                             v8f_load_part(bottom + 2 * q, lo),
                                             v8f_load_part(bottom + 2 * q + 8, hi)), left);
        }
    }
    return NULL;
}

/* out (rows, w / 2): the max of each 2x2 window of x (2 rows, w) per output row,
 * rows = planes * h / 2, w even (see the file comment); float32 in one pass on up to
 * `threads` threads (contiguous ranges of rows), float64 in two on this one.
 * Returns 0, or 1 where the row buffer could not be allocated. */
int max_pool_tiles(int f64, const void *x, void *out, int64_t rows, int64_t w,
                   int threads) {
    if (!f64) {
        run_ranges(tiles_float_rows, x, out, rows, w, threads);
        return 0;
    }
    void *pair = malloc((size_t)TILE_BLOCK * (w > 0 ? w : 1) * sizeof(double));
    if (!pair) return 1;
    tiles_double(x, out, rows, w, pair);
    free(pair);
    return 0;
}

/* float32 planes [begin, end) of hw values each (tiles_job_t's w) to their means: eight
 * lanes' sums, in 8 / VD vectors of native_simd.h's VD doubles. */
static void *global_avg_planes(void *arg) {
    const tiles_job_t *j = arg;
    const int64_t hw = j->w;
    for (int64_t p = j->begin; p < j->end; p++) {
        const float *x = j->x + p * hw;
        vd acc[8 / VD] = {{0}};
        int64_t e = 0;
        for (; e + 8 <= hw; e += 8)
            for (int h = 0; h < 8 / VD; h++) acc[h] += vd_of_floats(x + e + VD * h);
        double l[8];
        memcpy(l, acc, sizeof l);
        double sum = ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
        for (; e < hw; e++) sum += x[e];
        j->out[p] = (float)(sum / (double)hw);
    }
    return NULL;
}

/* out[p] = the mean of plane p of x (planes, hw), float32 (global average pooling,
 * NCHW): each plane summed in float64, eight lanes at a time, the lanes then added
 * pairwise and the last hw % 8 values in order, divided by hw in float64 and rounded
 * once (numpy's float64 mean, up to the order of the float64 sums); planes in
 * contiguous ranges over up to `threads` threads. Returns 0. */
int global_avg_pool(const float *x, float *out, int64_t planes, int64_t hw, int threads) {
    run_ranges(global_avg_planes, x, out, planes, hw, threads);
    return 0;
}

#include "pool_avg.h"
#include "pool_native_nhwc.h"
