/* The native CPU kernels of depthwise convolutions: float32 NCHW conv2d whose groups
 * equal its input channels (each output channel o reads input channel o / m alone, m =
 * O / C the channel multiplier), any kernel size, stride, padding and dilation - the
 * forward pass (with fused_conv2d's bias, residual and relu), the input gradient and
 * the filter gradient. Built by native.py, launched by conv_depthwise.py; the numpy
 * engine (conv_im2col.py, conv_im2col_grad.py) is the reference they are tested against.
 *
 * Each input plane is first copied into a zeroed buffer of its padded rows, each row
 * split in `sw` phases (the columns p, p + sw, ...): tap k of a window at output column
 * q then reads phase (k dw) % sw at q + (k dw) / sw, so every tap is a contiguous
 * vector load whatever the stride, and padding is zeros already there. The output
 * (and dx) rows are computed R = 4 rows at a time, one vector of VL columns per row:
 * four independent chains of multiply-adds, in tap order from 0.
 *
 * dx is gathered, not scattered: row y of dx (padded row Y = y + ph) takes tap row i
 * from dout row (Y - i dh) / sh where that divides, and its column phase p (padded
 * columns X = p + sw t) tap k from dout column t - (k dw - p) / sw where that divides;
 * dout's rows are copied with zeros around so that reads past its edges are zeros,
 * and the phases are interleaved into dx's row after (sw > 1).
 *
 * dfilter sums, per channel, over images, rows and columns in that order, VL lanes
 * side by side, the lanes added at the end. Threads: forward and dx split the (image,
 * input channel) planes, dfilter the input channels, in contiguous ranges
 * (native_pool.h); each result is computed by one thread in one way, so results do not
 * depend on the number of threads. Each returns 0, or 1 where a buffer could not be
 * allocated (nothing is written then by the threads that failed). Channels-last convs:
 * conv_depthwise_nhwc.h (included at the end). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_pool.h"
#include "native_simd.h"

#define R 4                     /* output rows computed together */

typedef struct {
    int64_t n, c, h, w, o, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo, relu, m;
    int64_t rows, ws;           /* the input buffer: padded rows read, floats a phase row */
    int64_t tr, drows, lp, wd;  /* dout's buffer: zero rows above, rows, zeros left, width */
    int64_t wt;                 /* dx's phase rows (sw > 1): floats each */
    int64_t *table;             /* what geometry() works out once for every plane: */
    int64_t *span;              /* per phase p: where x's columns go (t0, x column, count) */
    int64_t *ktaps, *kcount;    /* dx: per phase p, kcount[p] pairs (k, dout column shift) */
    int64_t *itaps, *icount;    /* dx: per row residue a, icount[a] pairs (i, dout row) */
} geo_t;

typedef struct {
    const geo_t *g;
    const float *x, *w, *bias, *res, *d;
    float *out;
    int64_t begin, end;
    int failed;
} job_t;

static int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

static geo_t geometry(const int64_t *d)
{
    geo_t g = {d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7], d[8], d[9], d[10], d[11],
               d[12], d[13], d[14], d[15], d[4] / d[1]};
    g.rows = (g.ho - 1) * g.sh + (g.kh - 1) * g.dh + 1;
    g.ws = round_up(g.wo, VL) + (g.kw - 1) * g.dw / g.sw;
    int64_t above = (g.kh - 1) * g.dh - g.ph;
    g.tr = above > 0 ? (above + g.sh - 1) / g.sh : 0;
    g.drows = (g.ph + g.h - 1 + g.tr * g.sh) / g.sh + 1;
    if (g.drows < g.tr + g.ho) g.drows = g.tr + g.ho;
    g.wt = (g.pw + g.w + g.sw - 1) / g.sw;
    g.lp = (g.kw - 1) * g.dw;
    g.wd = g.lp + g.pw + round_up(g.w > g.wt ? g.w : g.wt, VL) + VL;
    g.table = malloc((size_t)(3 * g.sw + 2 * g.sw * g.kw + g.sw + 2 * g.sh * g.kh + g.sh)
                     * sizeof(int64_t));
    if (!g.table) return g;
    g.span = g.table;
    g.ktaps = g.span + 3 * g.sw;
    g.kcount = g.ktaps + 2 * g.sw * g.kw;
    g.itaps = g.kcount + g.sw;
    g.icount = g.itaps + 2 * g.sh * g.kh;
    for (int64_t p = 0; p < g.sw; p++) {
        int64_t t0 = p >= g.pw ? 0 : (g.pw - p + g.sw - 1) / g.sw, col = p + g.sw * t0 - g.pw;
        int64_t count = col < g.w && t0 < g.ws ? (g.w - 1 - col) / g.sw + 1 : 0;
        g.span[3 * p] = t0;
        g.span[3 * p + 1] = col;
        g.span[3 * p + 2] = count > g.ws - t0 ? g.ws - t0 : count;
        g.kcount[p] = 0;
        for (int64_t k = 0; k < g.kw; k++) {
            const int64_t e = k * g.dw - p;      /* padded column p + sw t reads t - e / sw */
            if (e < 0 || e % g.sw) continue;
            g.ktaps[2 * (p * g.kw + g.kcount[p])] = k;
            g.ktaps[2 * (p * g.kw + g.kcount[p]) + 1] = e / g.sw;
            g.kcount[p]++;
        }
    }
    for (int64_t a = 0; a < g.sh; a++) {
        g.icount[a] = 0;
        for (int64_t i = 0; i < g.kh; i++) {
            const int64_t from = a + g.ph - i * g.dh + g.tr * g.sh;    /* >= 0 */
            if (from % g.sh) continue;
            g.itaps[2 * (a * g.kh + g.icount[a])] = i;
            g.itaps[2 * (a * g.kh + g.icount[a]) + 1] = from / g.sh;
            g.icount[a]++;
        }
    }
    return g;
}

/* dst[0 .. count) = src[0 .. count), a vector at a time. */
static inline void copy_row(float *dst, const float *src, int64_t count)
{
    int64_t i = 0;
    for (; i + VL <= count; i += VL) vf_store(dst + i, vf_load(src + i));
    if (i < count) vf_store_part(dst + i, vf_load_part(src + i, count - i), count - i);
}

/* even[i] = src[2 i] (i < ne) and odd[i] = src[2 i + 1] (i < no), in one pass. */
static void split_pairs(float *restrict even, float *restrict odd, const float *restrict src,
                        int64_t ne, int64_t no)
{
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                            28, 30);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
    for (; i + 16 <= ne && i + 16 <= no; i += 16) {
        const __m512 lo = _mm512_loadu_ps(src + 2 * i), hi = _mm512_loadu_ps(src + 2 * i + 16);
        _mm512_storeu_ps(even + i, _mm512_permutex2var_ps(lo, evens, hi));
        _mm512_storeu_ps(odd + i, _mm512_permutex2var_ps(lo, odds, hi));
    }
    const int64_t re = ne - i, ro = no - i, reads = 2 * re - 1 > 2 * ro ? 2 * re - 1 : 2 * ro;
    if (reads > 0 && re <= 16 && ro <= 16) {     /* the last pairs: masked, src read no further */
        const __m512 lo = _mm512_maskz_loadu_ps(
            (__mmask16)(reads >= 16 ? 0xFFFFu : (1u << reads) - 1), src + 2 * i);
        const __m512 hi = _mm512_maskz_loadu_ps(
            (__mmask16)(reads > 16 ? (1u << (reads - 16)) - 1 : 0), src + 2 * i + 16);
        _mm512_mask_storeu_ps(even + i, (__mmask16)((1u << re) - 1),
                              _mm512_permutex2var_ps(lo, evens, hi));
        _mm512_mask_storeu_ps(odd + i, (__mmask16)((1u << ro) - 1),
                              _mm512_permutex2var_ps(lo, odds, hi));
        return;
    }
#endif
    for (int64_t e = i; e < ne; e++) even[e] = src[2 * e];
    for (; i < no; i++) odd[i] = src[2 * i + 1];
}

/* Plane `x` (h, w) into buf's interior: padded row Y, phase p, column t holds x[Y - ph]
 * [p + sw t - pw] where that is inside x (the rest of buf stays as zeroed). */
static void fill_input(const geo_t *g, const float *x, float *buf)
{
    for (int64_t yy = 0; yy < g->h; yy++) {
        int64_t Y = yy + g->ph;
        if (Y >= g->rows) break;
        if (g->sw == 2) {        /* x's even columns to phase pw % 2, its odd ones to the other */
            const int64_t te = g->pw / 2, to = (g->pw + 1) / 2;
            int64_t ne = (g->w + 1) / 2, no = g->w / 2;
            if (ne > g->ws - te) ne = g->ws - te;
            if (no > g->ws - to) no = g->ws - to;
            float *row = buf + Y * 2 * g->ws;
            split_pairs(row + (g->pw % 2) * g->ws + te, row + (1 - g->pw % 2) * g->ws + to,
                        x + yy * g->w, ne, no);
            continue;
        }
        for (int64_t p = 0; p < g->sw; p++) {
            const int64_t *span = g->span + 3 * p, count = span[2];
            float *dst = buf + (Y * g->sw + p) * g->ws + span[0];
            const float *src = x + yy * g->w + span[1];
            if (g->sw == 1)
                copy_row(dst, src, count);
            else
                for (int64_t t = 0; t < count; t++) dst[t] = src[t * g->sw];
        }
    }
}

/* Where tap (i, k) of output row 0, column 0 reads in the input buffer. */
static void tap_offsets(const geo_t *g, int64_t *off)
{
    for (int64_t i = 0; i < g->kh; i++)
        for (int64_t k = 0; k < g->kw; k++)
            off[i * g->kw + k] = (i * g->dh * g->sw + k * g->dw % g->sw) * g->ws
                                 + k * g->dw / g->sw;
}

static inline vf epilogue(const geo_t *g, vf v, float bias, const float *res, int64_t count)
{
    v += bias;
    if (res) v += count == VL ? vf_load(res) : vf_load_part(res, count);
    return g->relu ? vf_relu(v) : v;
}

/* Output rows r0 .. r0 + rows - 1 (rows <= R) of one plane, from the input buffer. */
static inline __attribute__((always_inline)) void forward_rows(
    const geo_t *g, const float *buf, const int64_t *off, const float *wt, float bias,
    const float *res, float *out, int64_t r0, const int rows)
{
    const int64_t step = g->sh * g->sw * g->ws, taps = g->kh * g->kw;
    for (int64_t q0 = 0; q0 < g->wo; q0 += VL) {
        vf acc[R];
        for (int r = 0; r < rows; r++) acc[r] = (vf){0};
        const float *base = buf + r0 * step + q0;
        for (int64_t t = 0; t < taps; t++) {
            const vf wv = (vf){0} + wt[t];
            for (int r = 0; r < rows; r++) acc[r] += wv * vf_load(base + r * step + off[t]);
        }
        const int64_t count = g->wo - q0 < VL ? g->wo - q0 : VL;
        for (int r = 0; r < rows; r++) {
            const int64_t at = (r0 + r) * g->wo + q0;
            vf v = epilogue(g, acc[r], bias, res ? res + at : NULL, count);
            if (count == VL) vf_store(out + at, v);
            else vf_store_part(out + at, v, count);
        }
    }
}

static void *forward_job(void *arg)
{
    job_t *j = arg;
    const geo_t *g = j->g;
    const int64_t taps = g->kh * g->kw, plane = g->ho * g->wo;
    float *buf = calloc((size_t)(g->rows * g->sw * g->ws + VL), sizeof(float));
    int64_t *off = malloc((size_t)taps * sizeof(int64_t));
    if (!buf || !off) {
        free(buf);
        free(off);
        j->failed = 1;
        return NULL;
    }
    tap_offsets(g, off);
    for (int64_t at = j->begin; at < j->end; at++) {         /* plane (image, channel) */
        const int64_t c = at % g->c;
        fill_input(g, j->x + at * g->h * g->w, buf);
        for (int64_t m = 0; m < g->m; m++) {
            const int64_t o = c * g->m + m, plane_at = (at / g->c * g->o + o) * plane;
            const float *wt = j->w + o * taps, *res = j->res ? j->res + plane_at : NULL;
            const float bias = j->bias ? j->bias[o] : 0.0f;
            float *out = j->out + plane_at;
            int64_t r0 = 0;
            for (; r0 + R <= g->ho; r0 += R) forward_rows(g, buf, off, wt, bias, res, out, r0, R);
            switch (g->ho - r0) {
            case 3: forward_rows(g, buf, off, wt, bias, res, out, r0, 3); break;
            case 2: forward_rows(g, buf, off, wt, bias, res, out, r0, 2); break;
            case 1: forward_rows(g, buf, off, wt, bias, res, out, r0, 1); break;
            }
        }
    }
    free(buf);
    free(off);
    return NULL;
}

static int run(const int64_t *dims, void *(*fn)(void *), int64_t items, const float *x,
               const float *w, const float *bias, const float *res, const float *d,
               float *out, int64_t threads)
{
    geo_t g = geometry(dims);
    if (!g.table) return 1;
    job_t jobs[POOL_MAX_THREADS];
    int64_t parts = pool_parts(threads, items);
    for (int64_t t = 0; t < parts; t++) {
        jobs[t] = (job_t){&g, x, w, bias, res, d, out, 0, 0, 0};
        pool_share(items, parts, t, &jobs[t].begin, &jobs[t].end);
    }
    pool_run(fn, jobs, sizeof(job_t), parts);
    int failed = 0;
    for (int64_t t = 0; t < parts; t++) failed |= jobs[t].failed;
    free(g.table);
    return failed;
}

/* out (N, O, Ho, Wo) = the depthwise conv of x (N, C, H, W) with w (O, 1, kh, kw)
 * (+ bias[o]) (+ res, out's shape) (then relu where dims[15]); dims: n c h w o kh kw
 * sh sw ph pw dh dw ho wo relu. bias and res may be NULL. */
int conv_depthwise_forward(const float *x, const float *w, const float *bias,
                           const float *res, float *out, const int64_t *dims, int64_t threads)
{
    return run(dims, forward_job, dims[0] * dims[1], x, w, bias, res, NULL, out, threads);
}

#include "conv_depthwise_dx.h"

static void *filter_job(void *arg)
{
    job_t *j = arg;
    const geo_t *g = j->g;
    const int64_t taps = g->kh * g->kw, step = g->sh * g->sw * g->ws;
    float *buf = calloc((size_t)(g->rows * g->sw * g->ws + VL), sizeof(float));
    int64_t *off = malloc((size_t)taps * sizeof(int64_t));
    vf *acc = aligned_alloc(sizeof(vf), (size_t)(g->m * taps) * sizeof(vf));
    if (!buf || !off || !acc) {
        free(buf);
        free(off);
        free(acc);
        j->failed = 1;
        return NULL;
    }
    tap_offsets(g, off);
    for (int64_t c = j->begin; c < j->end; c++) {
        for (int64_t t = 0; t < g->m * taps; t++) acc[t] = (vf){0};
        for (int64_t n = 0; n < g->n; n++) {
            fill_input(g, j->x + (n * g->c + c) * g->h * g->w, buf);
            for (int64_t m = 0; m < g->m; m++) {
                const float *d = j->d + (n * g->o + c * g->m + m) * g->ho * g->wo;
                vf *a = acc + m * taps;
                for (int64_t r = 0; r < g->ho; r++)
                    for (int64_t q0 = 0; q0 < g->wo; q0 += VL) {
                        const int64_t count = g->wo - q0 < VL ? g->wo - q0 : VL;
                        const float *src = buf + r * step + q0;
                        if (count == VL) {
                            const vf dv = vf_load(d + r * g->wo + q0);
                            for (int64_t t = 0; t < taps; t++)
                                a[t] += dv * vf_load(src + off[t]);
                        } else {       /* lanes past the row: zeros, never x's values */
                            const vf dv = vf_load_part(d + r * g->wo + q0, count);
                            for (int64_t t = 0; t < taps; t++)
                                a[t] += dv * vf_load_part(src + off[t], count);
                        }
                    }
            }
        }
        for (int64_t t = 0; t < g->m * taps; t++) {
            float sum = 0.0f;
            for (int l = 0; l < VL; l++) sum += acc[t][l];
            j->out[c * g->m * taps + t] = sum;
        }
    }
    free(buf);
    free(off);
    free(acc);
    return NULL;
}

/* dw (O, 1, kh, kw) of the depthwise conv of `dims` for input x and dout d. */
int conv_depthwise_filter_grad(const float *x, const float *d, float *dw, const int64_t *dims,
                               int64_t threads)
{
    return run(dims, filter_job, dims[1], x, NULL, NULL, NULL, d, dw, threads);
}


#include "conv_depthwise_nhwc.h"
