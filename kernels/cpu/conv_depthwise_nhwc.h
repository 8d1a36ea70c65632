/* Channels-last (NHWC) depthwise convs for conv_depthwise.c (included there, after its
 * NCHW kernels; conv_depthwise.py holds the contract). A forward pass of channel
 * multiplier 1 reads x (N, H, W, C) as it lies: the C values of a pixel are side by
 * side, so a vector holds VL channels of one pixel, and a tile is NT output pixels of
 * a row by one vector of channels, NT independent chains of multiply-adds over the
 * taps in the NCHW kernel's order (i, then k), a tap outside x adding the filter value
 * times zero as the NCHW kernel's zeroed border does, then its epilogue: the NCHW
 * kernel's operations on the same values, so the two give the same bits. Each thread
 * takes a range of (image, output row) units (conv_depthwise.c's run) and transposes
 * the filter to [taps][C] first. Other multipliers, and the gradients, run the NCHW kernels between
 * transposes (conv_depthwise_transpose). */

#define NT 4                    /* output pixels per channels-last tile */

static const float nhwc_zeros[VL] __attribute__((aligned(64)));

static inline vf load_n(const float *p, int64_t count)
{
    return count == VL ? vf_load(p) : vf_load_part(p, count);
}

/* Pixels q0 .. q0 + n - 1 (n <= NT) of output row y of image img, channels c0 ..
 * c0 + count - 1, with the filter transposed to wt [taps][C]. */
static inline __attribute__((always_inline)) void nhwc_tile(
    const job_t *j, const float *wt, int64_t img, int64_t y, int64_t q0, const int n,
    int64_t c0, int64_t count)
{
    const geo_t *g = j->g;
    const int64_t c = g->c, h = g->h, w = g->w, kw = g->kw, sw = g->sw, dw = g->dw;
    const int64_t x0 = q0 * sw - g->pw;
    const float *x = j->x + img * h * w * c + c0;
    vf acc[NT];
    for (int p = 0; p < n; p++) acc[p] = (vf){0};
    const int64_t y0 = y * g->sh - g->ph;
    if (count == VL && y0 >= 0 && y0 + (g->kh - 1) * g->dh < h && x0 >= 0 &&
        x0 + (n - 1) * sw + (kw - 1) * dw < w) {        /* every tap inside x */
        for (int64_t i = 0; i < g->kh; i++) {
            const float *row = x + ((y0 + i * g->dh) * w + x0) * c;
            for (int64_t k = 0; k < kw; k++) {
                const vf wv = vf_load(wt + (i * kw + k) * c + c0);
                for (int p = 0; p < n; p++) acc[p] += wv * vf_load(row + (p * sw + k * dw) * c);
            }
        }
    } else {    /* a tap outside x reads a vector of zeros: the same multiply-add as one
                   inside (GCC did not fuse a multiply-add of a selected zero value) */
        for (int64_t i = 0; i < g->kh; i++) {
            const int64_t iy = y0 + i * g->dh;
            const float *row = iy >= 0 && iy < h ? x + iy * w * c : NULL;
            for (int64_t k = 0; k < kw; k++) {
                const vf wv = load_n(wt + (i * kw + k) * c + c0, count);
                for (int p = 0; p < n; p++) {
                    const int64_t ix = x0 + p * sw + k * dw;
                    acc[p] += wv * load_n(row && ix >= 0 && ix < w ? row + ix * c : nhwc_zeros,
                                          count);
                }
            }
        }
    }
    const vf bias = j->bias ? load_n(j->bias + c0, count) : (vf){0};
    for (int p = 0; p < n; p++) {
        const int64_t at = ((img * g->ho + y) * g->wo + q0 + p) * g->o + c0;
        vf v = acc[p] + bias;
        if (j->res) v += load_n(j->res + at, count);
        if (g->relu) v = vf_relu(v);
        if (count == VL) vf_store(j->out + at, v);
        else vf_store_part(j->out + at, v, count);
    }
}

static void *nhwc_forward_job(void *arg)
{
    job_t *j = arg;
    const geo_t *g = j->g;
    const int64_t taps = g->kh * g->kw;
    float *wt = malloc((size_t)(taps * g->c + VL) * sizeof(float));
    if (!wt) {
        j->failed = 1;
        return NULL;
    }
    for (int64_t c = 0; c < g->c; c++)
        for (int64_t t = 0; t < taps; t++) wt[t * g->c + c] = j->w[c * taps + t];
    for (int64_t u = j->begin; u < j->end; u++) {     /* all channels of a few pixels in
                                                          turn: their windows stay in L1 */
        const int64_t img = u / g->ho, y = u % g->ho;
        int64_t q0 = 0;
        for (; q0 + NT <= g->wo; q0 += NT)
            for (int64_t c0 = 0; c0 < g->c; c0 += VL)
                nhwc_tile(j, wt, img, y, q0, NT, c0, g->c - c0 < VL ? g->c - c0 : VL);
        for (int64_t c0 = 0; c0 < g->c; c0 += VL) {
            const int64_t count = g->c - c0 < VL ? g->c - c0 : VL;
            switch (g->wo - q0) {
            case 3: nhwc_tile(j, wt, img, y, q0, 3, c0, count); break;
            case 2: nhwc_tile(j, wt, img, y, q0, 2, c0, count); break;
            case 1: nhwc_tile(j, wt, img, y, q0, 1, c0, count); break;
            }
        }
    }
    free(wt);
    return NULL;
}

/* out (N, Ho, Wo, C) = the depthwise conv of multiplier 1 of x (N, H, W, C) with w (C,
 * 1, kh, kw) (+ bias[c]) (+ res, out's shape) (then relu where dims[15]); dims as
 * conv_depthwise_forward's (its o equal to its c). */
int conv_depthwise_forward_nhwc(const float *x, const float *w, const float *bias,
                                const float *res, float *out, const int64_t *dims,
                                int64_t threads)
{
    return run(dims, nhwc_forward_job, dims[0] * dims[13], x, w, bias, res, NULL, out,
               threads);
}

/* dst (n, cols, rows) = src (n, rows, cols), each image's matrix transposed: NHWC to
 * NCHW (rows = h w, cols = c) and back (rows = c, cols = h w) for the channels-last
 * entry points (conv_depthwise.py). Blocks of TB x TB values, so that the lines each
 * block reads and writes are used whole while in L1; within a block the values go
 * along the longer side's lines (the TB lines of the other side are then a row or a
 * column of the shorter apart: TB lines 4 KiB apart would share one of L1's sets);
 * each thread takes a range of (image, block of rows) units. */
#define TB 16

typedef struct {
    const float *src;
    float *dst;
    int64_t rows, cols, blocks, begin, end;
} transpose_job_t;

static void *transpose_job(void *arg)
{
    const transpose_job_t *j = arg;
    const int64_t rows = j->rows, cols = j->cols;
    for (int64_t u = j->begin; u < j->end; u++) {
        const int64_t i0 = u % j->blocks * TB, i1 = i0 + TB < rows ? i0 + TB : rows;
        const float *restrict s = j->src + u / j->blocks * rows * cols;
        float *restrict d = j->dst + u / j->blocks * rows * cols;
        for (int64_t c0 = 0; c0 < cols; c0 += TB) {
            const int64_t c1 = c0 + TB < cols ? c0 + TB : cols;
            if (cols <= rows)       /* the side read or written across lines: the shorter */
                for (int64_t c = c0; c < c1; c++)
                    for (int64_t i = i0; i < i1; i++) d[c * rows + i] = s[i * cols + c];
            else
                for (int64_t i = i0; i < i1; i++)
                    for (int64_t c = c0; c < c1; c++) d[c * rows + i] = s[i * cols + c];
        }
    }
    return NULL;
}

void conv_depthwise_transpose(const float *src, float *dst, int64_t n, int64_t rows,
                              int64_t cols, int64_t threads)
{
    const int64_t blocks = (rows + TB - 1) / TB, units = n * blocks;
    transpose_job_t jobs[POOL_MAX_THREADS];
    const int64_t parts = pool_parts(threads, units);
    for (int64_t t = 0; t < parts; t++) {
        jobs[t] = (transpose_job_t){src, dst, rows, cols, blocks, 0, 0};
        pool_share(units, parts, t, &jobs[t].begin, &jobs[t].end);
    }
    pool_run(transpose_job, jobs, sizeof(transpose_job_t), parts);
}
