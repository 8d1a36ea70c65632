/* The forward pass of conv_depthwise.c's kernels on one plane, shared with the
 * separable kernel of conv_native.c (conv_separable.h): the geometry worked out once
 * a conv (geo_t, geometry: the dx tables too), an input plane copied into its zeroed
 * buffer of padded rows in phases of the stride (fill_input), and output rows computed
 * R at a time from it (forward_rows; conv_depthwise.c's opening comment says how),
 * in forward_plane: the outputs of one input channel of one image. Included after
 * native_simd.h. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define R 4                     /* output rows computed together */

typedef struct {
    int64_t n, c, h, w, o, kh, kw, sh, sw, ph, pw, dh, dw, ho, wo, relu, m;
    int64_t rows, ws;           /* the input buffer: padded rows read, floats a phase row */
    int64_t tr, drows, lp, wd;  /* dout's buffer: zero rows above, rows, zeros left, width */
    int64_t wt;                 /* dx's phase rows (sw > 1): floats each */
    int64_t *table;             /* what geometry() works out once for every plane: */
    int64_t *span;              /* per phase p: where x's columns go (t0, x column, count) */
    int64_t *ktaps, *kcount;    /* dx: per phase p, kcount[p] pairs (k, dout column shift) */
    int64_t *itaps, *icount;    /* dx: per row residue a, icount[a] pairs (i, dout row) */
} geo_t;


static int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

static geo_t geometry(const int64_t *d)
{
    geo_t g = {d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7], d[8], d[9], d[10], d[11],
               d[12], d[13], d[14], d[15], d[4] / d[1]};
    g.rows = (g.ho - 1) * g.sh + (g.kh - 1) * g.dh + 1;
    g.ws = round_up(g.wo, VL) + (g.kw - 1) * g.dw / g.sw;
    int64_t above = (g.kh - 1) * g.dh - g.ph;
    g.tr = above > 0 ? (above + g.sh - 1) / g.sh : 0;
    g.drows = (g.ph + g.h - 1 + g.tr * g.sh) / g.sh + 1;
    if (g.drows < g.tr + g.ho) g.drows = g.tr + g.ho;
    g.wt = (g.pw + g.w + g.sw - 1) / g.sw;
    g.lp = (g.kw - 1) * g.dw;
    g.wd = g.lp + g.pw + round_up(g.w > g.wt ? g.w : g.wt, VL) + VL;
    g.table = malloc((size_t)(3 * g.sw + 2 * g.sw * g.kw + g.sw + 2 * g.sh * g.kh + g.sh)
                     * sizeof(int64_t));
    if (!g.table) return g;
    g.span = g.table;
    g.ktaps = g.span + 3 * g.sw;
    g.kcount = g.ktaps + 2 * g.sw * g.kw;
    g.itaps = g.kcount + g.sw;
    g.icount = g.itaps + 2 * g.sh * g.kh;
    for (int64_t p = 0; p < g.sw; p++) {
        int64_t t0 = p >= g.pw ? 0 : (g.pw - p + g.sw - 1) / g.sw, col = p + g.sw * t0 - g.pw;
        int64_t count = col < g.w && t0 < g.ws ? (g.w - 1 - col) / g.sw + 1 : 0;
        g.span[3 * p] = t0;
        g.span[3 * p + 1] = col;
        g.span[3 * p + 2] = count > g.ws - t0 ? g.ws - t0 : count;
        g.kcount[p] = 0;
        for (int64_t k = 0; k < g.kw; k++) {
            const int64_t e = k * g.dw - p;      /* padded column p + sw t reads t - e / sw */
            if (e < 0 || e % g.sw) continue;
            g.ktaps[2 * (p * g.kw + g.kcount[p])] = k;
            g.ktaps[2 * (p * g.kw + g.kcount[p]) + 1] = e / g.sw;
            g.kcount[p]++;
        }
    }
    for (int64_t a = 0; a < g.sh; a++) {
        g.icount[a] = 0;
        for (int64_t i = 0; i < g.kh; i++) {
            const int64_t from = a + g.ph - i * g.dh + g.tr * g.sh;    /* >= 0 */
            if (from % g.sh) continue;
            g.itaps[2 * (a * g.kh + g.icount[a])] = i;
            g.itaps[2 * (a * g.kh + g.icount[a]) + 1] = from / g.sh;
            g.icount[a]++;
        }
    }
    return g;
}

/* dst[0 .. count) = src[0 .. count), a vector at a time. */
static inline void copy_row(float *dst, const float *src, int64_t count)
{
    int64_t i = 0;
    for (; i + VL <= count; i += VL) vf_store(dst + i, vf_load(src + i));
    if (i < count) vf_store_part(dst + i, vf_load_part(src + i, count - i), count - i);
}

/* even[i] = src[2 i] (i < ne) and odd[i] = src[2 i + 1] (i < no), in one pass. */
static void split_pairs(float *restrict even, float *restrict odd, const float *restrict src,
                        int64_t ne, int64_t no)
{
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512i evens = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                            28, 30);
    const __m512i odds = _mm512_add_epi32(evens, _mm512_set1_epi32(1));
    for (; i + 16 <= ne && i + 16 <= no; i += 16) {
        const __m512 lo = _mm512_loadu_ps(src + 2 * i), hi = _mm512_loadu_ps(src + 2 * i + 16);
        _mm512_storeu_ps(even + i, _mm512_permutex2var_ps(lo, evens, hi));
        _mm512_storeu_ps(odd + i, _mm512_permutex2var_ps(lo, odds, hi));
    }
    const int64_t re = ne - i, ro = no - i, reads = 2 * re - 1 > 2 * ro ? 2 * re - 1 : 2 * ro;
    if (reads > 0 && re <= 16 && ro <= 16) {     /* the last pairs: masked, src read no further */
        const __m512 lo = _mm512_maskz_loadu_ps(
            (__mmask16)(reads >= 16 ? 0xFFFFu : (1u << reads) - 1), src + 2 * i);
        const __m512 hi = _mm512_maskz_loadu_ps(
            (__mmask16)(reads > 16 ? (1u << (reads - 16)) - 1 : 0), src + 2 * i + 16);
        _mm512_mask_storeu_ps(even + i, (__mmask16)((1u << re) - 1),
                              _mm512_permutex2var_ps(lo, evens, hi));
        _mm512_mask_storeu_ps(odd + i, (__mmask16)((1u << ro) - 1),
                              _mm512_permutex2var_ps(lo, odds, hi));
        return;
    }
#endif
    for (int64_t e = i; e < ne; e++) even[e] = src[2 * e];
    for (; i < no; i++) odd[i] = src[2 * i + 1];
}

/* Plane `x` (h, w) into buf's interior: padded row Y, phase p, column t holds x[Y - ph]
 * [p + sw t - pw] where that is inside x (the rest of buf stays as zeroed). */
static void fill_input(const geo_t *g, const float *x, float *buf)
{
    for (int64_t yy = 0; yy < g->h; yy++) {
        int64_t Y = yy + g->ph;
        if (Y >= g->rows) break;
        if (g->sw == 2) {        /* x's even columns to phase pw % 2, its odd ones to the other */
            const int64_t te = g->pw / 2, to = (g->pw + 1) / 2;
            int64_t ne = (g->w + 1) / 2, no = g->w / 2;
            if (ne > g->ws - te) ne = g->ws - te;
            if (no > g->ws - to) no = g->ws - to;
            float *row = buf + Y * 2 * g->ws;
            split_pairs(row + (g->pw % 2) * g->ws + te, row + (1 - g->pw % 2) * g->ws + to,
                        x + yy * g->w, ne, no);
            continue;
        }
        for (int64_t p = 0; p < g->sw; p++) {
            const int64_t *span = g->span + 3 * p, count = span[2];
            float *dst = buf + (Y * g->sw + p) * g->ws + span[0];
            const float *src = x + yy * g->w + span[1];
            if (g->sw == 1)
                copy_row(dst, src, count);
            else
                for (int64_t t = 0; t < count; t++) dst[t] = src[t * g->sw];
        }
    }
}

/* Where tap (i, k) of output row 0, column 0 reads in the input buffer. */
static void tap_offsets(const geo_t *g, int64_t *off)
{
    for (int64_t i = 0; i < g->kh; i++)
        for (int64_t k = 0; k < g->kw; k++)
            off[i * g->kw + k] = (i * g->dh * g->sw + k * g->dw % g->sw) * g->ws
                                 + k * g->dw / g->sw;
}

static inline vf epilogue(const geo_t *g, vf v, float bias, const float *res, int64_t count)
{
    v += bias;
    if (res) v += count == VL ? vf_load(res) : vf_load_part(res, count);
    return g->relu ? vf_relu(v) : v;
}

/* Output rows r0 .. r0 + rows - 1 (rows <= R) of one plane, from the input buffer. */
static inline __attribute__((always_inline)) void forward_rows(
    const geo_t *g, const float *buf, const int64_t *off, const float *wt, float bias,
    const float *res, float *out, int64_t r0, const int rows)
{
    const int64_t step = g->sh * g->sw * g->ws, taps = g->kh * g->kw;
    for (int64_t q0 = 0; q0 < g->wo; q0 += VL) {
        vf acc[R];
        for (int r = 0; r < rows; r++) acc[r] = (vf){0};
        const float *base = buf + r0 * step + q0;
        for (int64_t t = 0; t < taps; t++) {
            const vf wv = (vf){0} + wt[t];
            for (int r = 0; r < rows; r++) acc[r] += wv * vf_load(base + r * step + off[t]);
        }
        const int64_t count = g->wo - q0 < VL ? g->wo - q0 : VL;
        for (int r = 0; r < rows; r++) {
            const int64_t at = (r0 + r) * g->wo + q0;
            vf v = epilogue(g, acc[r], bias, res ? res + at : NULL, count);
            if (count == VL) vf_store(out + at, v);
            else vf_store_part(out + at, v, count);
        }
    }
}

/* The m = O / C output planes of input channel c of one image (x: its input plane),
 * (+ bias[o]) (+ the planes of res) (then relu), to out's planes c m .. (out and res:
 * the image's first plane); buf is the plane's zeroed buffer, off the tap offsets. */
static void forward_plane(const geo_t *g, float *buf, const int64_t *off, const float *x,
                          const float *w, const float *bias, const float *res, float *out,
                          int64_t c)
{
    const int64_t taps = g->kh * g->kw, plane = g->ho * g->wo;
    fill_input(g, x, buf);
    for (int64_t m = 0; m < g->m; m++) {
        const int64_t o = c * g->m + m;
        const float *wt = w + o * taps, *rp = res ? res + o * plane : NULL;
        const float b = bias ? bias[o] : 0.0f;
        float *op = out + o * plane;
        int64_t r0 = 0;
        for (; r0 + R <= g->ho; r0 += R) forward_rows(g, buf, off, wt, b, rp, op, r0, R);
        switch (g->ho - r0) {
        case 3: forward_rows(g, buf, off, wt, b, rp, op, r0, 3); break;
        case 2: forward_rows(g, buf, off, wt, b, rp, op, r0, 2); break;
        case 1: forward_rows(g, buf, off, wt, b, rp, op, r0, 1); break;
        }
    }
}
