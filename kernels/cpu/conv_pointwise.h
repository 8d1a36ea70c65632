/* The pointwise kernel of conv_native.c (included there, after conv_epilogue.h): a
 * 1x1 conv of stride 1 and no padding whose outputs fill `out` (MobileNet's
 * pointwise convs, a bottleneck's 1x1s, and their input gradients). Per image it is
 * a matrix product, out (O x P) = filter (O x C) times x (C x P) with P = h w: no
 * zero-bordered buffer and no per-tap offsets.
 *
 * The tile is PR output channels by PV vectors (8 x 3 with AVX-512's 32 registers,
 * else 4 x 3): per input channel, PV loads of x and PR broadcasts of the filter. The
 * filter is packed once a call as blocks of PR rows, channel-major (rows past O
 * repeat row O - 1, never stored); each thread packs an image at a time as panels of
 * PV vectors of pixels, C rows each. A thread takes (image, slice of channel blocks)
 * units as the direct kernel's and runs each block along the image's panels, so its
 * outputs are written row after row. Each output sums its channels in order, one
 * multiply-add each, then adds the bias and the residual and takes the relu: the
 * direct kernel's operations on the same values, so the two give the same bits.
 * Against the direct kernel on MobileNet-style pointwise convs (2 threads): 1.3-1.7x
 * as fast with AVX-512, 1.2-1.7x with AVX2 (docs/performance.md). */

#define PR (VL == 16 ? 8 : 4)
#define PV 3

/* v, kept in a register (as fc_native.c's FC_IN_REGISTERS keeps its tile's). With AVX2
 * (no broadcast operand to fold instead) GCC folds a tile's load of x into each of its
 * PR multiply-adds, loading it PR times: 16 loads a step for 12 FMAs. Held, the tile
 * ran 1.3-1.6x as fast; wgrad_native.c's tile, held the same way, ran slower, so it
 * is not. */
static inline vf held(vf v)
{
#if defined(__AVX2__) && !defined(__AVX512F__)
    __asm__("" : "+x"(v));
#endif
    return v;
}

/* `count` floats at a cache line's start (64 bytes: no vector read or written in them
 * spans two lines), zeroed where `zero`; NULL when memory ran out. */
static float *line_floats(int64_t count, int zero)
{
    const size_t bytes = ((size_t)count * sizeof(float) + 63) / 64 * 64;
    float *p = aligned_alloc(64, bytes ? bytes : 64);
    if (p && zero) memset(p, 0, bytes);
    return p;
}

/* The filter (O x C) as blocks of PR rows, each C x PR (rows past O: row O - 1). */
static float *pack_pointwise(const float *filter, int64_t o, int64_t c)
{
    int64_t blocks = (o + PR - 1) / PR;
    float *packed = line_floats(blocks * PR * c + 1, 0);
    if (!packed) return NULL;
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t r = 0; r < PR; r++) {
            const float *row = filter + (b * PR + r < o ? b * PR + r : o - 1) * c;
            for (int64_t k = 0; k < c; k++) packed[(b * c + k) * PR + r] = row[k];
        }
    return packed;
}

/* Inlined into the tile with AVX-512, whose 32 registers hold the tile through it: the
 * accumulators are not spilled for a call (0-6% faster on six 1x1 convs of 32-64
 * images, the same bits). With AVX2's 16, inlined, the tile's loop ran 1.3-1.8x as
 * long. */
#if VL == 16
#define STORE_POINTWISE_KIND inline __attribute__((always_inline))
#else
#define STORE_POINTWISE_KIND __attribute__((noinline))
#endif

/* acc (+ bias) (+ residual) (then max(., 0)) of channels blk PR .. (at most `rows`)
 * to the nv vectors at pixel p0 of image img, the last one `tail` lanes (VL: whole). */
static STORE_POINTWISE_KIND void store_pointwise(const conv_t *a, vf acc[PR][PV], int nv,
                                                 int64_t tail, int64_t rows, int64_t oc0,
                                                 int64_t img, int64_t p0)
{
    const int64_t plane = a->ho * a->wo;
    const float *const bias = a->bias;
#define STORE(RES, RELU)                                                                   \
    for (int64_t r = 0; r < rows; r++) {                                                   \
        int64_t at = (img * a->o + oc0 + r) * plane + p0;                                  \
        float b = bias ? bias[oc0 + r] : 0.0f;                                             \
        for (int v = 0; v < nv; v++)                                                       \
            store_row_dense(a->out + at + v * VL, RES ? a->residual + at + v * VL : NULL,   \
                            acc[r][v] + b, v == nv - 1 ? tail : VL, RES, RELU);             \
    }
    if (a->residual && a->relu) STORE(1, 1)
    else if (a->residual) STORE(1, 0)
    else if (a->relu) STORE(0, 1)
    else STORE(0, 0)
#undef STORE
}

/* One tile: channels of packed block wp against nv vectors of the packed panel xp
 * (C rows of PV VL values). */
static inline __attribute__((always_inline)) void pointwise_tile(
    const conv_t *a, const float *xp, const float *wp, int nv, int64_t tail, int64_t rows,
    int64_t oc0, int64_t img, int64_t p0)
{
    vf acc[PR][PV];
    const int64_t c = a->c;
    for (int r = 0; r < PR; r++)
        for (int v = 0; v < PV; v++) acc[r][v] = (vf){0};
    for (int64_t k = 0; k < c; k++, xp += PV * VL, wp += PR) {
        vf bv[PV];
        for (int v = 0; v < nv; v++) bv[v] = held(vf_load(xp + v * VL));
        for (int r = 0; r < PR; r++)
            for (int v = 0; v < nv; v++) acc[r][v] += wp[r] * bv[v];
    }
    store_pointwise(a, acc, nv, tail, rows, oc0, img, p0);
}

/* Image img of x into `image` as panels of PV VL pixels, each C rows of PV VL floats
 * (the last panel's lanes past P zeros): the tiles then read one stream (x's rows are
 * P floats apart, 4 KiB at 32x32 and 1 KiB at 16x16, which maps a panel's rows to a
 * few of L1's sets). */
static void pack_image(const conv_t *a, int64_t img, float *image)
{
    const int64_t p = a->ho * a->wo, c = a->c;
    const float *from = a->x + img * c * p;
    for (int64_t k = 0; k < c; k++, from += p)
        for (int64_t p0 = 0; p0 < p; p0 += VL) {
            float *to = image + ((p0 / (PV * VL)) * c + k) * PV * VL + p0 % (PV * VL);
            vf_store(to, p - p0 < VL ? vf_load_part(from + p0, p - p0) : vf_load(from + p0));
        }
}

/* Channel blocks [first, end) of image img, packed in `image`: per block, its tiles
 * along the pixels (the block's filter in L1, its outputs written row by row). */
static void pointwise_image(const conv_t *a, const float *packed, const float *image,
                            int64_t img, int64_t first, int64_t end)
{
    const int64_t p = a->ho * a->wo, c = a->c;
    for (int64_t blk = first; blk < end; blk++) {
        const float *wp = packed + blk * PR * c;
        int64_t oc0 = blk * PR, rows = a->o - oc0 < PR ? a->o - oc0 : PR;
        const float *xp = image;
        for (int64_t p0 = 0; p0 < p; p0 += PV * VL, xp += c * PV * VL) {
            int64_t left = p - p0;
            int nv = left >= PV * VL ? PV : (int)((left + VL - 1) / VL);
            int64_t tail = left - (nv - 1) * VL < VL ? left - (nv - 1) * VL : VL;
            if (nv == PV) pointwise_tile(a, xp, wp, PV, tail, rows, oc0, img, p0);
            else if (nv == 2) pointwise_tile(a, xp, wp, 2, tail, rows, oc0, img, p0);
            else pointwise_tile(a, xp, wp, 1, tail, rows, oc0, img, p0);
        }
    }
}

typedef struct {
    const conv_t *a;
    const float *packed;
    int64_t *next, slices, blocks;
    int failed;
} pointwise_job_t;

static void *pointwise_job(void *p)
{
    pointwise_job_t *job = p;
    const conv_t *a = job->a;
    const int64_t pixels = a->ho * a->wo, units = a->n * job->slices;
    const int64_t panels = (pixels + PV * VL - 1) / (PV * VL);
    float *image = line_floats(panels * a->c * PV * VL + 1, 0);
    if (!image) { job->failed = 1; return NULL; }
    int64_t shown = -1;
    for (int64_t u; (u = __atomic_fetch_add(job->next, 1, __ATOMIC_RELAXED)) < units;) {
        int64_t img = u / job->slices, s = u % job->slices;
        int64_t first = s * job->blocks / job->slices, end = (s + 1) * job->blocks / job->slices;
        if (img != shown) pack_image(a, img, image), shown = img;
        pointwise_image(a, job->packed, image, img, first, end);
    }
    free(image);
    return NULL;
}

/* Whether conv2d_forward_f32 runs the pointwise kernel on `d` (its dims): a 1x1
 * filter, stride 1, no padding, the outputs filling out's planes, no pooling. */
static int pointwise(const int64_t *d)
{
    return d[5] == 1 && d[6] == 1 && d[7] == 1 && d[8] == 1 && d[9] == 0 && d[10] == 0 &&
           d[13] == d[2] && d[14] == d[3] && d[16] == d[13] && d[17] == d[14] &&
           d[18] == 0 && d[19] == 0 && d[20] == 1 && d[21] == 1 && d[22] == 0;
}

static int pointwise_forward(const float *x, const float *filter, const float *bias,
                             const float *residual, float *out, const int64_t *d,
                             int64_t threads)
{
    conv_t a = {.x = x, .bias = bias, .residual = residual, .out = out, .n = d[0], .c = d[1],
                .o = d[4], .ho = d[13], .wo = d[14], .relu = d[15]};
    float *packed = pack_pointwise(filter, a.o, a.c);
    if (!packed) return 1;
    int64_t blocks = (a.o + PR - 1) / PR, next = 0;
    threads = threads < 1 ? 1 : threads;
    int64_t slices = a.n >= threads ? 1 : (threads + a.n - 1) / a.n;   /* few images */
    if (slices > blocks) slices = blocks;
    threads = clamp_threads(threads, a.n * slices);
    pointwise_job_t jobs[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++)
        jobs[t] = (pointwise_job_t){.a = &a, .packed = packed, .next = &next, .slices = slices,
                                    .blocks = blocks};
    pool_run(pointwise_job, jobs, sizeof(pointwise_job_t), threads);
    free(packed);
    int failed = 0;
    for (int64_t t = 0; t < threads; t++) failed |= jobs[t].failed;
    return failed;
}
