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

#include "conv_depthwise_rows.h"

typedef struct {
    const geo_t *g;
    const float *x, *w, *bias, *res, *d;
    float *out;
    int64_t begin, end;
    int failed;
} job_t;

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
        const int64_t image = at / g->c * g->o * plane;
        forward_plane(g, buf, off, j->x + at * g->h * g->w, j->w, j->bias,
                      j->res ? j->res + image : NULL, j->out + image, at % g->c);
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
