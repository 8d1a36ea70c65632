/* Average pooling (pool2d with pool_type "avg", not global) of float32 NCHW planes, with
 * the bits of the numpy kernel (kernels/cpu/pool2d.py), included by pool_native.c:
 * - forward: each window's real (unpadded) elements summed in double in the order of
 *   their taps (row by row), divided by their count in double, rounded once to float;
 * - gradient: each window's share dout / count in float, and each element's dx the sum
 *   in float, from 0, of the shares of the windows it is in, in the order of its taps
 *   in them (the numpy kernel adds the shares tap by tap).
 * 2x2 windows at stride 2 without padding (the common layer) take a loop of their own,
 * the same sums in the same order, and windows that do not overlap one of their own.
 * Planes in contiguous ranges over up to `threads` threads (native_pool.h), each plane
 * one thread's, so results do not depend on the count. g: ho wo kh kw sh sw ph pw. */

typedef struct {
    const float *x, *dout;
    float *out;
    const int64_t *g;
    int64_t begin, end, h, w;
    int failed;
} avg_job_t;

/* Along one axis of `size` real elements: the first real tap [first] of window o, and
 * how many [count], for o < out. */
static void avg_spans(int64_t size, int64_t out, int64_t k, int64_t s, int64_t p,
                      int64_t *first, int64_t *count)
{
    for (int64_t o = 0; o < out; o++) {
        const int64_t start = o * s - p, lo = start > 0 ? start : 0;
        const int64_t hi = start + k < size ? start + k : size;
        first[o] = lo;
        count[o] = hi > lo ? hi - lo : 0;
    }
}

static void *avg_forward_planes(void *arg)
{
    avg_job_t *j = arg;
    const int64_t *g = j->g, ho = g[0], wo = g[1];
    int64_t *spans = malloc((size_t)(2 * (ho + wo)) * sizeof(int64_t));
    if (!spans) {
        j->failed = 1;
        return NULL;
    }
    int64_t *r0 = spans, *rn = r0 + ho, *c0 = rn + ho, *cn = c0 + wo;
    avg_spans(j->h, ho, g[2], g[4], g[6], r0, rn);
    avg_spans(j->w, wo, g[3], g[5], g[7], c0, cn);
    const int tiles = g[2] == 2 && g[3] == 2 && g[4] == 2 && g[5] == 2 && !g[6] && !g[7];
    for (int64_t p = j->begin; p < j->end; p++) {
        const float *x = j->x + p * j->h * j->w;
        float *out = j->out + p * ho * wo;
        if (tiles) {          /* 2x2 windows at stride 2, unpadded: the same sums, vectorized */
            for (int64_t r = 0; r < ho; r++) {
                const float *top = x + 2 * r * j->w, *bottom = top + j->w;
                float *o = out + r * wo;
                for (int64_t q = 0; q < wo; q++)
                    o[q] = (float)((((0.0 + top[2 * q]) + top[2 * q + 1]) + bottom[2 * q]
                                    + bottom[2 * q + 1]) / 4.0);
            }
            continue;
        }
        for (int64_t r = 0; r < ho; r++)
            for (int64_t q = 0; q < wo; q++) {
                double sum = 0.0;
                for (int64_t y = r0[r]; y < r0[r] + rn[r]; y++)
                    for (int64_t c = c0[q]; c < c0[q] + cn[q]; c++) sum += x[y * j->w + c];
                out[r * wo + q] = (float)(sum / (double)(rn[r] * cn[q]));
            }
    }
    free(spans);
    return NULL;
}

/* Along one axis: for element e < size, the windows it is in, by ascending tap (so
 * descending window), as [at[e], at[e + 1]) of `windows`. */
static void avg_windows(int64_t size, int64_t out, int64_t k, int64_t s, int64_t p,
                        int64_t *at, int64_t *windows)
{
    int64_t n = 0;
    for (int64_t e = 0; e < size; e++) {
        at[e] = n;
        for (int64_t t = 0; t < k; t++) {          /* e = o s - p + t */
            const int64_t from = e + p - t;
            if (from >= 0 && from % s == 0 && from / s < out) windows[n++] = from / s;
        }
    }
    at[size] = n;
}

/* The gradient of 2x2 windows at stride 2, unpadded, on one plane: dx's rows 2r and
 * 2r + 1 both hold 0 + d's row r / 4, each value twice, 8 shares at a time (the
 * last 1-7 through AVX-512's masked moves, else one by one; then zeros: an odd last
 * row or column no window reads). The operations of the loop below. */
static void avg_grad_tiles(const float *d, float *dx, int64_t ho, int64_t wo, int64_t h,
                           int64_t w)
{
    for (int64_t r = 0; r < ho; r++) {
        float *top = dx + 2 * r * w, *bottom = top + w;
        const float *src = d + r * wo;
        int64_t q = 0;
        for (; q + 8 <= wo; q += 8) {
            v8f s = (v8f){0} + *(const v8fu *)(src + q) / 4.0f;
            v8f lo = V8_SHUFFLE(s, s, 0, 0, 1, 1, 2, 2, 3, 3);
            v8f hi = V8_SHUFFLE(s, s, 4, 4, 5, 5, 6, 6, 7, 7);
            *(v8fu *)(top + 2 * q) = *(v8fu *)(bottom + 2 * q) = lo;
            *(v8fu *)(top + 2 * q + 8) = *(v8fu *)(bottom + 2 * q + 8) = hi;
        }
#if !defined(__AVX512F__)               /* AVX2's masked stores took longer than these */
        for (; q < wo; q++) top[2 * q] = top[2 * q + 1] = bottom[2 * q] = bottom[2 * q + 1] =
            0.0f + src[q] / 4.0f;
#endif
        if (q < wo) {                              /* the last 1-7: masked moves */
            const int64_t left = wo - q, first = 2 * left < 8 ? 2 * left : 8;
            v8f s = (v8f){0} + v8f_load_part(src + q, left) / 4.0f;
            v8f lo = V8_SHUFFLE(s, s, 0, 0, 1, 1, 2, 2, 3, 3);
            v8f hi = V8_SHUFFLE(s, s, 4, 4, 5, 5, 6, 6, 7, 7);
            v8f_store_part(top + 2 * q, lo, first);
            v8f_store_part(bottom + 2 * q, lo, first);
            if (2 * left > 8) {
                v8f_store_part(top + 2 * q + 8, hi, 2 * left - 8);
                v8f_store_part(bottom + 2 * q + 8, hi, 2 * left - 8);
            }
        }
        if (w > 2 * wo) top[2 * wo] = bottom[2 * wo] = 0.0f;
    }
    if (h > 2 * ho) memset(dx + 2 * ho * w, 0, (size_t)w * sizeof(float));
}

static void *avg_grad_planes(void *arg)
{
    avg_job_t *j = arg;
    const int64_t *g = j->g, ho = g[0], wo = g[1], h = j->h, w = j->w;
    int64_t *buf = malloc((size_t)(2 * (ho + wo) + h + 1 + w + 1 + h * g[2] + w * g[3])
                          * sizeof(int64_t));
    float *share = malloc((size_t)(ho * wo) * sizeof(float));
    if (!buf || !share) {
        free(buf);
        free(share);
        j->failed = 1;
        return NULL;
    }
    int64_t *r0 = buf, *rn = r0 + ho, *c0 = rn + ho, *cn = c0 + wo;
    int64_t *rat = cn + wo, *cat = rat + h + 1, *rwin = cat + w + 1, *cwin = rwin + h * g[2];
    avg_spans(h, ho, g[2], g[4], g[6], r0, rn);
    avg_spans(w, wo, g[3], g[5], g[7], c0, cn);
    avg_windows(h, ho, g[2], g[4], g[6], rat, rwin);
    avg_windows(w, wo, g[3], g[5], g[7], cat, cwin);
    const int tiles = g[2] == 2 && g[3] == 2 && g[4] == 2 && g[5] == 2 && !g[6] && !g[7];
    for (int64_t p = j->begin; p < j->end; p++) {
        const float *d = j->dout + p * ho * wo;
        float *dx = j->out + p * h * w;
        if (tiles && (VL == 16 || wo >= 8)) {   /* AVX2, rows of 1-7: the loop below */
            avg_grad_tiles(d, dx, ho, wo, h, w);
            continue;
        }
        for (int64_t r = 0; r < ho; r++)
            for (int64_t q = 0; q < wo; q++)
                share[r * wo + q] = d[r * wo + q] / (float)(rn[r] * cn[q]);
        if (tiles) {           /* 2x2 windows at stride 2, unpadded: each share 4 times */
            for (int64_t y = 0; y < h; y++) {
                float *row = dx + y * w;
                const float *s = share + (y / 2) * wo;
                int64_t c = 0;
                if (y < 2 * ho)
                    for (; c < 2 * wo; c++) row[c] = 0.0f + s[c / 2];
                for (; c < w; c++) row[c] = 0.0f;
            }
            continue;
        }
        if (g[4] >= g[2] && g[5] >= g[3]) {        /* no overlap: one window at most */
            for (int64_t y = 0; y < h; y++) {
                const int64_t in = rat[y] < rat[y + 1];
                const float *row = share + (in ? rwin[rat[y]] * wo : 0);
                for (int64_t c = 0; c < w; c++)
                    dx[y * w + c] = in && cat[c] < cat[c + 1] ? 0.0f + row[cwin[cat[c]]] : 0.0f;
            }
            continue;
        }
        for (int64_t y = 0; y < h; y++)
            for (int64_t c = 0; c < w; c++) {
                float sum = 0.0f;
                for (int64_t a = rat[y]; a < rat[y + 1]; a++)
                    for (int64_t b = cat[c]; b < cat[c + 1]; b++)
                        sum += share[rwin[a] * wo + cwin[b]];
                dx[y * w + c] = sum;
            }
    }
    free(buf);
    free(share);
    return NULL;
}

/* out (planes, ho, wo) = average pooling of x (planes, h, w), or (grad) dx (planes, h, w)
 * for dout (planes, ho, wo); g: ho wo kh kw sh sw ph pw. Returns 0, or 1 where a buffer
 * could not be allocated. */
int avg_pool_f32(int grad, const float *x, const float *dout, float *out, int64_t planes,
                 int64_t h, int64_t w, const int64_t *g, int threads)
{
    avg_job_t jobs[POOL_MAX_THREADS];
    int64_t parts = pool_parts(threads, planes);
    for (int64_t t = 0; t < parts; t++) {
        jobs[t] = (avg_job_t){x, dout, out, g, 0, 0, h, w, 0};
        pool_share(planes, parts, t, &jobs[t].begin, &jobs[t].end);
    }
    pool_run(grad ? avg_grad_planes : avg_forward_planes, jobs, sizeof(avg_job_t), parts);
    int failed = 0;
    for (int64_t t = 0; t < parts; t++) failed |= jobs[t].failed;
    return failed;
}
