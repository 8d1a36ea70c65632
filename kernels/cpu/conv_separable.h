/* The separable kernel of conv_native.c (included at its end; fused_separable_conv2d,
 * MobileNet's blocks): a depthwise conv (with its bias and relu) and then a pointwise
 * conv (conv_pointwise.h, with its bias, residual and relu), image by image. A thread
 * computes an image's depthwise outputs in buffers of its own (in cache) as the
 * pointwise kernel's panels and runs its tiles on them, so the depthwise outputs never
 * go to memory: in the two kernels one after the other they are written out in full
 * and read back. Both steps do the two kernels' operations on the same values, so the
 * result has their bits. Threads take whole images.
 *
 * With one output channel an input channel (MobileNet's) the depthwise conv runs on
 * channel vectors: VL channels of a pixel in a vector, so each tap of a pixel is one
 * multiply-add of input vector and weight vector, whatever the plane's width and
 * stride. A block of VL channels of the image is transposed into a zero-bordered
 * buffer of such vectors (fill_vectors), convolved a few pixels of a row at a time
 * (dw_vectors) and transposed again into the panels (pack_vectors). Each output sums
 * its taps in order from the same values, the border's zeros included, then adds its
 * bias and takes the relu: the bits of conv_depthwise.c's forward_plane
 * (conv_depthwise_rows.h), which the kernel runs otherwise, a plane at a time on rows
 * of pixels (stride 2 split into phases), then packing the planes: on the mobile net's
 * four blocks, slower (cycles a block: docs/performance.md, nets_cpu's mobile net). */
#include "conv_depthwise_rows.h"

typedef struct {
    const geo_t *g;             /* the depthwise conv */
    const conv_t *a;            /* the pointwise conv (x unset: a thread's copy of it
                                   reads the thread's planes) */
    const float *x, *dw_filter, *dw_bias, *packed;
    const float *taps, *biases; /* vector_weights' (NULL: forward_plane runs) */
    int64_t *next;
    int failed;
} separable_job_t;

/* The depthwise filter (C, 1, kh, kw) as kh kw vectors of taps per block of VL
 * channels, then the bias (or zeros) as a vector per block; lanes past C zeros. NULL
 * when memory ran out. */
static float *vector_weights(const geo_t *g, const float *filter, const float *bias)
{
    const int64_t blocks = (g->c + VL - 1) / VL, taps = g->kh * g->kw;
    float *w = calloc((size_t)(blocks * (taps + 1) * VL), sizeof(float));
    if (!w) return NULL;
    for (int64_t c = 0; c < g->c; c++) {
        for (int64_t t = 0; t < taps; t++)
            w[((c / VL) * taps + t) * VL + c % VL] = filter[c * taps + t];
        w[(blocks * taps + c / VL) * VL + c % VL] = bias ? bias[c] : 0.0f;
    }
    return w;
}

/* r[0 .. count) to `to`, `apart` floats apart (all VL unrolled: as a loop of `count`,
 * GCC made it a call to memcpy). */
static inline __attribute__((always_inline)) void store_vectors(float *to, int64_t apart,
                                                                const vf r[VL], int64_t count)
{
    if (count == VL)
        for (int j = 0; j < VL; j++) vf_store(to + j * apart, r[j]);
    else
        for (int j = 0; j < count; j++) vf_store(to + j * apart, r[j]);
}

/* Channels cb VL .. of image x (C, H, W) into buf's interior as channel vectors
 * (lanes past C zeros): padded row Y, column X (wp columns a row) holds x[.][Y - ph]
 * [X - pw]. The border, zeroed once, is never written. */
static void fill_vectors(const geo_t *g, const float *x, int64_t cb, int64_t wp, float *buf)
{
    const int64_t plane = g->h * g->w, lanes = g->c - cb * VL < VL ? g->c - cb * VL : VL;
    for (int64_t y = 0; y < g->h && y + g->ph < g->rows; y++)
        for (int64_t x0 = 0; x0 < g->w && g->pw + x0 < wp; x0 += VL) {
            const int64_t n = g->w - x0 < VL ? g->w - x0 : VL;
            const int64_t keep = wp - g->pw - x0 < n ? wp - g->pw - x0 : n;
            const float *from = x + cb * VL * plane + y * g->w + x0;
            vf r[VL];
            if (lanes == VL && n == VL)
                for (int j = 0; j < VL; j++) r[j] = vf_load(from + j * plane);
            else
                for (int j = 0; j < VL; j++)
                    r[j] = j < lanes ? vf_load_part(from + j * plane, n) : (vf){0};
            vf_transpose(r);
            float *to = buf + ((y + g->ph) * wp + g->pw + x0) * VL;
            store_vectors(to, VL, r, keep);
        }
}

/* J output pixels `step` floats apart in buf from `in`: their taps (weights wt, offsets
 * off) in order, then + bias, then relu where the conv has it, to out (J vectors). */
static inline __attribute__((always_inline)) void dw_pixels(
    const geo_t *g, const float *in, const int64_t step, const float *wt, const int64_t *off,
    vf bias, float *out, const int J)
{
    vf acc[J];
    for (int j = 0; j < J; j++) acc[j] = (vf){0};
    for (int64_t t = 0; t < g->kh * g->kw; t++) {
        const vf wv = vf_load(wt + t * VL);
        const float *at = in + off[t];
        __asm__("" : "+r"(at));    /* else GCC keeps J indices in registers, spilling */
        for (int j = 0; j < J; j++) acc[j] += wv * vf_load(at + j * step);
    }
    for (int j = 0; j < J; j++) {
        const vf v = acc[j] + bias;
        vf_store(out + j * VL, g->relu ? vf_relu(v) : v);
    }
}

/* All Ho rows of the channel block in buf, 8 pixels at a time, then 4, 2, 1 (`step`:
 * floats from a pixel's input vector to the next one's). */
static inline __attribute__((always_inline)) void dw_rows(
    const geo_t *g, const float *buf, int64_t wp, const float *wt, const int64_t *off, vf bias,
    float *out, const int64_t step)
{
    for (int64_t r = 0; r < g->ho; r++) {
        const float *in = buf + r * g->sh * wp * VL;
        float *to = out + r * g->wo * VL;
        int64_t q = 0;
        for (; q + 8 <= g->wo; q += 8)
            dw_pixels(g, in + q * step, step, wt, off, bias, to + q * VL, 8);
        if (g->wo - q >= 4)
            dw_pixels(g, in + q * step, step, wt, off, bias, to + q * VL, 4), q += 4;
        if (g->wo - q >= 2)
            dw_pixels(g, in + q * step, step, wt, off, bias, to + q * VL, 2), q += 2;
        if (g->wo - q >= 1)
            dw_pixels(g, in + q * step, step, wt, off, bias, to + q * VL, 1);
    }
}

/* The depthwise outputs of the channel block in buf (its weights wt, bias) as Ho Wo
 * channel vectors, row after row; strides 1 and 2 compiled apart, so that the pixels'
 * offsets are constants in the instructions. */
static void dw_vectors(const geo_t *g, const float *buf, int64_t wp, const float *wt,
                       const int64_t *off, vf bias, float *out)
{
    if (g->sw == 1) dw_rows(g, buf, wp, wt, off, bias, out, VL);
    else if (g->sw == 2) dw_rows(g, buf, wp, wt, off, bias, out, 2 * VL);
    else dw_rows(g, buf, wp, wt, off, bias, out, g->sw * VL);
}

/* The Ho Wo channel vectors of block cb into the pointwise kernel's panels of the
 * image (pack_image's layout: the last panel's lanes past the pixels zeros). */
static void pack_vectors(const geo_t *g, const float *dv, int64_t cb, float *image)
{
    const int64_t p = g->ho * g->wo, lanes = g->c - cb * VL < VL ? g->c - cb * VL : VL;
    for (int64_t p0 = 0; p0 < p; p0 += VL) {
        vf r[VL];
        if (p0 + VL <= p)
            for (int j = 0; j < VL; j++) r[j] = vf_load(dv + (p0 + j) * VL);
        else
            for (int j = 0; j < VL; j++)
                r[j] = p0 + j < p ? vf_load(dv + (p0 + j) * VL) : (vf){0};
        vf_transpose(r);
        float *to = image + ((p0 / (PV * VL)) * g->c + cb * VL) * PV * VL + p0 % (PV * VL);
        store_vectors(to, PV * VL, r, lanes);
    }
}

/* Image img's depthwise outputs into `image` as panels, on channel vectors (buf: the
 * zero-bordered input of rows x wp vectors, dv: Ho Wo vectors, off: kh kw offsets). */
static void depthwise_vectors(const separable_job_t *job, int64_t img, int64_t wp, float *buf,
                              float *dv, const int64_t *off, float *image)
{
    const geo_t *g = job->g;
    const int64_t taps = g->kh * g->kw;
    for (int64_t cb = 0; cb * VL < g->c; cb++) {
        fill_vectors(g, job->x + img * g->c * g->h * g->w, cb, wp, buf);
        dw_vectors(g, buf, wp, job->taps + cb * taps * VL, off,
                   vf_load(job->biases + cb * VL), dv);
        pack_vectors(g, dv, cb, image);
    }
}

static void *separable_job(void *p)
{
    separable_job_t *job = p;
    const geo_t *g = job->g;
    const int64_t pixels = g->ho * g->wo, panels = (pixels + PV * VL - 1) / (PV * VL);
    const int64_t wp = (g->wo - 1) * g->sw + (g->kw - 1) * g->dw + 1;
    const int vectors = job->taps != NULL;
    float *buf = line_floats(vectors ? g->rows * wp * VL : g->rows * g->sw * g->ws + VL, 1);
    float *mid = line_floats((vectors ? VL : g->o) * pixels + VL, 0);   /* depthwise outputs */
    float *image = line_floats(panels * g->o * PV * VL + 1, 0);
    int64_t *off = malloc((size_t)(g->kh * g->kw) * sizeof(int64_t));
    if (buf && mid && image && off) {
        conv_t own = *job->a;
        own.x = mid;
        if (vectors)
            for (int64_t t = 0; t < g->kh * g->kw; t++)
                off[t] = ((t / g->kw) * g->dh * wp + (t % g->kw) * g->dw) * VL;
        else
            tap_offsets(g, off);
        for (int64_t img; (img = __atomic_fetch_add(job->next, 1, __ATOMIC_RELAXED)) < g->n;) {
            if (vectors) {
                depthwise_vectors(job, img, wp, buf, mid, off, image);
            } else {
                for (int64_t c = 0; c < g->c; c++)
                    forward_plane(g, buf, off, job->x + (img * g->c + c) * g->h * g->w,
                                  job->dw_filter, job->dw_bias, NULL, mid, c);
                pack_image(&own, 0, image);
            }
            pointwise_image(job->a, job->packed, image, img, 0, (own.o + PR - 1) / PR);
        }
    } else {
        job->failed = 1;
    }
    free(buf);
    free(mid);
    free(image);
    free(off);
    return NULL;
}

/* out (N, O, Ho, Wo) = the pointwise conv with filter (O, C m) (+ bias[o]) (+ residual,
 * out's shape) (then relu where `relu`) of the depthwise conv of x (N, C, H, W) with
 * dw_filter (C m, 1, kh, kw) (+ dw_bias) (then relu where dw_dims[15]); dw_dims as
 * conv_depthwise_forward's. dw_bias, bias and residual may be NULL. Returns 0, or 1
 * when memory ran out (out is then incomplete). */
int conv_separable_forward(const float *x, const float *dw_filter, const float *dw_bias,
                           const float *filter, const float *bias, const float *residual,
                           float *out, const int64_t *dw_dims, int64_t o, int64_t relu,
                           int64_t threads)
{
    geo_t g = geometry(dw_dims);
    if (!g.table) return 1;
    conv_t a = {.bias = bias, .residual = residual, .out = out, .n = g.n, .c = g.o, .o = o,
                .ho = g.ho, .wo = g.wo, .relu = relu};
    float *packed = pack_pointwise(filter, o, g.o);
    float *weights = g.m == 1 ? vector_weights(&g, dw_filter, dw_bias) : NULL;
    if (!packed || (g.m == 1 && !weights)) {
        free(packed);
        free(weights);
        free(g.table);
        return 1;
    }
    const float *biases = weights ? weights + (g.c + VL - 1) / VL * g.kh * g.kw * VL : NULL;
    int64_t next = 0;
    threads = clamp_threads(threads, g.n);
    separable_job_t jobs[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++)
        jobs[t] = (separable_job_t){.g = &g, .a = &a, .x = x, .dw_filter = dw_filter,
                                    .dw_bias = dw_bias, .packed = packed, .next = &next,
                                    .taps = weights, .biases = biases};
    pool_run(separable_job, jobs, sizeof(separable_job_t), threads);
    free(packed);
    free(weights);
    free(g.table);
    int failed = 0;
    for (int64_t t = 0; t < threads; t++) failed |= jobs[t].failed;
    return failed;
}
