/* The native CPU kernel of 2-D convolutions (float32, NCHW, one group): the
 * forward pass with fused_conv2d's epilogue. Built and loaded by native.py,
 * launched by conv2d_cpu.py (the contract is there).
 *
 * Each thread copies one image at a time into a zero-bordered buffer that
 * stays in cache and reads the convolution's windows straight from it, with
 * no columns in memory. Stride 1 across (sw == 1): the padded image, rows of
 * wb values, and tap (i, j) of input channel ci is the offset
 * koff = (ci hb + i dh) wb + j dw. Strided across: kw copies, copy j holding
 * column sw x + j dw - pw of every padded row at x, so that eight outputs of
 * a row read eight adjacent values here too (koff = ((j C + ci) hb + i dh) wb).
 * Output row y starts at y sh wb in both.
 *
 * The forward tile is MR output channels by NV vectors of eight outputs
 * (vector v: row v / vpr, columns 8 (v % vpr) ..): one broadcast filter
 * value times NV loaded vectors per tap. Filter values come packed
 * (O padded to MR, then [block][k][MR]). Outputs past wo in a vector are
 * computed on the buffer's zeros and never stored. Threads take (image,
 * slice of output channels) units from a shared counter; every output is
 * summed by one thread in one order, so results do not depend on them. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#define MR 4
#define NV 3
#define MAX_THREADS 64

typedef float v8 __attribute__((vector_size(32)));
typedef float v8u __attribute__((vector_size(32), aligned(4)));
typedef int v8i __attribute__((vector_size(32)));

typedef struct {
    const float *x, *wpack, *bias, *residual;
    float *out;
    long n, c, h, w, o, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo, relu;
    long hb, wb, k, nblk, vpr, nvec, slices, units, buf_size;
    long *koff;
} conv_t;

static v8 load(const float *p) { return *(const v8u *)p; }

static void setup(conv_t *a, const long *d)
{
    a->n = d[0]; a->c = d[1]; a->h = d[2]; a->w = d[3]; a->o = d[4]; a->kh = d[5];
    a->kw = d[6]; a->sh = d[7]; a->sw = d[8]; a->ph = d[9]; a->pw = d[10]; a->dh = d[11];
    a->dw = d[12]; a->ho = d[13]; a->wo = d[14]; a->relu = d[15];
    a->vpr = (a->wo + 7) / 8;
    a->nvec = a->ho * a->vpr;
    a->hb = a->h + 2 * a->ph;
    a->k = a->c * a->kh * a->kw;
    a->nblk = (a->o + MR - 1) / MR;
    if (a->sw == 1) {
        long need = 8 * a->vpr + (a->kw - 1) * a->dw, padded = a->w + 2 * a->pw;
        a->wb = padded > need ? padded : need;
        a->buf_size = a->c * a->hb * a->wb + 8;
    } else {
        a->wb = 8 * a->vpr;
        a->buf_size = a->kw * a->c * a->hb * a->wb + 8;
    }
    a->koff = malloc(a->k * sizeof(long));
    if (!a->koff) return;
    long k = 0;
    for (long ci = 0; ci < a->c; ci++)
        for (long i = 0; i < a->kh; i++)
            for (long j = 0; j < a->kw; j++)
                a->koff[k++] = a->sw == 1 ? (ci * a->hb + i * a->dh) * a->wb + j * a->dw
                                          : ((j * a->c + ci) * a->hb + i * a->dh) * a->wb;
}

/* Image `img` of x into buf, whose zeros (the padding) were set once. */
static void fill_buffer(const conv_t *a, long img, float *buf)
{
    const float *src = a->x + img * a->c * a->h * a->w;
    if (a->sw == 1) {
        for (long ci = 0; ci < a->c; ci++)
            for (long y = 0; y < a->h; y++)
                memcpy(buf + (ci * a->hb + y + a->ph) * a->wb + a->pw,
                       src + (ci * a->h + y) * a->w, a->w * sizeof(float));
        return;
    }
    for (long j = 0; j < a->kw; j++) {
        long first = j * a->dw - a->pw;     /* input column read at x = 0 */
        long x0 = first < 0 ? (-first + a->sw - 1) / a->sw : 0, x1 = x0;
        while (x1 < a->wb && first + a->sw * x1 < a->w) x1++;
        for (long ci = 0; ci < a->c; ci++)
            for (long y = 0; y < a->h; y++) {
                float *dst = buf + ((j * a->c + ci) * a->hb + y + a->ph) * a->wb;
                const float *row = src + (ci * a->h + y) * a->w + first;
                for (long x = x0; x < x1; x++) dst[x] = row[a->sw * x];
            }
    }
}

static inline __attribute__((always_inline)) void forward_tile(
    const conv_t *a, int nv, const float *buf, const float *wp, long blk, long v0, long img)
{
    v8 acc[MR][NV];
    long base[NV];
    for (int v = 0; v < NV; v++) {
        long vv = v0 + (v < nv ? v : 0);
        base[v] = (vv / a->vpr) * a->sh * a->wb + (vv % a->vpr) * 8;
        for (int r = 0; r < MR; r++) acc[r][v] = (v8){0};
    }
    for (long k = 0; k < a->k; k++) {
        const float *b = buf + a->koff[k], *f = wp + k * MR;
        v8 bv[NV];
        for (int v = 0; v < nv; v++) bv[v] = load(b + base[v]);
        for (int r = 0; r < MR; r++)
            for (int v = 0; v < nv; v++) acc[r][v] += f[r] * bv[v];
    }
    long plane = a->ho * a->wo;
    for (int r = 0; r < MR && blk * MR + r < a->o; r++) {
        long oc = blk * MR + r;
        float bias = a->bias ? a->bias[oc] : 0.0f;
        for (int v = 0; v < nv; v++) {
            long vv = v0 + v, x0 = (vv % a->vpr) * 8;
            long at = (img * a->o + oc) * plane + (vv / a->vpr) * a->wo + x0;
            long lanes = a->wo - x0 < 8 ? a->wo - x0 : 8;
            v8 val = acc[r][v] + bias;
            if (lanes == 8) {
                if (a->residual) val += load(a->residual + at);
                if (a->relu) val = (v8)((v8i)val & ~(val < 0));   /* NaN stays NaN */
                *(v8u *)(a->out + at) = val;
                continue;
            }
            for (long l = 0; l < lanes; l++) {
                float s = val[l] + (a->residual ? a->residual[at + l] : 0.0f);
                a->out[at + l] = a->relu && s < 0 ? 0.0f : s;
            }
        }
    }
}

typedef struct {
    const conv_t *a;
    long *next;                /* the next unit to take */
    int failed;
} job_t;

static void *forward_job(void *p)
{
    job_t *job = p;
    const conv_t *a = job->a;
    float *buf = calloc(a->buf_size, sizeof(float));
    if (!buf) { job->failed = 1; return NULL; }
    long shown = -1;
    for (long u; (u = __atomic_fetch_add(job->next, 1, __ATOMIC_RELAXED)) < a->units;) {
        long img = u / a->slices, s = u % a->slices;
        if (img != shown) fill_buffer(a, img, buf), shown = img;
        for (long blk = s * a->nblk / a->slices; blk < (s + 1) * a->nblk / a->slices; blk++) {
            const float *wp = a->wpack + blk * a->k * MR;
            long v = 0;
            for (; v + NV <= a->nvec; v += NV) forward_tile(a, NV, buf, wp, blk, v, img);
            if (a->nvec - v == 2) forward_tile(a, 2, buf, wp, blk, v, img);
            if (a->nvec - v == 1) forward_tile(a, 1, buf, wp, blk, v, img);
        }
    }
    free(buf);
    return NULL;
}

/* Runs fn on `threads` jobs (this thread runs the first); 0 on success. */
static int run_jobs(void *(*fn)(void *), job_t *jobs, long threads)
{
    pthread_t tid[MAX_THREADS];
    long started = 1;
    for (; started < threads; started++)
        if (pthread_create(&tid[started], NULL, fn, &jobs[started])) break;
    for (long t = started; t < threads; t++) fn(&jobs[t]);   /* no thread: run here */
    fn(&jobs[0]);
    int failed = jobs[0].failed;
    for (long t = 1; t < threads; t++) {
        if (t < started) pthread_join(tid[t], NULL);
        failed |= jobs[t].failed;
    }
    return failed;
}

static long clamp_threads(long threads, long units)
{
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > units) threads = units;
    return threads < 1 ? 1 : threads;
}

/* dims: n c h w o kh kw sh sw ph pw dh dw ho wo relu. Returns 0, or 1 when
 * memory ran out (out is then incomplete). */
int conv2d_forward_f32(const float *x, const float *wpack, const float *bias,
                       const float *residual, float *out, const long *dims, long threads)
{
    conv_t a = {.x = x, .wpack = wpack, .bias = bias, .residual = residual, .out = out};
    setup(&a, dims);
    if (!a.koff) return 1;
    threads = threads < 1 ? 1 : threads;
    a.slices = a.n >= threads ? 1 : (threads + a.n - 1) / a.n;   /* few images: split O */
    if (a.slices > a.nblk) a.slices = a.nblk;
    a.units = a.n * a.slices;
    threads = clamp_threads(threads, a.units);
    long next = 0;
    job_t jobs[MAX_THREADS];
    for (long t = 0; t < threads; t++) jobs[t] = (job_t){.a = &a, .next = &next};
    int failed = run_jobs(forward_job, jobs, threads);
    free(a.koff);
    return failed;
}
