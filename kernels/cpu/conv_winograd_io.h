/* How conv_winograd.h's images go in and out (included there): each image of x into
 * a zero-bordered buffer with the channels innermost (padded to cp), from NCHW
 * (blocks of 8 channels by 8 columns transposed in registers) or NHWC (runs of
 * pixels copied); and the transformed outputs (positions of op channels) into out,
 * NCHW (transposed back) or NHWC (copied), with fused_conv2d's epilogue. */

/* Image `img` into buf (hb x wb positions of cp channels), whose zeros were set
 * once: blocks of 8 channels by 8 columns transposed in registers (a row's last
 * columns through masked loads), channels past the last 8 one value at a time; and the sum over channels of value^2 of each position it writes
 * into sq (hb x wb, the same places: conv_winograd_range.h), from the same
 * registers. */
static void wg_fill(const wg_t *a, int64_t img, float *buf, float *sq)
{
    int64_t count = a->wb - a->pw < a->w ? a->wb - a->pw : a->w;    /* columns kept */
    for (int64_t y = 0; y < a->h && a->ph + y < a->hb; y++) {
        const float *from = a->x + (img * a->c * a->h + y) * a->w;
        float *row = buf + ((a->ph + y) * a->wb + a->pw) * a->cp;
        float *sums = sq + (a->ph + y) * a->wb + a->pw;
        for (int64_t x = 0; x < count; x++) sums[x] = 0.0f;
        int64_t c0 = 0;
        for (; c0 + 8 <= a->c; c0 += 8) {
            int64_t x = 0;
            for (; x + 8 <= count; x += 8) {
                v8 r[8], s = {0};
                for (int k = 0; k < 8; k++) {
                    r[k] = load(from + (c0 + k) * a->h * a->w + x);
                    s += r[k] * r[k];
                }
                *(v8u *)(sums + x) = load(sums + x) + s;
                transpose8(r);
                for (int k = 0; k < 8; k++) *(v8u *)(row + (x + k) * a->cp + c0) = r[k];
            }
            if (x < count) {                   /* the last columns: masked loads */
                int64_t left = count - x;
                v8 r[8], s = {0};
                for (int k = 0; k < 8; k++) {
                    r[k] = v8f_load_part(from + (c0 + k) * a->h * a->w + x, left);
                    s += r[k] * r[k];
                }
                v8f_store_part(sums + x, v8f_load_part(sums + x, left) + s, left);
                transpose8(r);
                for (int64_t k = 0; k < left; k++) *(v8u *)(row + (x + k) * a->cp + c0) = r[k];
            }
        }
        for (; c0 < a->c; c0++)
            for (int64_t x = 0; x < count; x++) {
                float v = from[c0 * a->h * a->w + x];
                row[x * a->cp + c0] = v;
                sums[x] += v * v;
            }
    }
}

/* Image `img` of channels-last x (rows x_row, images x_image floats apart) into buf
 * as wg_fill does: one run of pixels per row where C fills the padded channels, else
 * one pixel at a time. */
static void wg_fill_nhwc(const wg_t *a, int64_t img, float *buf)
{
    int64_t count = a->wb - a->pw < a->w ? a->wb - a->pw : a->w;
    for (int64_t y = 0; y < a->h && a->ph + y < a->hb && count > 0; y++) {
        const float *from = a->x + img * a->x_image + y * a->x_row;
        float *row = buf + ((a->ph + y) * a->wb + a->pw) * a->cp;
        if (a->c == a->cp) {
            memcpy(row, from, count * a->c * sizeof(float));
            continue;
        }
        for (int64_t x = 0; x < count; x++)
            memcpy(row + x * a->cp, from + x * a->c, a->c * sizeof(float));
    }
}

/* The epilogue of one value: s (+ residual at res) (then max(., 0)). */
static inline float wg_finish(const wg_t *a, float s, const float *res)
{
    if (res) s += *res;
    return a->relu && s < 0 ? 0.0f : s;
}

/* The outputs of image `img` from y (channels innermost) to out (NCHW), with the
 * epilogue: blocks of 8 columns by 8 channels transposed in registers (a row's last
 * columns through masked stores), channels past the last 8 one value at a time. */
static void wg_store(const wg_t *a, const float *y, int64_t img)
{
    int64_t plane = a->ho * a->wo, row = 4 * a->tw;
    float *out = a->out + img * a->o * plane;
    const float *res = a->residual ? a->residual + img * a->o * plane : NULL;
    for (int64_t r = 0; r < a->ho; r++) {
        const float *yr = y + r * row * a->op;
        int64_t oc = 0;
        for (; oc + 8 <= a->o; oc += 8) {
            int64_t x = 0;
            for (; x + 8 <= a->wo; x += 8) {
                v8 v[8];
                for (int k = 0; k < 8; k++) v[k] = load(yr + (x + k) * a->op + oc);
                transpose8(v);
                for (int k = 0; k < 8; k++) {
                    int64_t at = (oc + k) * plane + r * a->wo + x;
                    v8 s = v[k] + (a->bias ? a->bias[oc + k] : 0.0f);
                    if (res) s += load(res + at);
                    if (a->relu) s = (v8)((v8i)s & ~(s < 0));    /* NaN stays NaN */
                    *(v8u *)(out + at) = s;
                }
            }
            if (x < a->wo) {                    /* the last columns: masked stores */
                int64_t left = a->wo - x;
                v8 v[8];
                for (int k = 0; k < 8; k++)
                    v[k] = k < left ? load(yr + (x + k) * a->op + oc) : (v8){0};
                transpose8(v);
                for (int k = 0; k < 8; k++) {
                    int64_t at = (oc + k) * plane + r * a->wo + x;
                    v8 s = v[k] + (a->bias ? a->bias[oc + k] : 0.0f);
                    if (res) s += v8f_load_part(res + at, left);
                    if (a->relu) s = (v8)((v8i)s & ~(s < 0));
                    v8f_store_part(out + at, s, left);
                }
            }
        }
        for (; oc < a->o; oc++)
            for (int64_t x = 0; x < a->wo; x++) {
                int64_t at = oc * plane + r * a->wo + x;
                float s = yr[x * a->op + oc] + (a->bias ? a->bias[oc] : 0.0f);
                out[at] = wg_finish(a, s, res ? res + at : NULL);
            }
    }
}

/* The outputs of image `img` from y (channels innermost) to out (NHWC), with the
 * epilogue, eight channels at a time. */
static void wg_store_nhwc(const wg_t *a, const float *y, int64_t img)
{
    int64_t row = 4 * a->tw, image = a->ho * a->wo * a->o;
    float *out = a->out + img * image;
    const float *res = a->residual ? a->residual + img * image : NULL;
    for (int64_t r = 0; r < a->ho; r++)
        for (int64_t x = 0; x < a->wo; x++) {
            const float *src = y + (r * row + x) * a->op;
            int64_t at = (r * a->wo + x) * a->o, oc = 0;
            for (; oc + 8 <= a->o; oc += 8) {
                v8 s = load(src + oc);
                if (a->bias) s += load(a->bias + oc);
                if (res) s += load(res + at + oc);
                if (a->relu) s = (v8)((v8i)s & ~(s < 0));       /* NaN stays NaN */
                *(v8u *)(out + at + oc) = s;
            }
            for (; oc < a->o; oc++)
                out[at + oc] = wg_finish(a, src[oc] + (a->bias ? a->bias[oc] : 0.0f),
                                         res ? res + at + oc : NULL);
        }
}
