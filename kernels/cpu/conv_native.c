/* The native CPU kernels of 2-D convolutions (float32, NCHW, one group): the
 * forward pass with fused_conv2d's epilogue, and the filter gradient. Built
 * and loaded by native.py, launched by conv_native.py (the contract is there);
 * the channels-last kernels of conv_nhwc.h (launched by conv_native_nhwc.py) share
 * the library.
 *
 * Each thread copies one image at a time into a zero-bordered buffer that
 * stays in cache and reads the convolution's windows straight from it, with
 * no columns in memory. The buffer holds the input after ph rows and pw
 * columns of zeros, then zeros: the rows and columns the windows read, no
 * more (so the padding after the input may differ from ph, pw), in phases
 * of the stride across (one where sw == 1). Phase q holds padded column
 * sw x + q at x, so that eight outputs of a row read eight adjacent values of
 * one phase. Tap (i, j) of input channel ci is the offset
 * koff = ((q C + ci) hb + i dh) wb + s, with q = j dw % sw and s = j dw / sw;
 * output row y starts at y sh wb.
 *
 * The forward tile is MR output channels (8 with AVX-512, else 4) by NV vectors of VL
 * outputs (native_simd.h: 16 with AVX-512, else 8; vector v: row v / vpr, columns VL
 * (v % vpr) ..; with AVX-512 and rows of at most 8 outputs, rows 2v and 2v + 1, 8
 * lanes each, two loads of the buffer a vector): one broadcast filter
 * value times NV loaded vectors per tap, the filter read in place (O rows
 * of C kh kw; a last block short of MR repeats row O - 1 and does not store
 * it). Outputs past wo in a vector are computed on the buffer's zeros and
 * never stored. The outputs may go to every osh-th row and osw-th column of
 * a larger array (a phase of a strided conv's input gradient). The epilogue
 * (bias, residual, relu, the stores) is conv_epilogue.h's. Threads take
 * (image, slice of output channels) units from a shared counter; every
 * output is summed by one thread in one order, so results do not depend on
 * them.
 *
 * With `pool` (dims[22]), `out` is (N, O, ho / 2, wo / 2): each unit's outputs go,
 * with the epilogue, to planes of the thread's own (ho, wo) in cache, then their max
 * over each 2x2 window at stride 2 (an odd last row or column left out, as pool2d's)
 * to out, as pool2d's max makes it (pool_native.c: rows first, then neighbours, NaN
 * propagating; conv_pool.h); the full-size outputs are never written to memory.
 *
 * A 1x1 conv of stride 1 and no padding whose outputs fill `out` runs
 * conv_pointwise.h's kernel instead: a matrix product per image on packed panels.
 *
 * Included at the end: conv_filter_grad.h, the filter gradient (on the same
 * buffers); conv_winograd.h, Winograd's F(4x4, 3x3) for the forward passes of 3x3
 * convs of stride 1 (conv_native.py's winograd() picks); conv_nhwc.h, the
 * channels-last kernels. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_pool.h"
#include "native_simd.h"

#if VL == 16
#define MR 8           /* 24 sums of 32 registers: a value loaded from the buffer serves
                          8 output channels (2-core Xeon, stride-2 convs: 1.1-1.2x MR 4) */
#else
#define MR 4           /* 12 sums of 16 registers */
#endif
#define NV 3
#define MAX_THREADS 64
#define MAX_PHASES 64      /* conv_native.py's supports() keeps to it */

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef int v8i __attribute__((vector_size(32)));

typedef struct {
    const float *x, *filter, *bias, *residual, *dout;
    float *out, *pooled;                /* pooled: pool's out (then `out` is per unit) */
    int64_t n, c, h, w, o, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo, relu, pooling;
    int64_t out_h, out_w, oy0, ox0, osh, osw;   /* output (y, x) at (oy0 + osh y, ox0 + osw x) */
    int64_t hb, wb, k, nblk, vpr, nvec, slices, units, buf_size, phases;
    int64_t pair, vw, pair_base, pair_out;  /* forward: vectors of two rows of 8 (pair), each
                                           row part vw lanes; the second row's offsets */
    int64_t *koff;
    int64_t *vbase, *vout, *vlanes;   /* forward, per output vector: its buffer offset, where
                                           its first output goes in a plane, how many it has
                                           (in each row, for pairs) */
    int64_t x0[MAX_PHASES], x1[MAX_PHASES], c0[MAX_PHASES];   /* per phase: the buffer
                                           columns [x0, x1) hold input columns c0, c0 + sw, .. */
} conv_t;

static v8 load(const float *p) { return *(const v8u *)p; }

static void setup(conv_t *a, const int64_t *d)
{
    a->n = d[0]; a->c = d[1]; a->h = d[2]; a->w = d[3]; a->o = d[4]; a->kh = d[5];
    a->kw = d[6]; a->sh = d[7]; a->sw = d[8]; a->ph = d[9]; a->pw = d[10]; a->dh = d[11];
    a->dw = d[12]; a->ho = d[13]; a->wo = d[14]; a->relu = d[15]; a->out_h = d[16];
    a->out_w = d[17]; a->oy0 = d[18]; a->ox0 = d[19]; a->osh = d[20]; a->osw = d[21];
    a->pooling = d[22];
    a->pair = VL == 16 && a->wo <= 8;      /* rows of 8: two in a vector of 16 */
    a->vw = a->pair ? 8 : VL;
    a->vpr = (a->wo + a->vw - 1) / a->vw;
    a->nvec = a->pair ? (a->ho + 1) / 2 : a->ho * a->vpr;
    int64_t rows = a->pair ? a->ho + a->ho % 2 : a->ho;        /* the rows vectors cover */
    a->hb = (rows - 1) * a->sh + (a->kh - 1) * a->dh + 1;      /* the rows read */
    a->k = a->c * a->kh * a->kw;
    a->nblk = (a->o + MR - 1) / MR;
    /* phase q holds padded column sw x + q at x; tap j reads phase (j dw) % sw
     * shifted by (j dw) / sw */
    int64_t reach = (a->kw - 1) * a->dw;
    a->phases = a->sw < reach + 1 ? a->sw : reach + 1;
    a->wb = a->vw * a->vpr + reach / a->sw;
    a->pair_base = a->sh * a->wb;
    a->pair_out = a->osh * a->out_w;
    a->buf_size = a->phases * a->c * a->hb * a->wb + 8;
    a->koff = malloc(a->k * sizeof(int64_t));
    if (!a->koff) return;
    for (int64_t q = 0; q < a->phases; q++) {    /* input column sw x + q - pw at x */
        a->x0[q] = a->x1[q] = 0;
        for (int64_t x = 0; x < a->wb; x++) {
            int64_t col = a->sw * x + q - a->pw;
            if (col < 0 || col >= a->w) continue;
            if (a->x1[q] == a->x0[q]) a->x0[q] = x, a->c0[q] = col;
            a->x1[q] = x + 1;
        }
    }
    int64_t k = 0;
    for (int64_t ci = 0; ci < a->c; ci++)
        for (int64_t i = 0; i < a->kh; i++)
            for (int64_t j = 0; j < a->kw; j++) {
                int64_t q = j * a->dw % a->sw, shift = j * a->dw / a->sw;
                a->koff[k++] = ((q * a->c + ci) * a->hb + i * a->dh) * a->wb + shift;
            }
}

/* The forward's per-vector tables (vbase, vout, vlanes in one block); 0 when
 * memory ran out. */
static int vector_tables(conv_t *a)
{
    a->vbase = malloc(3 * (a->nvec > 0 ? a->nvec : 1) * sizeof(int64_t));
    if (!a->vbase) return 0;
    a->vout = a->vbase + a->nvec;
    a->vlanes = a->vout + a->nvec;
    for (int64_t v = 0; v < a->nvec; v++) {
        int64_t y = a->pair ? 2 * v : v / a->vpr, x0 = a->pair ? 0 : (v % a->vpr) * a->vw;
        a->vbase[v] = y * a->sh * a->wb + x0;
        a->vout[v] = (a->oy0 + a->osh * y) * a->out_w + a->ox0 + a->osw * x0;
        a->vlanes[v] = a->wo - x0 < a->vw ? a->wo - x0 : a->vw;
    }
    return 1;
}

/* Whether the windows read row r of the zero-bordered input (conservative: true
 * unless every tap's row offset is below the stride, as a 1x1 conv's at stride 2). */
static inline int row_read(const conv_t *a, int64_t r)
{
    if ((a->kh - 1) * a->dh >= a->sh) return 1;
    int64_t m = r % a->sh;
    return m % a->dh == 0 && m / a->dh < a->kh;
}

/* Image `img` of x into buf, whose zeros were set once (the same places are
 * written for every image; rows the windows never read are left out). */
static void fill_buffer(const conv_t *a, int64_t img, float *buf)
{
    for (int64_t y = 0; y < a->h && a->ph + y < a->hb; y++)
        for (int64_t q = 0, read = row_read(a, a->ph + y); q < a->phases && read; q++) {
            int64_t x0 = a->x0[q], count = a->x1[q] - x0;
            const int64_t sw = a->sw;   /* a local: a field could alias dst's stores */
            for (int64_t ci = 0; ci < a->c && count > 0; ci++) {
                float *dst = buf + ((q * a->c + ci) * a->hb + a->ph + y) * a->wb + x0;
                const float *from = a->x + ((img * a->c + ci) * a->h + y) * a->w + a->c0[q];
                if (sw == 1) {
                    memcpy(dst, from, count * sizeof(float));
                } else if (sw == 2) {
                    copy_every_other(dst, from, count);
                } else {
                    for (int64_t x = 0; x < count; x++) dst[x] = from[sw * x];
                }
            }
        }
}

#include "conv_epilogue.h"

/* A vector of the buffer: VL values from p, or (PAIR) 8 from p and 8 from p + step. */
static inline vf load_vector(const float *p, int64_t step, const int PAIR)
{
#if VL == 16
    if (PAIR)
        return __builtin_shufflevector(load(p), load(p + step), 0, 1, 2, 3, 4, 5, 6, 7, 8, 9,
                                       10, 11, 12, 13, 14, 15);
#endif
    (void)step;
    (void)PAIR;
    return vf_load(p);
}

static inline __attribute__((always_inline)) void forward_tile(
    const conv_t *a, int nv, const float *buf, const float *const f[MR], int64_t blk, int64_t v0,
    int64_t img, const int PAIR)
{
    vf acc[MR][NV];
    int64_t base[NV];
    const int64_t step = a->pair_base, k_all = a->k;
    const int64_t *koff = a->koff;
    for (int v = 0; v < NV; v++) {
        base[v] = a->vbase[v0 + (v < nv ? v : 0)];
        for (int r = 0; r < MR; r++) acc[r][v] = (vf){0};
    }
    for (int64_t k = 0; k < k_all; k++) {
        const float *b = buf + koff[k];
        vf bv[NV];
        for (int v = 0; v < nv; v++) bv[v] = load_vector(b + base[v], step, PAIR);
        for (int r = 0; r < MR; r++)
            for (int v = 0; v < nv; v++) acc[r][v] += f[r][k] * bv[v];
    }
    store_tile(a, acc, nv, blk, v0, img);
}

/* The block's output vectors, NV at a time; a last one left over goes with the tile
 * before it as two tiles of two (a tile of one vector loads a value of the buffer per
 * multiply-add: an 8x8 image's 4 vectors ran 3 + 1). */
static inline __attribute__((always_inline)) void forward_block(
    const conv_t *a, const float *buf, const float *const f[MR], int64_t blk, int64_t img,
    const int PAIR)
{
    int64_t v = 0, whole = a->nvec % NV == 1 && a->nvec > NV ? a->nvec - NV - 1 : a->nvec;
    for (; v + NV <= whole; v += NV) forward_tile(a, NV, buf, f, blk, v, img, PAIR);
    for (; a->nvec - v >= 2; v += 2) forward_tile(a, 2, buf, f, blk, v, img, PAIR);
    if (a->nvec - v == 1) forward_tile(a, 1, buf, f, blk, v, img, PAIR);
}

typedef struct {
    const conv_t *a;
    int64_t *next, first, last;   /* forward: a shared counter; filter gradient: images */
    float *dw;                 /* filter gradient: this thread's K x O (padded) sums */
    int failed;
} job_t;

#include "conv_pool.h"

static void *forward_job(void *p)
{
    job_t *job = p;
    const conv_t *a = job->a;
    int64_t plane = a->out_h * a->out_w;
    float *buf = calloc(a->buf_size + (a->pooling ? a->o * plane : 0), sizeof(float));
    if (!buf) { job->failed = 1; return NULL; }
    conv_t unit = *a;           /* pool: a unit's outputs to this thread's planes */
    const conv_t *to = a->pooling ? &unit : a;
    unit.out = buf + a->buf_size;
    int64_t shown = -1;
    for (int64_t u; (u = __atomic_fetch_add(job->next, 1, __ATOMIC_RELAXED)) < a->units;) {
        int64_t img = u / a->slices, s = u % a->slices, at = a->pooling ? 0 : img;
        int64_t first = s * a->nblk / a->slices, end = (s + 1) * a->nblk / a->slices;
        if (img != shown) fill_buffer(a, img, buf), shown = img;
        if (a->pooling && a->residual) unit.residual = a->residual + img * a->o * plane;
        for (int64_t blk = first; blk < end; blk++) {
            const float *wp[MR];          /* the block's filter rows; past O: the last */
            for (int r = 0; r < MR; r++)
                wp[r] = a->filter + (blk * MR + r < a->o ? blk * MR + r : a->o - 1) * a->k;
            if (a->pair)
                forward_block(to, buf, wp, blk, at, 1);
            else
                forward_block(to, buf, wp, blk, at, 0);
        }
        if (a->pooling)
            pool_planes(unit.out, a->pooled + img * a->o * (a->ho / 2) * (a->wo / 2),
                        first * MR, end * MR < a->o ? end * MR : a->o, a->ho, a->wo);
    }
    free(buf);
    return NULL;
}

/* Runs fn on `threads` jobs (native_pool.h: this thread runs the first, the pool's
 * workers the others); 0 on success. */
static int run_jobs(void *(*fn)(void *), job_t *jobs, int64_t threads)
{
    pool_run(fn, jobs, sizeof(job_t), threads);
    int failed = 0;
    for (int64_t t = 0; t < threads; t++) failed |= jobs[t].failed;
    return failed;
}

static int64_t clamp_threads(int64_t threads, int64_t units)
{
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > units) threads = units;
    return threads < 1 ? 1 : threads;
}

#include "conv_pointwise.h"

/* 1 when conv2d_forward_f32 runs the pointwise kernel on these dims, else 0. */
int conv2d_forward_pointwise(const int64_t *dims) { return pointwise(dims); }

/* dims: n c h w o kh kw sh sw ph pw dh dw ho wo relu, then where the outputs go:
 * out (N, O, out_h, out_w), output (y, x) at (oy0 + osh y, ox0 + osw x), then pool (1:
 * out is (N, O, ho / 2, wo / 2), the max of each 2x2 window at stride 2; out_h, out_w
 * are then ho, wo and the outputs go to (y, x)). Returns 0, or 1 when memory ran out
 * (out is then incomplete). */
int conv2d_forward_f32(const float *x, const float *filter, const float *bias,
                       const float *residual, float *out, const int64_t *dims, int64_t threads)
{
    if (pointwise(dims)) return pointwise_forward(x, filter, bias, residual, out, dims, threads);
    conv_t a = {.x = x, .filter = filter, .bias = bias, .residual = residual, .out = out};
    setup(&a, dims);
    if (!a.koff) return 1;
    if (a.pooling) a.pooled = out, a.out = NULL;
    if (!vector_tables(&a)) { free(a.koff); return 1; }
    threads = threads < 1 ? 1 : threads;
    a.slices = a.n >= threads ? 1 : (threads + a.n - 1) / a.n;   /* few images: split O */
    if (a.slices > a.nblk) a.slices = a.nblk;
    a.units = a.n * a.slices;
    threads = clamp_threads(threads, a.units);
    int64_t next = 0;
    job_t jobs[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++) jobs[t] = (job_t){.a = &a, .next = &next};
    int failed = run_jobs(forward_job, jobs, threads);
    free(a.vbase);
    free(a.koff);
    return failed;
}

#include "conv_filter_grad.h"
#include "conv_winograd.h"
#include "conv_nhwc.h"
#include "conv_separable.h"
