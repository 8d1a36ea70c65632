/* Which Winograd tiles conv_winograd.h computes directly instead, and how.
 *
 * The transforms mix every value of a tile's 6x6 window of input into all 16 of its
 * outputs: an output is exact only in exact arithmetic. In float32 each output of a
 * tile carries rounding errors of the order of u = 2^-24 times the largest products
 * the transforms form: with per-position magnitudes P(y, x) = sum over channels of
 * |x_c(y, x)|, an error up to about E u max|g| P_win, where P_win is the largest P in
 * the window and max|g| the filter's largest value. The transforms' coefficients
 * (points 0, +-1, +-2) bound E below 2^21 (|B' d B| <= 100 max|d|, |U| <= max|g|,
 * |A' M A| <= 361 max|M|, and the channels' largest values add up to at most 36
 * P_win); measured on random data, E is about 20-40 (the bound is never approached
 * with cancelling signs). The direct convolution's error on the same output is about
 * u max|g| P_field times the count of its terms, P_field being the largest P in the
 * output's own 3x3 window. So Winograd is as accurate as the direct convolution as
 * long as P_win / P_field stays small; one large value in a window (1e6 among values
 * near 1) gives every output of the tile an error near 1e6 E u ~ 1, also the outputs
 * whose own window does not contain it; a NaN or an infinity anywhere in the window
 * makes all 16 outputs NaN; values near 3e37 overflow the transforms (inf - inf).
 *
 * Hence a tile is computed directly - each output from its own 3x3 window, as the
 * direct convolution does - when, over its window:
 *   - a value is not finite, or P overflows (P_win is not finite);
 *   - P_win max|g| > WG_LIMIT = FLT_MAX 2^-21: the transforms could overflow;
 *   - P_win > range * P_field for one of the tile's stored outputs (range: the
 *     caller's, conv_native.WINOGRAD_RANGE): a value outside that output's window
 *     would dominate its rounding error.
 * Otherwise every output's error is below about range E u max|g| P_field: within
 * range E (a few hundred for range 16) rounding units of the largest product its own
 * window holds, whatever lies outside that window. Outputs outside a non-finite
 * value's window stay finite, and those inside it are NaN or +-inf exactly as the
 * direct convolution makes them. The checks cost one pass over each image
 * (P per position) and 36 + 16 x 9 comparisons per tile; on data of one scale (any
 * activations of a trained or random net) no tile goes direct. An all-zero window
 * (P_win = 0) stays Winograd: its outputs are exactly 0. */

#define WG_LIMIT (__FLT_MAX__ / 2097152.0f)     /* FLT_MAX 2^-21 */

/* mag[q] = P of each position q of an image's buffer: the sum over its channels of
 * |value| (NaN when one is NaN, inf when one is infinite or the sum overflows). */
static void wg_magnitudes(const wg_t *a, const float *buf, float *mag)
{
    const v8i sign = (v8i){0} + 0x7fffffff;
    for (int64_t q = 0; q < a->hb * a->wb; q++) {
        const float *p = buf + q * a->cp;
        v8 s = {0};
        for (int64_t c8 = 0; c8 < a->cp; c8 += 8) s += (v8)((v8i)load(p + c8) & sign);
        float t = 0.0f;
        for (int l = 0; l < 8; l++) t += s[l];
        mag[q] = t;
    }
}

/* 1 when tile (ty, tx) of the image whose magnitudes are `mag` is computed directly
 * (see the file comment). */
static int wg_wide(const wg_t *a, const float *mag, int64_t ty, int64_t tx)
{
    const float *m = mag + 4 * ty * a->wb + 4 * tx;
    float most = 0.0f;
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < 6; j++) {
            float v = m[i * a->wb + j];
            if (!(v <= __FLT_MAX__)) return 1;                  /* NaN or inf */
            most = v > most ? v : most;
        }
    if (!(most * a->gmax <= WG_LIMIT)) return 1;
    int64_t rows = a->ho - 4 * ty < 4 ? a->ho - 4 * ty : 4;
    int64_t cols = a->wo - 4 * tx < 4 ? a->wo - 4 * tx : 4;
    for (int64_t y = 0; y < rows; y++)
        for (int64_t x = 0; x < cols; x++) {
            float field = 0.0f;
            for (int i = 0; i < 3; i++)
                for (int j = 0; j < 3; j++) {
                    float v = m[(y + i) * a->wb + x + j];
                    field = v > field ? v : field;
                }
            if (most > a->range * field) return 1;
        }
    return 0;
}

/* The filter as [9][cp][op] (taps, input channels, output channels; zeros past c, o),
 * made by the first direct tile of a call; NULL when memory ran out. */
static const float *wg_direct_filter(wg_t *a)
{
    float *wt = __atomic_load_n(&a->wt, __ATOMIC_ACQUIRE);
    if (wt) return wt;
    pthread_mutex_lock(&a->lock);
    if (!a->wt) {
        float *t = calloc(9 * a->cp * a->op, sizeof(float));
        if (t)
            for (int64_t oc = 0; oc < a->o; oc++)
                for (int64_t c = 0; c < a->c; c++)
                    for (int64_t k = 0; k < 9; k++)
                        t[(k * a->cp + c) * a->op + oc] = a->filter[(oc * a->c + c) * 9 + k];
        __atomic_store_n(&a->wt, t, __ATOMIC_RELEASE);
    }
    wt = a->wt;
    pthread_mutex_unlock(&a->lock);
    return wt;
}

/* The stored outputs of tile (ty, tx) of one image (buffer `buf`), each from its own
 * 3x3 window, into the image's output buffer y (positions 4 th x 4 tw of op
 * channels). */
static void wg_direct_tile(const wg_t *a, const float *wt, const float *buf, int64_t ty,
                           int64_t tx, float *y)
{
    int64_t rows = a->ho - 4 * ty < 4 ? a->ho - 4 * ty : 4;
    int64_t cols = a->wo - 4 * tx < 4 ? a->wo - 4 * tx : 4;
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) {
            const float *win = buf + ((4 * ty + i) * a->wb + 4 * tx + j) * a->cp;
            float *dst = y + ((4 * ty + i) * 4 * a->tw + 4 * tx + j) * a->op;
            for (int64_t o0 = 0; o0 < a->op; o0 += WG_OV) {
                v8 s0 = {0}, s1 = {0};
                for (int k = 0; k < 9; k++) {
                    const float *in = win + ((k / 3) * a->wb + k % 3) * a->cp;
                    const float *f = wt + k * a->cp * a->op + o0;
                    for (int64_t c = 0; c < a->c; c++) {
                        s0 += in[c] * load(f + c * a->op);
                        s1 += in[c] * load(f + c * a->op + 8);
                    }
                }
                *(v8u *)(dst + o0) = s0;
                *(v8u *)(dst + o0 + 8) = s1;
            }
        }
}

/* The wide tiles among the block's t0 .. t0 + nb - 1 (of the group whose buffers are
 * bufs, magnitudes mags and output buffers ys) computed again directly over their
 * Winograd outputs. Returns how many, or -1 when memory ran out. */
static int64_t wg_direct_tiles(wg_t *a, const float *bufs, const float *mags, int64_t t0,
                               int64_t nb, float *ys)
{
    int64_t count = 0;
    for (int64_t b = 0; b < nb; b++) {
        int64_t img = (t0 + b) / a->tiles, t = (t0 + b) % a->tiles;
        int64_t ty = t / a->tw, tx = t % a->tw;
        if (!wg_wide(a, mags + img * a->mag_size, ty, tx)) continue;
        const float *wt = wg_direct_filter(a);
        if (!wt) return -1;
        wg_direct_tile(a, wt, bufs + img * a->buf_size, ty, tx, ys + img * a->y_size);
        count++;
    }
    return count;
}
