/* The separable kernel of conv_native.c (included at its end; fused_separable_conv2d,
 * MobileNet's blocks): a depthwise conv (conv_depthwise_rows.h, with its bias and relu)
 * and then a pointwise conv (conv_pointwise.h, with its bias, residual and relu), image
 * by image. A thread computes an image's depthwise outputs into planes of its own (in
 * cache), packs them as the pointwise kernel's panels and runs its tiles on them, so the
 * depthwise outputs never go to memory: in the two kernels one after the other they are
 * written out in full and read back. Both steps do the two kernels' operations on the
 * same values, so the result has their bits. Threads take whole images. */
#include "conv_depthwise_rows.h"

typedef struct {
    const geo_t *g;             /* the depthwise conv */
    const conv_t *a;            /* the pointwise conv (x unset: a thread's copy of it
                                   reads the thread's planes) */
    const float *x, *dw_filter, *dw_bias, *packed;
    int64_t *next;
    int failed;
} separable_job_t;

static void *separable_job(void *p)
{
    separable_job_t *job = p;
    const geo_t *g = job->g;
    const int64_t pixels = g->ho * g->wo, panels = (pixels + PV * VL - 1) / (PV * VL);
    float *buf = calloc((size_t)(g->rows * g->sw * g->ws + VL), sizeof(float));
    float *planes = malloc((size_t)(g->o * pixels + VL) * sizeof(float));
    float *image = malloc((size_t)(panels * g->o * PV * VL + 1) * sizeof(float));
    int64_t *off = malloc((size_t)(g->kh * g->kw) * sizeof(int64_t));
    if (buf && planes && image && off) {
        conv_t own = *job->a;
        own.x = planes;
        tap_offsets(g, off);
        for (int64_t img; (img = __atomic_fetch_add(job->next, 1, __ATOMIC_RELAXED)) < g->n;) {
            for (int64_t c = 0; c < g->c; c++)
                forward_plane(g, buf, off, job->x + (img * g->c + c) * g->h * g->w,
                              job->dw_filter, job->dw_bias, NULL, planes, c);
            pack_image(&own, 0, image);
            pointwise_image(job->a, job->packed, image, img, 0, (own.o + PR - 1) / PR);
        }
    } else {
        job->failed = 1;
    }
    free(buf);
    free(planes);
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
    if (!packed) {
        free(g.table);
        return 1;
    }
    int64_t next = 0;
    threads = clamp_threads(threads, g.n);
    separable_job_t jobs[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++)
        jobs[t] = (separable_job_t){.g = &g, .a = &a, .x = x, .dw_filter = dw_filter,
                                    .dw_bias = dw_bias, .packed = packed, .next = &next};
    pool_run(separable_job, jobs, sizeof(separable_job_t), threads);
    free(packed);
    free(g.table);
    int failed = 0;
    for (int64_t t = 0; t < threads; t++) failed |= jobs[t].failed;
    return failed;
}
