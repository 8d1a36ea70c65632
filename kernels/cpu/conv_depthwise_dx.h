/* The input gradient of the depthwise conv kernels (conv_depthwise.c, which includes
 * this after its geometry, buffers and forward pass; its file comment says how dx is
 * gathered from dout): dx rows of one residue modulo the stride, four at a time, each
 * column phase a vector of VL at a time, the phases interleaved into dx's rows after
 * (two phases by permutes where the target has AVX-512). */

/* both[2 t] = even[t] and both[2 t + 1] = odd[t], t < count (both holds 2 count rounded
 * up to 2 VL). */
static void merge_pairs(float *restrict both, const float *restrict even,
                        const float *restrict odd, int64_t count)
{
    int64_t t = 0;
#if defined(__AVX512F__)
    const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7,
                                          23);
    const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
    for (; t < count; t += 16) {
        const __m512 e = _mm512_loadu_ps(even + t), o = _mm512_loadu_ps(odd + t);
        _mm512_storeu_ps(both + 2 * t, _mm512_permutex2var_ps(e, low, o));
        _mm512_storeu_ps(both + 2 * t + 16, _mm512_permutex2var_ps(e, high, o));
    }
#endif
    for (; t < count; t++) {
        both[2 * t] = even[t];
        both[2 * t + 1] = odd[t];
    }
}

/* dx rows a + sh (r0 + r), r < rows <= R (rows of one residue a of Y modulo sh: one
 * set of tap rows), phase p, columns t0 .. t0 + VL - 1 of the phase (padded columns
 * p + sw t), into dst[r] + t0. */
static inline __attribute__((always_inline)) void input_rows(
    const geo_t *g, const float *dbuf, const float *wc, int64_t a, int64_t r0, int64_t p,
    int64_t t0, float *const *dst, int64_t count, const int rows)
{
    vf acc[R];
    for (int r = 0; r < rows; r++) acc[r] = (vf){0};
    const int64_t plane = g->drows * g->wd, ni = g->icount[a], nk = g->kcount[p];
    const int64_t *itaps = g->itaps + 2 * a * g->kh, *ktaps = g->ktaps + 2 * p * g->kw;
    for (int64_t m = 0; m < g->m; m++) {
        const float *dm = dbuf + m * plane + g->lp + t0, *wm = wc + m * g->kh * g->kw;
        for (int64_t ii = 0; ii < ni; ii++) {
            const float *drow = dm + (itaps[2 * ii + 1] + r0) * g->wd;
            const float *wi = wm + itaps[2 * ii] * g->kw;
            for (int64_t kk = 0; kk < nk; kk++) {
                const vf wv = (vf){0} + wi[ktaps[2 * kk]];
                const float *from = drow - ktaps[2 * kk + 1];
                for (int r = 0; r < rows; r++) acc[r] += wv * vf_load(from + r * g->wd);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        if (count == VL) vf_store(dst[r] + t0, acc[r]);
        else vf_store_part(dst[r] + t0, acc[r], count);
    }
}

/* dx rows y0, y0 + sh, ... (rows of them) of one plane: sw == 1 straight into dx,
 * else each phase into `phases` (sw rows of wt floats a row) and then interleaved. */
static inline __attribute__((always_inline)) void input_row_set(
    const geo_t *g, const float *dbuf, const float *wc, float *dx, float *phases, int64_t a,
    int64_t r0, const int rows)
{
    const int64_t y0 = a + r0 * g->sh;
    float *dst[R];
    if (g->sw == 1) {
        for (int r = 0; r < rows; r++) dst[r] = dx + (y0 + r * g->sh) * g->w - g->pw;
        for (int64_t x0 = 0; x0 < g->w; x0 += VL)
            input_rows(g, dbuf, wc, a, r0, 0, x0 + g->pw, dst,
                       g->w - x0 < VL ? g->w - x0 : VL, rows);
        return;
    }
    const int64_t stride = round_up(g->wt, VL) + VL;
    for (int64_t p = 0; p < g->sw; p++) {
        for (int r = 0; r < rows; r++) dst[r] = phases + (r * g->sw + p) * stride;
        for (int64_t t0 = 0; t0 < g->wt; t0 += VL)
            input_rows(g, dbuf, wc, a, r0, p, t0, dst, VL, rows);
    }
    for (int r = 0; r < rows; r++) {
        float *row = dx + (y0 + r * g->sh) * g->w;
        if (g->sw == 2) {        /* padded columns 2 t and 2 t + 1 side by side, from pw on */
            float *both = phases + (R * 2 + r) * stride;
            merge_pairs(both, phases + r * 2 * stride, phases + (r * 2 + 1) * stride, g->wt);
            copy_row(row, both + g->pw, g->w);
            continue;
        }
        for (int64_t p = 0; p < g->sw; p++) {      /* dx column p + sw t - pw */
            const float *ph = phases + (r * g->sw + p) * stride;
            int64_t t = p >= g->pw ? 0 : (g->pw - p + g->sw - 1) / g->sw;
            for (int64_t x = p + g->sw * t - g->pw; x < g->w; x += g->sw, t++) row[x] = ph[t];
        }
    }
}

static void *input_job(void *arg)
{
    job_t *j = arg;
    const geo_t *g = j->g;
    const int64_t taps = g->kh * g->kw, plane = g->drows * g->wd;
    float *dbuf = calloc((size_t)(g->m * plane + VL), sizeof(float));
    float *phases = malloc((size_t)(R * (g->sw + 2) * (round_up(g->wt, VL) + VL))
                           * sizeof(float));
    if (!dbuf || !phases) {
        free(dbuf);
        free(phases);
        j->failed = 1;
        return NULL;
    }
    for (int64_t at = j->begin; at < j->end; at++) {         /* plane (image, channel) */
        const int64_t c = at % g->c, n = at / g->c;
        for (int64_t m = 0; m < g->m; m++) {
            const float *d = j->d + (n * g->o + c * g->m + m) * g->ho * g->wo;
            for (int64_t r = 0; r < g->ho; r++)
                copy_row(dbuf + m * plane + (g->tr + r) * g->wd + g->lp, d + r * g->wo, g->wo);
        }
        const float *wc = j->w + c * g->m * taps;
        float *dx = j->out + at * g->h * g->w;
        for (int64_t a = 0; a < g->sh && a < g->h; a++) {     /* rows of one residue */
            const int64_t count = (g->h - 1 - a) / g->sh + 1;
            int64_t r = 0;
            for (; r + R <= count; r += R) input_row_set(g, dbuf, wc, dx, phases, a, r, R);
            switch (count - r) {
            case 3: input_row_set(g, dbuf, wc, dx, phases, a, r, 3); break;
            case 2: input_row_set(g, dbuf, wc, dx, phases, a, r, 2); break;
            case 1: input_row_set(g, dbuf, wc, dx, phases, a, r, 1); break;
            }
        }
    }
    free(dbuf);
    free(phases);
    return NULL;
}

/* dx (N, C, H, W) of the depthwise conv of `dims` (as conv_depthwise_forward's) for
 * dout d (N, O, Ho, Wo) and filter w. */
int conv_depthwise_input_grad(const float *w, const float *d, float *dx, const int64_t *dims,
                              int64_t threads)
{
    return run(dims, input_job, dims[0] * dims[1], NULL, w, NULL, NULL, d, dx, threads);
}
