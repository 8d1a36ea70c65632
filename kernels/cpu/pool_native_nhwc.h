/* Channels-last (NHWC) max pooling for pool_native.c (included there), on C-contiguous
 * (N, H, W, C) float32 or float64 arrays, with the semantics of the NCHW kernels (and
 * of the numpy kernels of kernels/cpu/pool2d.py, the reference) applied to every
 * channel: the C values of a pixel are side by side, so every loop below runs over
 * channels, vectorized.
 * - The gradient: windows visited in reverse raster order; per window, each channel's
 *   first strictly greatest tap (padding -inf: a window whose first max is padding
 *   passes nothing on), kept for all channels at once in `best` and `at`; its dout
 *   assigned (disjoint windows) or added (overlapping ones) to dx there. float32 2x2
 *   windows at stride 2 without padding (the common pooling layer) go eight channels
 *   at a time (tiles8_nhwc): the four taps' vectors, the same choice made with vector
 *   masks, d written to the chosen tap and zeros to the others. Images are split in
 *   contiguous ranges over the threads, so results do not depend on them.
 * - The forward of 2x2 windows at stride 2 that tile the plane: the max of the two
 *   rows, then of the two neighbours, NaN propagating (numpy's maximum), per channel. */

#define NHWC_GRADIENT(T)                                                                \
    static int gradient_nhwc_##T(job_t *j) {                                            \
        const int64_t h = j->h, w = j->w, c = j->c, ho = j->ho, wo = j->wo;             \
        const int64_t kh = j->kh, kw = j->kw, sh = j->sh, sw = j->sw;                   \
        const int disjoint = sh >= kh && sw >= kw;                                      \
        T *best = malloc((c > 0 ? c : 1) * sizeof(T));                                  \
        int64_t *at = malloc((c > 0 ? c : 1) * sizeof(int64_t));                        \
        if (!best || !at) { free(best); free(at); return 1; }                           \
        for (int64_t p = j->begin; p < j->end; p++) {                                   \
            const T *x = (const T *)j->x + p * h * w * c;                               \
            const T *dout = (const T *)j->dout + p * ho * wo * c;                       \
            T *dx = (T *)j->dx + p * h * w * c;                                         \
            for (int64_t e = 0; e < h * w * c; e++) dx[e] = 0;                          \
            for (int64_t oh = ho - 1; oh >= 0; oh--)                                    \
                for (int64_t ow = wo - 1; ow >= 0; ow--) {                              \
                    const int64_t r0 = oh * sh - j->ph, c0 = ow * sw - j->pw;           \
                    for (int64_t i = 0; i < kh; i++)                                    \
                        for (int64_t k = 0; k < kw; k++) {                              \
                            const int64_t r = r0 + i, q = c0 + k, pixel = r * w + q;    \
                            const int inside = r >= 0 && r < h && q >= 0 && q < w;      \
                            if (i == 0 && k == 0) {                                     \
                                for (int64_t ch = 0; ch < c; ch++) {                    \
                                    best[ch] = inside ? x[pixel * c + ch] : (T)-INFINITY;\
                                    at[ch] = inside ? pixel : -1;                       \
                                }                                                       \
                                continue;                                               \
                            }                                                           \
                            if (!inside) continue;        /* -inf: never greater */     \
                            const T *xp = x + pixel * c;                                \
                            for (int64_t ch = 0; ch < c; ch++) {                        \
                                const int greater = xp[ch] > best[ch];                  \
                                best[ch] = greater ? xp[ch] : best[ch];                 \
                                at[ch] = greater ? pixel : at[ch];                      \
                            }                                                           \
                        }                                                               \
                    const T *d = dout + (oh * wo + ow) * c;                             \
                    for (int64_t ch = 0; ch < c; ch++)                                  \
                        if (at[ch] >= 0) {                                              \
                            T *to = dx + at[ch] * c + ch;                               \
                            *to = disjoint ? d[ch] : *to + d[ch];                       \
                        }                                                               \
                }                                                                       \
        }                                                                               \
        free(best);                                                                     \
        free(at);                                                                       \
        return 0;                                                                       \
    }

NHWC_GRADIENT(float)
NHWC_GRADIENT(double)

/* dx of one float32 NHWC image for 2x2 windows at stride 2, no padding (see the file
 * comment); the rows and columns no window covers get zeros. */
static void tiles_grad_nhwc_float(const float *x, const float *dout, float *dx, int64_t h,
                                  int64_t w, int64_t c, int64_t ho, int64_t wo) {
    for (int64_t e = 0; e < h * w * c; e++) dx[e] = 0;
    for (int64_t oh = 0; oh < ho; oh++)
        for (int64_t ow = 0; ow < wo; ow++) {
            const int64_t t00 = (2 * oh * w + 2 * ow) * c, t01 = t00 + c, t10 = t00 + w * c;
            const int64_t t11 = t10 + c;
            const float *d = dout + (oh * wo + ow) * c;
            int64_t ch = 0;
            for (; ch + 8 <= c; ch += 8) {
                v8 x00 = load8(x + t00 + ch), x01 = load8(x + t01 + ch);
                v8 x10 = load8(x + t10 + ch), x11 = load8(x + t11 + ch);
                v8i m1 = x01 > x00;
                v8 best = pick(m1, x01, x00);
                v8i m2 = x10 > best;
                best = pick(m2, x10, best);
                v8i m3 = x11 > best;
                m2 &= ~m3;
                m1 &= ~(m2 | m3);
                v8i m0 = ~(m1 | m2 | m3), dv = (v8i)load8(d + ch);
                store8(dx + t00 + ch, (v8)(dv & m0));
                store8(dx + t01 + ch, (v8)(dv & m1));
                store8(dx + t10 + ch, (v8)(dv & m2));
                store8(dx + t11 + ch, (v8)(dv & m3));
            }
            for (; ch < c; ch++) {
                const int64_t taps[4] = {t00, t01, t10, t11};
                int64_t at = t00 + ch;
                float best = x[at];
                for (int k = 1; k < 4; k++)
                    if (x[taps[k] + ch] > best) best = x[taps[k] + ch], at = taps[k] + ch;
                dx[at] = d[ch];
            }
        }
}

static void *run_nhwc(void *arg) {
    job_t *j = arg;
    if (!j->f64 && tiles_2x2(j)) {
        for (int64_t p = j->begin; p < j->end; p++)
            tiles_grad_nhwc_float((const float *)j->x + p * j->h * j->w * j->c,
                                  (const float *)j->dout + p * j->ho * j->wo * j->c,
                                  (float *)j->dx + p * j->h * j->w * j->c, j->h, j->w, j->c,
                                  j->ho, j->wo);
        j->failed = 0;
        return 0;
    }
    j->failed = j->f64 ? gradient_nhwc_double(j) : gradient_nhwc_float(j);
    return 0;
}

/* dx (n, h, w, c) of max pooling of x (n, h, w, c) for dout (n, ho, wo, c) (see the file
 * comment). geometry: ho, wo, kh, kw, sh, sw, ph, pw. Returns 0, or 1 when a thread's
 * buffers could not be allocated (dx is then incomplete). */
int max_pool_grad_nhwc(int f64, const void *x, const void *dout, void *dx, int64_t n,
                       int64_t h, int64_t w, int64_t c, const int64_t *geometry,
                       int threads) {
    job_t jobs[POOL_MAX_THREADS];
    int64_t parts = pool_parts(threads, n);
    for (int64_t t = 0; t < parts; t++) {
        job_t *j = &jobs[t];
        j->x = x; j->dout = dout; j->dx = dx;
        pool_share(n, parts, t, &j->begin, &j->end);
        j->h = h; j->w = w; j->c = c;
        j->ho = geometry[0]; j->wo = geometry[1]; j->kh = geometry[2]; j->kw = geometry[3];
        j->sh = geometry[4]; j->sw = geometry[5]; j->ph = geometry[6]; j->pw = geometry[7];
        j->f64 = f64; j->failed = 0;
    }
    pool_run(run_nhwc, jobs, sizeof(job_t), parts);
    int failed = 0;
    for (int64_t t = 0; t < parts; t++) failed |= jobs[t].failed;
    return failed;
}

#define NHWC_TILES(T)                                                                   \
    static void tiles_nhwc_##T(const T *restrict x, T *restrict out, int64_t rows,      \
                               int64_t w, int64_t c) {                                  \
        for (int64_t r = 0; r < rows; r++) {                                            \
            const T *top = x + 2 * r * w * c, *bottom = top + w * c;                    \
            T *o = out + r * (w / 2) * c;                                               \
            for (int64_t q = 0; q < w / 2; q++)                                         \
                for (int64_t ch = 0; ch < c; ch++) {                                    \
                    const int64_t left = 2 * q * c + ch, right = left + c;              \
                    const T a = MAX_NAN(top[left], bottom[left]);                       \
                    const T b = MAX_NAN(top[right], bottom[right]);                     \
                    o[q * c + ch] = MAX_NAN(a, b);                                      \
                }                                                                       \
        }                                                                               \
    }

NHWC_TILES(float)
NHWC_TILES(double)

/* out (rows, w / 2, c): the max of each 2x2 window of x (2 rows, w, c) per output row,
 * rows = n * h / 2, w even (see the file comment). Returns 0. */
int max_pool_tiles_nhwc(int f64, const void *x, void *out, int64_t rows, int64_t w,
                        int64_t c) {
    if (f64)
        tiles_nhwc_double(x, out, rows, w, c);
    else
        tiles_nhwc_float(x, out, rows, w, c);
    return 0;
}
