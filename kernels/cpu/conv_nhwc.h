/* Channels-last (NHWC) kernels for conv_native.c (included there, so they share its
 * library, thread pool and vector types): float32 convolutions of one group, any
 * kernel size, stride, padding and dilation, x (N, H, W, C), filter (O, C, kh, kw),
 * out (N, Ho, Wo, O): the forward pass with fused_conv2d's epilogue, and the filter
 * gradient. The contract is conv_native_nhwc.py's.
 *
 * Channels last, the C values a window reads at one tap are side by side, and so are
 * the O outputs of one pixel: the kernels vectorize over output channels and read
 * the input one value at a time, with no transposes and no column phases.
 *
 * Forward: each thread copies one image at a time into a zero-bordered buffer (hb
 * rows of wb pixels of C values: the input after ph rows and pw pixels of zeros, then
 * the zeros the windows read) and computes tiles of NP output pixels by NO output
 * channels (two vectors) in registers: per tap (i, j) and input channel c, the
 * filter's NO values (the filter transposed once per call to blocks of NO output
 * channels, [O / NO][kh kw C][NO], zeros past O) times NP input values broadcast,
 * read at each pixel's window start + (i dh wb + j dw) C + c: consecutive c are
 * consecutive floats of the buffer and of the filter block. The last tile short of
 * NP pixels repeats its first and does not store it; channels past O are not
 * stored. Outputs may go to every osh-th row and osw-th column of a larger array (a
 * phase of a strided conv's input gradient), and x may be a window of a larger
 * array (its rows and images `x_row`, `x_image` floats apart). With at most ND output
 * channels and at least 8 input channels (an RGB image's input gradient, a last
 * 1-channel layer) a tile of NO channels would be mostly waste: each output is then a
 * dot product over the window's channels instead, in vectors of 8 channels, two pixels
 * at a time (the filter as [O][kh kw C]), the 8 partial sums added at the end.
 * Threads take (image, slice of channel blocks, or of pixels for the dot products)
 * units from a shared counter; each output is summed by one thread in one order, so
 * results do not depend on the number of threads.
 *
 * Filter gradient: dfilter[o][(i kw + j) C + c] = sum over pixels of the window value
 * at tap (i, j), channel c times dout[pixel][o]: tiles of NG_K such k by NG_O output
 * channels, per pixel dout's NG_O values (dout's rows copied per image with zeros past
 * O) times one broadcast input value per k; the NG_K values of a tile are adjacent in
 * the buffer. Each thread sums a fixed range of images into its own K x O array; the
 * calling thread adds those in thread order (results depend on the number of threads
 * only). */

#define NP 6            /* output pixels per forward tile */
#define NO 16           /* output channels per forward tile (two vectors) */
#define ND 4            /* at most this many output channels: dot products */
#define NG_O 16         /* output channels per filter-gradient tile (two vectors) */
#define NG_K 6          /* k (tap, channel) per filter-gradient tile */

typedef struct {
    const float *x, *bias, *residual, *dout;
    float *out, *ft;                         /* ft: the filter in blocks of NO channels */
    int64_t n, c, h, w, o, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo, relu;
    int64_t out_h, out_w, oy0, ox0, osh, osw, x_row, x_image;
    int64_t hb, wb, k, nblk, npix, slices, units, buf_size, dot;
    int64_t *pbase, *pout;                   /* per output pixel: its window's start in
                                                the buffer, its place in an output image */
} nhwc_t;

typedef struct {
    const nhwc_t *a;
    int64_t *next, first, last;
    float *dw;
    int failed;
} nhwc_job_t;

/* dims: n c h w o kh kw sh sw ph pw dh dw ho wo relu out_h out_w oy0 ox0 osh osw x_row
 * x_image; 0 when memory ran out. */
static int nhwc_setup(nhwc_t *a, const int64_t *d)
{
    a->n = d[0]; a->c = d[1]; a->h = d[2]; a->w = d[3]; a->o = d[4]; a->kh = d[5];
    a->kw = d[6]; a->sh = d[7]; a->sw = d[8]; a->ph = d[9]; a->pw = d[10]; a->dh = d[11];
    a->dw = d[12]; a->ho = d[13]; a->wo = d[14]; a->relu = d[15]; a->out_h = d[16];
    a->out_w = d[17]; a->oy0 = d[18]; a->ox0 = d[19]; a->osh = d[20]; a->osw = d[21];
    a->x_row = d[22]; a->x_image = d[23];
    a->hb = (a->ho - 1) * a->sh + (a->kh - 1) * a->dh + 1;
    a->wb = (a->wo - 1) * a->sw + (a->kw - 1) * a->dw + 1;
    a->k = a->kh * a->kw * a->c;
    a->nblk = (a->o + NO - 1) / NO;
    a->npix = a->ho * a->wo;
    a->buf_size = a->hb * a->wb * a->c;
    a->pbase = malloc(2 * (a->npix > 0 ? a->npix : 1) * sizeof(int64_t));
    if (!a->pbase) return 0;
    a->pout = a->pbase + a->npix;
    for (int64_t p = 0; p < a->npix; p++) {
        int64_t y = p / a->wo, x = p % a->wo;
        a->pbase[p] = (y * a->sh * a->wb + x * a->sw) * a->c;
        a->pout[p] = ((a->oy0 + a->osh * y) * a->out_w + a->ox0 + a->osw * x) * a->o;
    }
    return 1;
}

/* Image `img` of x into buf, whose zeros were set once (the same places are written
 * for every image): one run of pixels per row. */
static void nhwc_fill(const nhwc_t *a, int64_t img, float *buf)
{
    int64_t count = a->wb - a->pw < a->w ? a->wb - a->pw : a->w;
    if (count <= 0) return;
    for (int64_t y = 0; y < a->h && a->ph + y < a->hb; y++)
        memcpy(buf + ((a->ph + y) * a->wb + a->pw) * a->c, a->x + img * a->x_image + y * a->x_row,
               count * a->c * sizeof(float));
}

/* The epilogue of a tile: acc (+ bias) (+ residual) (then max(., 0)) to pixels p0 ..
 * p0 + np - 1 of image img, channels blk NO ... */
static __attribute__((noinline)) void nhwc_store(const nhwc_t *a, v8 acc[NP][2], int np,
                                                 int64_t blk, int64_t p0, int64_t img)
{
    int64_t image = a->out_h * a->out_w * a->o;
    for (int v = 0; v < 2; v++) {
        int64_t oc = blk * NO + 8 * v, lanes = a->o - oc < 8 ? a->o - oc : 8;
        if (lanes <= 0) break;
        v8 bias = {0};
        for (int64_t l = 0; l < lanes && a->bias; l++) bias[l] = a->bias[oc + l];
        for (int p = 0; p < np; p++) {
            int64_t at = img * image + a->pout[p0 + p] + oc;
            v8 val = acc[p][v] + bias;
            if (lanes == 8) {
                if (a->residual) val += load(a->residual + at);
                if (a->relu) val = (v8)((v8i)val & ~(val < 0));   /* NaN stays NaN */
                *(v8u *)(a->out + at) = val;
                continue;
            }
            for (int64_t l = 0; l < lanes; l++) {
                float s = val[l] + (a->residual ? a->residual[at + l] : 0.0f);
                a->out[at + l] = a->relu && s < 0 ? 0.0f : s;
            }
        }
    }
}

static inline __attribute__((always_inline)) void nhwc_tile(const nhwc_t *a, int np,
                                                            const float *buf, const float *f,
                                                            int64_t blk, int64_t p0, int64_t img)
{
    v8 acc[NP][2];
    const float *b[NP];
    for (int p = 0; p < NP; p++) {
        b[p] = buf + a->pbase[p0 + (p < np ? p : 0)];
        acc[p][0] = acc[p][1] = (v8){0};
    }
    for (int64_t i = 0; i < a->kh; i++)
        for (int64_t j = 0; j < a->kw; j++) {
            int64_t off = (i * a->dh * a->wb + j * a->dw) * a->c;
            const float *fk = f + (i * a->kw + j) * a->c * NO;
            for (int64_t c = 0; c < a->c; c++) {
                v8 f0 = load(fk + c * NO), f1 = load(fk + c * NO + 8);
                for (int p = 0; p < NP; p++) {
                    float s = b[p][off + c];
                    acc[p][0] += s * f0;
                    acc[p][1] += s * f1;
                }
            }
        }
    nhwc_store(a, acc, np, blk, p0, img);
}

/* The epilogue of one output value s of channel oc at `at` in out. */
static inline void nhwc_finish(const nhwc_t *a, float s, int64_t oc, int64_t at)
{
    s += (a->bias ? a->bias[oc] : 0.0f) + (a->residual ? a->residual[at] : 0.0f);
    a->out[at] = a->relu && s < 0 ? 0.0f : s;
}

/* Pixels p0 .. p1 - 1 of image img as dot products (at most ND output channels; fd:
 * the filter as [O][kh kw C]), two pixels at a time (the last one alone). */
static void nhwc_dot(const nhwc_t *a, const float *buf, const float *fd, int64_t p0,
                     int64_t p1, int64_t img)
{
    int64_t image = a->out_h * a->out_w * a->o, c8 = a->c / 8 * 8;
    for (int64_t p = p0; p < p1; p += 2) {
        const float *b0 = buf + a->pbase[p], *b1 = buf + a->pbase[p + 1 < p1 ? p + 1 : p];
        v8 acc[2][ND];
        float tail[2][ND];
        for (int q = 0; q < ND; q++) acc[0][q] = acc[1][q] = (v8){0}, tail[0][q] = tail[1][q] = 0;
        for (int64_t i = 0; i < a->kh; i++)
            for (int64_t j = 0; j < a->kw; j++) {
                int64_t off = (i * a->dh * a->wb + j * a->dw) * a->c;
                const float *f = fd + (i * a->kw + j) * a->c;
                for (int64_t c = 0; c < c8; c += 8) {
                    v8 u0 = load(b0 + off + c), u1 = load(b1 + off + c);
                    for (int q = 0; q < ND && q < a->o; q++) {
                        v8 fv = load(f + q * a->k + c);
                        acc[0][q] += u0 * fv;
                        acc[1][q] += u1 * fv;
                    }
                }
                for (int64_t c = c8; c < a->c; c++)
                    for (int q = 0; q < ND && q < a->o; q++) {
                        tail[0][q] += b0[off + c] * f[q * a->k + c];
                        tail[1][q] += b1[off + c] * f[q * a->k + c];
                    }
            }
        for (int r = 0; r < 2 && p + r < p1; r++)
            for (int q = 0; q < a->o; q++) {
                float s = tail[r][q];
                for (int l = 0; l < 8; l++) s += acc[r][q][l];
                nhwc_finish(a, s, q, img * image + a->pout[p + r] + q);
            }
    }
}

static void *nhwc_forward_job(void *p)
{
    nhwc_job_t *job = p;
    const nhwc_t *a = job->a;
    float *buf = calloc(a->buf_size + 8, sizeof(float));
    if (!buf) { job->failed = 1; return NULL; }
    int64_t shown = -1;
    for (int64_t u; (u = __atomic_fetch_add(job->next, 1, __ATOMIC_RELAXED)) < a->units;) {
        int64_t img = u / a->slices, s = u % a->slices;
        if (img != shown) nhwc_fill(a, img, buf), shown = img;
        if (a->dot) {
            nhwc_dot(a, buf, a->ft, s * a->npix / a->slices, (s + 1) * a->npix / a->slices, img);
            continue;
        }
        for (int64_t blk = s * a->nblk / a->slices; blk < (s + 1) * a->nblk / a->slices; blk++) {
            const float *f = a->ft + blk * a->k * NO;
            int64_t p0 = 0;
            for (; p0 + NP <= a->npix; p0 += NP) nhwc_tile(a, NP, buf, f, blk, p0, img);
            if (p0 < a->npix) nhwc_tile(a, (int)(a->npix - p0), buf, f, blk, p0, img);
        }
    }
    free(buf);
    return NULL;
}

/* The filter (O, C, kh, kw) as blocks of NO output channels: [O / NO][kh kw C][NO]. */
static float *nhwc_filter_blocks(const nhwc_t *a, const float *filter)
{
    float *ft = calloc(a->nblk * a->k * NO + 8, sizeof(float));
    if (!ft) return NULL;
    for (int64_t oc = 0; oc < a->o; oc++)
        for (int64_t c = 0; c < a->c; c++)
            for (int64_t i = 0; i < a->kh; i++)
                for (int64_t j = 0; j < a->kw; j++) {
                    int64_t k = (i * a->kw + j) * a->c + c;
                    ft[((oc / NO) * a->k + k) * NO + oc % NO] =
                        filter[((oc * a->c + c) * a->kh + i) * a->kw + j];
                }
    return ft;
}

/* The filter (O, C, kh, kw) as rows [O][kh kw C], for nhwc_dot. */
static float *nhwc_filter_rows(const nhwc_t *a, const float *filter)
{
    float *fd = malloc((a->o * a->k + 8) * sizeof(float));
    if (!fd) return NULL;
    for (int64_t oc = 0; oc < a->o; oc++)
        for (int64_t c = 0; c < a->c; c++)
            for (int64_t i = 0; i < a->kh; i++)
                for (int64_t j = 0; j < a->kw; j++)
                    fd[oc * a->k + (i * a->kw + j) * a->c + c] =
                        filter[((oc * a->c + c) * a->kh + i) * a->kw + j];
    return fd;
}

/* dims: see nhwc_setup. Returns 0, or 1 when memory ran out (out is then incomplete). */
int conv2d_nhwc_forward_f32(const float *x, const float *filter, const float *bias,
                            const float *residual, float *out, const int64_t *dims,
                            int64_t threads)
{
    nhwc_t a = {.x = x, .bias = bias, .residual = residual, .out = out};
    if (!nhwc_setup(&a, dims)) return 1;
    a.dot = a.o <= ND && a.c >= 8;
    a.ft = a.dot ? nhwc_filter_rows(&a, filter) : nhwc_filter_blocks(&a, filter);
    if (!a.ft) { free(a.pbase); return 1; }
    threads = threads < 1 ? 1 : threads;
    a.slices = a.n >= threads ? 1 : (threads + a.n - 1) / a.n;  /* few images: split O or
                                                                    the pixels */
    int64_t parts = a.dot ? (a.npix + 1) / 2 : a.nblk;
    if (a.slices > parts) a.slices = parts;
    a.units = a.n * a.slices;
    threads = clamp_threads(threads, a.units);
    int64_t next = 0;
    nhwc_job_t jobs[MAX_THREADS];
    for (int64_t t = 0; t < threads; t++) jobs[t] = (nhwc_job_t){.a = &a, .next = &next};
    pool_run(nhwc_forward_job, jobs, sizeof(nhwc_job_t), threads);
    int failed = 0;
    for (int64_t t = 0; t < threads; t++) failed |= jobs[t].failed;
    free(a.ft);
    free(a.pbase);
    return failed;
}

static void *nhwc_filter_grad_job(void *p)
{
    nhwc_job_t *job = p;
    const nhwc_t *a = job->a;
    int64_t opad = (a->o + NG_O - 1) / NG_O * NG_O, dsize = a->npix * opad;
    int64_t group = group_size(&(conv_t){.ho = a->ho, .wo = a->wo});
    if (group > job->last - job->first) group = job->last - job->first;
    float *buf = calloc(group * a->buf_size + 8, sizeof(float));
    float *dt = calloc(group * dsize + 8, sizeof(float));       /* columns past O: zeros */
    int64_t *koff = malloc((a->k > 0 ? a->k : 1) * sizeof(int64_t));
    if (!buf || !dt || !koff) { job->failed = 1; free(buf); free(dt); free(koff); return NULL; }
    for (int64_t i = 0; i < a->kh; i++)
        for (int64_t j = 0; j < a->kw; j++)
            for (int64_t c = 0; c < a->c; c++)
                koff[(i * a->kw + j) * a->c + c] = (i * a->dh * a->wb + j * a->dw) * a->c + c;
    for (int64_t img0 = job->first; img0 < job->last; img0 += group) {
        int64_t m = job->last - img0 < group ? job->last - img0 : group;
        for (int64_t g = 0; g < m; g++) {
            nhwc_fill(a, img0 + g, buf + g * a->buf_size);
            const float *d = a->dout + (img0 + g) * a->npix * a->o;
            for (int64_t q = 0; q < a->npix; q++)
                memcpy(dt + g * dsize + q * opad, d + q * a->o, a->o * sizeof(float));
        }
        for (int64_t o0 = 0; o0 < opad; o0 += NG_O)
            for (int64_t k0 = 0; k0 < a->k; k0 += NG_K) {
                v8 acc[NG_O / 8][NG_K];
                int64_t off[NG_K];
                for (int t = 0; t < NG_K; t++) {
                    off[t] = koff[k0 + t < a->k ? k0 + t : k0];
                    for (int v = 0; v < NG_O / 8; v++) acc[v][t] = (v8){0};
                }
                for (int64_t g = 0; g < m; g++) {
                    const float *bimg = buf + g * a->buf_size, *dimg = dt + g * dsize + o0;
                    for (int64_t q = 0; q < a->npix; q++) {
                        const float *b = bimg + a->pbase[q];
                        v8 dv[NG_O / 8];
                        for (int v = 0; v < NG_O / 8; v++) dv[v] = load(dimg + q * opad + 8 * v);
                        for (int t = 0; t < NG_K; t++) {
                            float s = b[off[t]];
                            for (int v = 0; v < NG_O / 8; v++) acc[v][t] += dv[v] * s;
                        }
                    }
                }
                for (int t = 0; t < NG_K && k0 + t < a->k; t++)
                    for (int v = 0; v < NG_O / 8; v++) {
                        float *dst = job->dw + (k0 + t) * opad + o0 + 8 * v;
                        *(v8u *)dst = load(dst) + acc[v][t];
                    }
            }
    }
    free(buf);
    free(dt);
    free(koff);
    return NULL;
}

/* dw (O x C x kh x kw, zeroed by the caller) += the filter gradient of the conv `dims`
 * (relu and the output placement unused) for dout (N, ho, wo, O). Returns 0, or 1
 * when memory ran out (dw is then unchanged). */
int conv2d_nhwc_filter_grad_f32(const float *x, const float *dout, float *dw,
                                const int64_t *dims, int64_t threads)
{
    nhwc_t a = {.x = x, .dout = dout};
    if (!nhwc_setup(&a, dims)) return 1;
    threads = clamp_threads(threads, a.n);
    int64_t opad = (a.o + NG_O - 1) / NG_O * NG_O, size = opad * a.k;
    float *sums = calloc(threads * size + 8, sizeof(float));
    nhwc_job_t jobs[MAX_THREADS];
    int failed = !sums;
    if (!failed) {
        for (int64_t t = 0; t < threads; t++)
            jobs[t] = (nhwc_job_t){.a = &a, .first = t * a.n / threads,
                                   .last = (t + 1) * a.n / threads, .dw = sums + t * size};
        pool_run(nhwc_filter_grad_job, jobs, sizeof(nhwc_job_t), threads);
        for (int64_t t = 0; t < threads; t++) failed |= jobs[t].failed;
    }
    if (!failed)
        for (int64_t t = 0; t < threads; t++)
            for (int64_t oc = 0; oc < a.o; oc++)
                for (int64_t c = 0; c < a.c; c++)
                    for (int64_t i = 0; i < a.kh; i++)
                        for (int64_t j = 0; j < a.kw; j++)
                            dw[((oc * a.c + c) * a.kh + i) * a.kw + j] +=
                                sums[t * size + ((i * a.kw + j) * a.c + c) * opad + oc];
    free(sums);
    free(a.pbase);
    return failed;
}
