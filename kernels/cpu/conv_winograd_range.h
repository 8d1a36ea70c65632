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
 * direct convolution does - when, over its window (P2: the root of a position's sum of
 * squares over the C channels, P2 <= P <= sqrt(C) P2, which is what the checks measure):
 *   - a value is not finite, or P2 overflows (P2_win is not finite);
 *   - sqrt(C) P2_win max|g| > WG_LIMIT = FLT_MAX 2^-21: P_win max|g| could be over
 *     it, and the transforms could overflow;
 *   - P2_win > range * P2_field for one of the tile's stored outputs (range: the
 *     caller's, conv_native.WINOGRAD_RANGE): a value outside that output's window
 *     would dominate its rounding error.
 * Otherwise P_win <= sqrt(C) range P_field, and about range P_field where the
 * channels' values are of one scale (P2 is then about P / sqrt(C) everywhere): every
 * output's error is below about range E u max|g| P_field (sqrt(C) times that at
 * most), within range E (a few hundred for range 16) rounding units of the largest
 * product its own window holds, whatever lies outside that window. Outputs outside a non-finite
 * value's window stay finite, and those inside it are NaN or +-inf exactly as the
 * direct convolution makes them. The checks cost one pass over each image
 * (P2 per position) and 36 + 16 x 9 comparisons per tile; on data of one scale (any
 * activations of a trained or random net) no tile goes direct. An all-zero window
 * (P2_win = 0) stays Winograd: its outputs are exactly 0. */

#define WG_LIMIT (__FLT_MAX__ / 2097152.0f)     /* FLT_MAX 2^-21 */

/* The magnitudes of one image, in its mag array: sq (hb x wb: the sum over the
 * channels of value^2 at each position; wg_fill makes it for NCHW, wg_squares for
 * NHWC), then rm (hb x 4 tw: the largest of each 3 neighbours in a row of sq) and fm
 * (4 th x 4 tw: the largest P2^2 of the 3x3 window of each output), made by
 * wg_fields. NaN (a NaN value) counts as +inf. */
#define WG_RM(a, mag) ((mag) + (a)->hb * (a)->wb)
#define WG_FM(a, mag) (WG_RM(a, mag) + (a)->hb * 4 * (a)->tw)

/* sq of an NHWC image from its buffer, eight positions at a time (their channels'
 * squares summed in vectors, then transposed and added). */
static void wg_squares(const wg_t *a, const float *buf, float *sq)
{
    int64_t total = a->hb * a->wb, q = 0;
    for (; q + 8 <= total; q += 8) {
        v8 s[8];
        for (int k = 0; k < 8; k++) {
            s[k] = (v8){0};
            for (int64_t c8 = 0; c8 < a->cp; c8 += 8) {
                v8 v = load(buf + (q + k) * a->cp + c8);
                s[k] += v * v;
            }
        }
        transpose8(s);
        *(v8u *)(sq + q) = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    }
    for (; q < total; q++) {
        float t = 0.0f;
        for (int64_t c = 0; c < a->cp; c++) t += buf[q * a->cp + c] * buf[q * a->cp + c];
        sq[q] = t;
    }
}

static inline float wg_finite_or_inf(float v)
{
    return v <= __FLT_MAX__ ? v : __builtin_inff();
}

static inline v8 wg_vfinite_or_inf(v8 v)
{
    v8i keep = v <= __FLT_MAX__;
    return (v8)(((v8i)v & keep) | ((v8i)((v8){0} + __builtin_inff()) & ~keep));
}

static inline v8 wg_vmax(v8 u, v8 v)
{
    v8i first = u > v;
    return (v8)(((v8i)u & first) | ((v8i)v & ~first));
}

static inline v8 wg_vmin(v8 u, v8 v)
{
    v8i first = u < v;
    return (v8)(((v8i)u & first) | ((v8i)v & ~first));
}

/* rm and fm of an image from its sq (see above), eight values at a time. Returns 0
 * when no tile of the image can be wide (its largest P2^2 is finite, within the limit
 * and at most range^2 times every stored output's P2_field^2: the usual case, which
 * then checks no tile), else 1. */
static int wg_fields(const wg_t *a, float *mag)
{
    float *rm = WG_RM(a, mag), *fm = WG_FM(a, mag);
    int64_t width = 4 * a->tw;
    v8 most = {0}, least = (v8){0} + __builtin_inff();
    for (int64_t y = 0; y < a->hb; y++) {
        const float *s = mag + y * a->wb;
        float *r = rm + y * width;
        int64_t x = 0;
        for (; x + 8 <= width; x += 8) {
            v8 m = wg_vmax(wg_vmax(wg_vfinite_or_inf(load(s + x)),
                                   wg_vfinite_or_inf(load(s + x + 1))),
                           wg_vfinite_or_inf(load(s + x + 2)));
            *(v8u *)(r + x) = m;
            most = wg_vmax(most, m);
        }
        for (; x < width; x++) {
            float u = wg_finite_or_inf(s[x]), v = wg_finite_or_inf(s[x + 1]);
            float w = wg_finite_or_inf(s[x + 2]), m = u > v ? u : v;
            r[x] = m > w ? m : w;
            most[0] = r[x] > most[0] ? r[x] : most[0];
        }
    }
    for (int64_t y = 0; y < 4 * a->th; y++) {
        const float *r = rm + y * width;
        float *f = fm + y * width;
        int64_t x = 0, stored = y < a->ho ? a->wo : 0;
        for (; x + 8 <= width; x += 8) {
            v8 m = wg_vmax(wg_vmax(load(r + x), load(r + x + width)), load(r + x + 2 * width));
            *(v8u *)(f + x) = m;
            if (x + 8 <= stored) least = wg_vmin(least, m);
        }
        for (; x < width; x++) {
            float m = r[x] > r[x + width] ? r[x] : r[x + width];
            f[x] = m > r[x + 2 * width] ? m : r[x + 2 * width];
        }
        for (x = stored / 8 * 8; x < stored; x++) least[0] = f[x] < least[0] ? f[x] : least[0];
    }
    float hi = 0.0f, lo = __builtin_inff();
    for (int l = 0; l < 8; l++) {
        hi = most[l] > hi ? most[l] : hi;
        lo = least[l] < lo ? least[l] : lo;
    }
    return !(hi <= __FLT_MAX__) || !(__builtin_sqrtf(hi * (float)a->c) * a->gmax <= WG_LIMIT)
           || hi > a->range * a->range * lo;
}

/* 1 when tile (ty, tx) of the image whose magnitudes are `mag` is computed directly
 * (see the file comment): its 16 outputs' windows make up its 6x6 window, so P2_win^2
 * is the largest of their fm values, P2_field^2 that of each stored output's. */
static int wg_wide(const wg_t *a, const float *mag, int64_t ty, int64_t tx)
{
    int64_t width = 4 * a->tw;
    const float *m = WG_FM(a, mag) + 4 * ty * width + 4 * tx;
    int64_t rows = a->ho - 4 * ty < 4 ? a->ho - 4 * ty : 4;
    int64_t cols = a->wo - 4 * tx < 4 ? a->wo - 4 * tx : 4;
    float most = 0.0f, least = __builtin_inff();
    for (int64_t i = 0; i < 4; i++)
        for (int64_t j = 0; j < 4; j++) {
            float v = m[i * width + j];
            most = v > most ? v : most;
            if (i < rows && j < cols) least = v < least ? v : least;
        }
    if (!(most <= __FLT_MAX__)) return 1;                      /* NaN or inf, or overflow */
    if (!(__builtin_sqrtf(most * (float)a->c) * a->gmax <= WG_LIMIT)) return 1;
    return most > a->range * a->range * least;
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
            for (int64_t o0 = 0; o0 < a->op; o0 += 8) {      /* op: a multiple of 8 */
                v8 s0 = {0};
                for (int k = 0; k < 9; k++) {
                    const float *in = win + ((k / 3) * a->wb + k % 3) * a->cp;
                    const float *f = wt + k * a->cp * a->op + o0;
                    for (int64_t c = 0; c < a->c; c++) s0 += in[c] * load(f + c * a->op);
                }
                *(v8u *)(dst + o0) = s0;
            }
        }
}

/* The wide tiles among the block's t0 .. t0 + nb - 1 (of the group whose buffers are
 * bufs, magnitudes mags and output buffers ys; check[g]: whether image g of the group
 * can have any, wg_fields) computed again directly over their Winograd outputs.
 * Returns how many, or -1 when memory ran out. */
static int64_t wg_direct_tiles(wg_t *a, const float *bufs, const float *mags,
                               const int *check, int64_t t0, int64_t nb, float *ys)
{
    int64_t count = 0;
    for (int64_t b = 0; b < nb; b++) {
        int64_t img = (t0 + b) / a->tiles, t = (t0 + b) % a->tiles;
        int64_t ty = t / a->tw, tx = t % a->tw;
        if (!check[img] || !wg_wide(a, mags + img * a->mag_size, ty, tx)) continue;
        const float *wt = wg_direct_filter(a);
        if (!wt) return -1;
        wg_direct_tile(a, wt, bufs + img * a->buf_size, ty, tx, ys + img * a->y_size);
        count++;
    }
    return count;
}
