/* Winograd's F(4x4, 3x3) for conv_native.c (included there, so it shares its library
 * and thread pool): float32 3x3 convolutions of stride 1 and dilation 1, any padding,
 * NCHW or NHWC (channels last), with fused_conv2d's epilogue. The contract is
 * conv_native.py's.
 *
 * The outputs fall into tiles of 4x4, each computed from the 6x6 window of padded
 * input above it: V = B' d B per input channel, M = sum over channels of U . V
 * (elementwise, 36 products; U = G g G' is the filter's transform, made once per
 * call), Y = A' M A (Lavin and Gray's matrices, points 0, +-1, +-2). That is 36
 * multiplies per tile and channel pair where the direct conv makes 144. The 36
 * sums over channels are 36 small products of matrices, (tiles x C) times
 * (C x O), one per position of the 6x6 transform.
 *
 * Each thread takes groups of images (enough that small images fill a block of
 * tiles) from a shared counter. It copies each image into a zero-bordered buffer
 * with the channels innermost (padded to 8, so a position's values for 8 channels
 * are one vector; NCHW is transposed on the way in, NHWC copied row by row), then,
 * per block of WG_TB tiles: transforms the input (vectors of 16 channels with AVX-512,
 * the last 8 of a count not a multiple of 16 and all of them elsewhere in vectors of
 * 8), multiplies (WG_TM tiles by two vectors of VL output channels in registers, or
 * one where O <= VL; native_simd.h's VL: 16 with AVX-512, else 8), transforms the
 * outputs (in vectors of VL channels) into a buffer, channels innermost; the epilogue (bias, residual, relu) runs as that
 * buffer is turned into NCHW (or copied out as NHWC). Tiles whose inputs span too
 * wide a range for the transforms (conv_winograd_range.h) are computed directly
 * instead. Every output is summed by one thread in one order, so the results do not
 * depend on the number of threads. With pool (NCHW), an image's outputs go to the
 * thread's own planes, then their 2x2 maxima to out (pool_planes, conv_pool.h). */

/* a register block of the products: WG_TM tiles by two vectors of VL output channels
 * (native_simd.h: 24 of AVX-512's 32 registers, 12 of AVX2's 16), or by one vector
 * where O <= VL */
#define WG_TM (VL == 16 ? 12 : 6)
#define WG_TB 12         /* tiles per block (a multiple of WG_TM) */

typedef struct {
    const float *x, *bias, *residual, *filter;
    float *out, *u;                       /* u: [36][cp][op], the filter's transform */
    float *pooled;                        /* pool: the pooled out (then out: a thread's) */
    float *wt;                            /* [9][cp][op]: the filter of direct tiles, made
                                             when the first one needs it (under `lock`) */
    pthread_mutex_t lock;
    int64_t n, c, h, w, o, ph, pw, ho, wo, relu, nhwc, x_row, x_image, pooling;
    int64_t cp, op, th, tw, tiles, hb, wb, group, units;
    int64_t buf_size, y_size, mag_size;   /* per image of a group */
    float range, gmax;                    /* see conv_winograd_range.h */
    int64_t direct_tiles;
} wg_t;

typedef struct {
    wg_t *a;
    int64_t *next;
    int failed;
} wg_job_t;

#include "conv_winograd_transforms.h"

/* U = G g G' for every (output, input) channel pair, into a->u (zeros past o, c):
 * eight output channels at a time, one per lane; a->gmax = the largest |g|. Returns 0,
 * or 1 when the filter holds a NaN or an infinity (the transforms would spread it to
 * outputs the direct convolution leaves finite). */
static int wg_filter(wg_t *a, const float *filter)
{
    int64_t step = a->cp * a->op, total = a->o * a->c * 9, e = 0;
    const v8i magnitude = (v8i){0} + 0x7fffffff;
    v8 most = {0};
    v8i bad = {0};
    for (; e + 8 <= total; e += 8) {                   /* |g|, eight at a time */
        v8 v = (v8)((v8i)load(filter + e) & magnitude);
        bad |= ~(v <= __FLT_MAX__);                    /* NaN or inf */
        v8i more = v > most;
        most = (v8)(((v8i)v & more) | ((v8i)most & ~more));
    }
    float largest = 0.0f;
    for (int l = 0; l < 8; l++) {
        if (bad[l]) return 1;
        largest = most[l] > largest ? most[l] : largest;
    }
    for (; e < total; e++) {
        float v = __builtin_fabsf(filter[e]);
        if (!(v <= __FLT_MAX__)) return 1;
        largest = v > largest ? v : largest;
    }
    a->gmax = largest;
    for (int64_t o0 = 0; o0 < a->o; o0 += 8)
        for (int64_t ci = 0; ci < a->c; ci++) {
            v8 g[3][3], t[6][3], row[3], out[6];
            for (int i = 0; i < 3; i++)
                for (int j = 0; j < 3; j++)
                    for (int l = 0; l < 8; l++)
                        g[i][j][l] = o0 + l < a->o
                            ? filter[((o0 + l) * a->c + ci) * 9 + 3 * i + j] : 0.0f;
            for (int j = 0; j < 3; j++) {                        /* G g, by columns */
                v8 col[3] = {g[0][j], g[1][j], g[2][j]}, tc[6];
                wg_g(col, tc);
                for (int i = 0; i < 6; i++) t[i][j] = tc[i];
            }
            float *u = a->u + ci * a->op + o0;
            for (int i = 0; i < 6; i++) {                        /* (G g) G' */
                for (int j = 0; j < 3; j++) row[j] = t[i][j];
                wg_g(row, out);
                for (int j = 0; j < 6; j++) *(v8u *)(u + (6 * i + j) * step) = out[j];
            }
        }
    return 0;
}

#include "conv_winograd_io.h"
#include "conv_winograd_range.h"

/* V of the group's tiles t0 .. t0 + nb - 1 (tile t: image t / tiles of the group's
 * buffers): v[(xi TB + b) cp + ci]. */
static void wg_input(const wg_t *a, const float *bufs, int64_t t0, int64_t nb, float *v)
{
    int64_t step = WG_TB * a->cp;
    for (int64_t b = 0; b < nb; b++) {
        int64_t img = (t0 + b) / a->tiles, t = (t0 + b) % a->tiles;
        int64_t ty = t / a->tw, tx = t % a->tw;
        const float *p = bufs + img * a->buf_size + (4 * ty * a->wb + 4 * tx) * a->cp;
        int64_t c8 = 0;
#if VL == 16
        for (; c8 + 16 <= a->cp; c8 += 16) wg_in16(p + c8, a->wb, a->cp, v + b * a->cp + c8, step);
#endif
        for (; c8 < a->cp; c8 += 8) wg_in8(p + c8, a->wb, a->cp, v + b * a->cp + c8, step);
    }
}

/* One register block of wg_multiply: tiles b0 .. b0 + ROWS - 1 (ROWS <= WG_TM) by VO
 * vectors of output channels from o0, at position xi. */
static inline __attribute__((always_inline)) void wg_block(const wg_t *a, const float *v,
                                                           float *m, int64_t xi, int64_t o0,
                                                           int64_t b0, const int VO,
                                                           const int ROWS)
{
    vf acc[WG_TM][2];
#pragma GCC unroll 12
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = (vf){0};
    const int64_t cp = a->cp, op = a->op, c = a->c;
    const float *vr = v + (xi * WG_TB + b0) * cp;
    const float *ur = a->u + xi * cp * op + o0;
    for (int64_t ci = 0; ci < c; ci++) {
        vf u0 = vf_load(ur + ci * op), u1 = VO > 1 ? vf_load(ur + ci * op + VL) : u0;
#pragma GCC unroll 12                       /* the whole block in registers */
        for (int r = 0; r < ROWS; r++) {
            float s = vr[r * cp + ci];
            acc[r][0] += s * u0;
            if (VO > 1) acc[r][1] += s * u1;
        }
    }
    float *mr = m + (xi * WG_TB + b0) * op + o0;
    for (int r = 0; r < ROWS; r++)
        for (int j = 0; j < VO; j++) vf_store(mr + r * op + VL * j, acc[r][j]);
}

/* The register blocks of tiles b0 .. nb - 1: of WG_TM tiles, the last of a third or two
 * thirds of that where fewer are left (a 16x16 image's 16 tiles: 12 + 4, not 12 + 12
 * with 8 computed for nothing). */
static inline __attribute__((always_inline)) void wg_blocks(const wg_t *a, const float *v,
                                                            float *m, int64_t xi, int64_t o0,
                                                            int64_t nb, const int VO)
{
    for (int64_t b0 = 0; b0 < nb; b0 += WG_TM) {
        int64_t left = nb - b0;
        if (left > 2 * WG_TM / 3)
            wg_block(a, v, m, xi, o0, b0, VO, WG_TM);
        else if (left > WG_TM / 3)
            wg_block(a, v, m, xi, o0, b0, VO, 2 * WG_TM / 3);
        else
            wg_block(a, v, m, xi, o0, b0, VO, WG_TM / 3);
    }
}

/* m[(xi TB + b) op + oc] = sum over ci of v[(xi TB + b) cp + ci] u[(xi cp + ci) op + oc],
 * for the tiles of the block rounded up to a third of WG_TM (the rows past nb are not
 * read). */
static __attribute__((noinline)) void wg_multiply(const wg_t *a, const float *v, int64_t nb,
                                                  float *m)
{
    int one = a->o <= VL;
    for (int64_t xi = 0; xi < 36; xi++)
        for (int64_t o0 = 0; o0 < a->op; o0 += (one ? 1 : 2) * VL) {
            if (one)
                wg_blocks(a, v, m, xi, o0, nb, 1);
            else
                wg_blocks(a, v, m, xi, o0, nb, 2);
        }
}

/* Y = A' M A of the block's tiles into the group's output buffers (4 th x 4 tw
 * positions of op channels per image). */
static void wg_output(const wg_t *a, const float *m, int64_t t0, int64_t nb, float *ys)
{
    int64_t step = WG_TB * a->op, row = 4 * a->tw * a->op;
    for (int64_t b = 0; b < nb; b++) {
        int64_t img = (t0 + b) / a->tiles, t = (t0 + b) % a->tiles;
        int64_t ty = t / a->tw, tx = t % a->tw;
        float *q = ys + img * a->y_size + (4 * ty * 4 * a->tw + 4 * tx) * a->op;
        int64_t o8 = 0;
#if VL == 16
        for (; o8 + 16 <= a->op; o8 += 16) wg_out16(m + b * a->op + o8, step, q + o8, row, a->op);
#endif
        for (; o8 < a->op; o8 += 8) wg_out8(m + b * a->op + o8, step, q + o8, row, a->op);
    }
}

/* a's sizes from dims (n c h w o ph pw ho wo relu nhwc x_row x_image range pool) for
 * `threads` threads (clamped). */
static int64_t wg_setup(wg_t *a, const int64_t *dims, int64_t threads)
{
    a->n = dims[0]; a->c = dims[1]; a->h = dims[2]; a->w = dims[3]; a->o = dims[4];
    a->ph = dims[5]; a->pw = dims[6]; a->ho = dims[7]; a->wo = dims[8]; a->relu = dims[9];
    a->nhwc = dims[10]; a->x_row = dims[11]; a->x_image = dims[12];
    a->range = (float)dims[13];
    a->pooling = dims[14];
    a->cp = (a->c + 7) / 8 * 8;
    int64_t ov = (a->o <= VL ? 1 : 2) * VL;                /* wg_multiply's channels */
    a->op = (a->o + ov - 1) / ov * ov;
    a->th = (a->ho + 3) / 4;
    a->tw = (a->wo + 3) / 4;
    a->tiles = a->th * a->tw;
    a->hb = 4 * a->th + 2;
    a->wb = 4 * a->tw + 2;
    a->buf_size = a->hb * a->wb * a->cp + 8;
    a->y_size = 16 * a->tiles * a->op;
    a->mag_size = a->hb * a->wb + a->hb * 4 * a->tw + a->tiles * 16;  /* wg_fields' */
    threads = threads < 1 ? 1 : threads;
    a->group = a->tiles < WG_TB ? WG_TB / a->tiles : 1;   /* small images share blocks */
    if (a->group > (a->n + threads - 1) / threads) a->group = (a->n + threads - 1) / threads;
    if (a->group < 1) a->group = 1;
    a->units = (a->n + a->group - 1) / a->group;
    return clamp_threads(threads, a->units);
}

/* Floats of one thread's buffers. */
static int64_t wg_thread_floats(const wg_t *a)
{
    return a->group * (a->buf_size + a->y_size + a->mag_size) + 36 * WG_TB * (a->cp + a->op)
           + 16 + (a->pooling ? a->o * a->ho * a->wo : 0);
}

static void *wg_job(void *p)
{
    wg_job_t *job = p;
    wg_t *a = job->a;
    int64_t bufs = a->group * a->buf_size, v_size = 36 * WG_TB * a->cp + 8;
    int64_t m_size = 36 * WG_TB * a->op + 8, y_all = a->group * a->y_size, direct = 0;
    float *buf = calloc(wg_thread_floats(a), sizeof(float));
    if (!buf) { job->failed = 1; return NULL; }
    float *v = buf + bufs, *m = v + v_size, *y = m + m_size, *mags = y + y_all;
    wg_t image_out = *a;               /* pool: an image's outputs to this thread's planes */
    image_out.out = mags + a->group * a->mag_size;
    int64_t plane = a->ho * a->wo;
    for (int64_t u; (u = __atomic_fetch_add(job->next, 1, __ATOMIC_RELAXED)) < a->units;) {
        int64_t first = u * a->group;
        int64_t count = a->n - first < a->group ? a->n - first : a->group;
        int check[WG_TB];                       /* a->group <= WG_TB */
        for (int64_t g = 0; g < count; g++) {
            float *image = buf + g * a->buf_size, *mag = mags + g * a->mag_size;
            if (a->nhwc) {
                wg_fill_nhwc(a, first + g, image);
                wg_squares(a, image, mag);
            } else {
                wg_fill(a, first + g, image, mag);
            }
            check[g] = wg_fields(a, mag);
        }
        for (int64_t t0 = 0; t0 < count * a->tiles; t0 += WG_TB) {
            int64_t nb = count * a->tiles - t0 < WG_TB ? count * a->tiles - t0 : WG_TB;
            wg_input(a, buf, t0, nb, v);
            wg_multiply(a, v, nb, m);
            wg_output(a, m, t0, nb, y);
            int64_t wide = wg_direct_tiles(a, buf, mags, check, t0, nb, y);
            if (wide < 0) { job->failed = 1; break; }
            direct += wide;
        }
        for (int64_t g = 0; g < count; g++) {
            if (!a->pooling) {
                (a->nhwc ? wg_store_nhwc : wg_store)(a, y + g * a->y_size, first + g);
                continue;
            }
            if (a->residual) image_out.residual = a->residual + (first + g) * a->o * plane;
            wg_store(&image_out, y + g * a->y_size, 0);
            float *to = a->pooled + (first + g) * a->o * (a->ho / 2) * (a->wo / 2);
            pool_planes(image_out.out, to, 0, a->o, a->ho, a->wo);
        }
    }
    __atomic_fetch_add(&a->direct_tiles, direct, __ATOMIC_RELAXED);
    free(buf);
    return NULL;
}

/* Bytes conv2d_winograd_f32 allocates for dims on `threads` threads: the filter's
 * transform and each thread's buffers. */
int64_t conv2d_winograd_scratch(const int64_t *dims, int64_t threads)
{
    wg_t a;
    threads = wg_setup(&a, dims, threads);
    return (int64_t)sizeof(float) * (36 * a.cp * a.op + threads * wg_thread_floats(&a));
}

/* Floats of a filter's prepared transform for dims (conv2d_winograd_filter): U, then
 * the filter's largest magnitude. */
int64_t conv2d_winograd_filter_floats(const int64_t *dims)
{
    wg_t a;
    wg_setup(&a, dims, 1);
    return 36 * a.cp * a.op + 1;
}

/* The transform of `filter` for dims into u (conv2d_winograd_filter_floats(dims) floats,
 * zeroed by the caller), for conv2d_winograd_f32's `prepared`: a filter that does not
 * change (an inference net's) is transformed once. Returns 0, or 2 (u not to be used)
 * when the filter holds a NaN or an infinity. */
int conv2d_winograd_filter(const float *filter, const int64_t *dims, float *u)
{
    wg_t a = {.filter = filter, .u = u};
    wg_setup(&a, dims, 1);
    if (wg_filter(&a, filter)) return 2;
    u[36 * a.cp * a.op] = a.gmax;
    return 0;
}

/* dims: n c h w o ph pw ho wo relu nhwc x_row x_image range pool (a 3x3 filter, stride
 * and dilation 1; out is (N, O, ho, wo), or (N, ho, wo, O) with nhwc, whose x's rows and
 * images are x_row and x_image floats apart; range: conv_winograd_range.h; pool (NCHW
 * only): out is (N, O, ho / 2, wo / 2), the max of each 2x2 window at stride 2). prepared:
 * the filter's transform (conv2d_winograd_filter), or NULL to make it here. Returns 0;
 * 1 when memory ran out (out is then incomplete); 2, with nothing written, when the
 * filter holds a NaN or an infinity (the caller runs the direct kernel). *direct_tiles
 * (when not NULL): how many tiles were computed directly. */
int conv2d_winograd_f32(const float *x, const float *filter, const float *bias,
                        const float *residual, float *out, const int64_t *dims,
                        int64_t threads, int64_t *direct_tiles, const float *prepared)
{
    wg_t a = {.x = x, .bias = bias, .residual = residual, .out = out, .filter = filter};
    threads = wg_setup(&a, dims, threads);
    if (a.pooling) a.pooled = out, a.out = NULL;
    if (prepared) {
        a.u = (float *)prepared;                 /* read only, like a fresh one */
        a.gmax = prepared[36 * a.cp * a.op];
    } else {
        a.u = calloc(36 * a.cp * a.op, sizeof(float));
        if (!a.u) return 1;
        if (wg_filter(&a, filter)) { free(a.u); return 2; }
    }
    pthread_mutex_init(&a.lock, NULL);
    int64_t next = 0;
    wg_job_t jobs[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++) jobs[t] = (wg_job_t){.a = &a, .next = &next};
    pool_run(wg_job, jobs, sizeof(wg_job_t), threads);
    int failed = 0;
    for (int64_t t = 0; t < threads; t++) failed |= jobs[t].failed;
    pthread_mutex_destroy(&a.lock);
    if (direct_tiles) *direct_tiles = a.direct_tiles;
    free(a.wt);
    if (!prepared) free(a.u);
    return failed;
}
