/* ---- norm_native.c's passes for one element type (included by norm_native.c) -------
 * NORM_KIND(T, S, V, VU) defines, for T (float or double) in vectors V (VU: the same
 * unaligned), the per-row work of norm_native.c's file comment as functions suffixed _S
 * and their table kind_S: a row's statistics and shift, the outputs, the gradient sums
 * and dx, and the statistics' stores and loads in T. */
#define NORM_KIND(T, S, V, VU)                                                                 \
static inline V load_##S(const T *p) { return *(const VU *)p; }                              \
                                                                                               \
/* mode 0: sums of d = x - c and d^2; 1: of g and g d; 2: of g s and g s d. */                 \
static inline __attribute__((always_inline)) void step_##S(                                   \
    const T *x, const T *g, const T *s, T c, int mode, V *s1, V *s2)                          \
{                                                                                              \
    V d = load_##S(x) - c;                                                                     \
    V v = mode == 0 ? d : mode == 1 ? load_##S(g) : load_##S(g) * load_##S(s);                \
    *s1 += v;                                                                                  \
    *s2 += v * d;                                                                              \
}                                                                                              \
                                                                                               \
static inline __attribute__((always_inline)) void sums_body_##S(                              \
    const T *x, const T *g, const T *s, int64_t n, T c, int mode, double out[2])              \
{                                                                                              \
    const int64_t w = sizeof(V) / sizeof(T), step = 4 * w;                                    \
    double t1 = 0, t2 = 0;                                                                     \
    int64_t i = 0;                                                                             \
    while (n - i >= step) {                                                                    \
        int64_t end = n - i > BLOCK ? i + BLOCK : i + (n - i) / step * step;                   \
        V p0 = {0}, p1 = {0}, p2 = {0}, p3 = {0}, q0 = {0}, q1 = {0}, q2 = {0}, q3 = {0};      \
        for (; i < end; i += step) {                                                           \
            step_##S(x + i, g + i, s + i, c, mode, &p0, &q0);                                  \
            step_##S(x + i + w, g + i + w, s + i + w, c, mode, &p1, &q1);                      \
            step_##S(x + i + 2 * w, g + i + 2 * w, s + i + 2 * w, c, mode, &p2, &q2);          \
            step_##S(x + i + 3 * w, g + i + 3 * w, s + i + 3 * w, c, mode, &p3, &q3);          \
        }                                                                                      \
        V p = (p0 + p1) + (p2 + p3), q = (q0 + q1) + (q2 + q3);                                \
        for (int64_t h = w / 2; h >= 1; h /= 2)                                                \
            for (int64_t l = 0; l < h; l++) p[l] += p[l + h], q[l] += q[l + h];                \
        t1 += p[0];                                                                            \
        t2 += q[0];                                                                            \
    }                                                                                          \
    for (; i < n; i++) {                                                                       \
        T d = x[i] - c, v = mode == 0 ? d : mode == 1 ? g[i] : g[i] * s[i];                    \
        t1 += v;                                                                               \
        t2 += (double)v * d;                                                                   \
    }                                                                                          \
    out[0] += t1;                                                                              \
    out[1] += t2;                                                                              \
}                                                                                              \
                                                                                               \
static void sums_##S(const T *x, const T *g, const T *s, int64_t n, T c, double out[2])      \
{                                                                                              \
    if (!g) sums_body_##S(x, x, x, n, c, 0, out);                                             \
    else if (!s) sums_body_##S(x, g, g, n, c, 1, out);                                        \
    else sums_body_##S(x, g, s, n, c, 2, out);                                                \
}                                                                                              \
                                                                                               \
static double round_##S(double v) { return (T)v; }                                            \
                                                                                               \
/* The mean of the row's first two vectors of values (of all, in a shorter row). */          \
static double shift_##S(const norm_t *a, int64_t r)                                           \
{                                                                                              \
    const T *x = (const T *)a->x + r * a->len;                                                 \
    const int64_t w = sizeof(V) / sizeof(T);                                                   \
    if (a->len < 2 * w) {                                                                      \
        double s = 0;                                                                          \
        for (int64_t i = 0; i < a->len; i++) s += x[i];                                        \
        return (T)(s / a->len);                                                                \
    }                                                                                          \
    V v = load_##S(x) + load_##S(x + w);                                                       \
    for (int64_t h = w / 2; h >= 1; h /= 2)                                                    \
        for (int64_t l = 0; l < h; l++) v[l] += v[l + h];                                      \
    return (T)(v[0] / (T)(2 * w));                                                             \
}                                                                                              \
                                                                                               \
/* The sums of row r's values lo..hi about the row's shift, which it returns. */           \
static double stats_##S(const norm_t *a, int64_t r, int64_t lo, int64_t hi, double out[2])    \
{                                                                                              \
    double shift = shift_##S(a, r);                                                            \
    out[0] = out[1] = 0;                                                                       \
    sums_##S((const T *)a->x + r * a->len + lo, NULL, NULL, hi - lo, (T)shift, out);           \
    return shift;                                                                              \
}                                                                                              \
                                                                                               \
static void apply_##S(const norm_t *a, int64_t r, int64_t lo, int64_t hi)                     \
{                                                                                              \
    const T *x = (const T *)a->x + r * a->len, *sc = a->scale, *bi = a->bias;                  \
    T *y = (T *)a->y + r * a->len;                                                             \
    double inv = a->invstd[r], delta = (a->mean[r] - a->cen[r]) * inv;                         \
    T m = (T)a->cen[r], k = (T)inv, c = (T)-delta;                                             \
    if (!sc && !bi) {                                                                          \
        for (int64_t i = lo; i < hi; i++) y[i] = (x[i] - m) * k + c;                           \
        return;                                                                                \
    }                                                                                          \
    for (int64_t i = lo, idx, end; i < hi; i = end) {                                          \
        end = run_end(a, r, i, hi, &idx);                                                      \
        const T *xi = x + i;                                                                   \
        T *yi = y + i;                                                                         \
        int64_t n = end - i;                                                                   \
        if (a->post > 1) {                                                                     \
            double s = sc ? sc[idx] : 1, b = bi ? bi[idx] : 0;                                 \
            T ks = (T)(inv * s), cs = (T)(b - delta * s);                                      \
            for (int64_t j = 0; j < n; j++) yi[j] = (xi[j] - m) * ks + cs;                     \
        } else if (sc && bi) {                                                                 \
            const T *s = sc + idx, *b = bi + idx;                                              \
            for (int64_t j = 0; j < n; j++) yi[j] = ((xi[j] - m) * k + c) * s[j] + b[j];       \
        } else if (sc) {                                                                       \
            const T *s = sc + idx;                                                             \
            for (int64_t j = 0; j < n; j++) yi[j] = ((xi[j] - m) * k + c) * s[j];              \
        } else {                                                                               \
            const T *b = bi + idx;                                                             \
            for (int64_t j = 0; j < n; j++) yi[j] = (xi[j] - m) * k + c + b[j];                \
        }                                                                                      \
    }                                                                                          \
}                                                                                              \
                                                                                               \
/* out: the row's sums of g and g (x - m), m = cen[r]; acc (or NULL): the per-index sums. */  \
static void grad_##S(const norm_t *a, int64_t r, int64_t lo, int64_t hi, double *acc,         \
                     double out[2])                                                            \
{                                                                                              \
    const T *x = (const T *)a->x + r * a->len, *g = (const T *)a->dy + r * a->len;             \
    const T *sc = a->scale;                                                                    \
    double inv = a->invstd[r], delta = a->mean[r] - a->cen[r];                                 \
    T m = (T)a->cen[r], k = (T)inv, c = (T)(-delta * inv);                                     \
    out[0] = out[1] = 0;                                                                       \
    if (!acc && !sc) {                                                                         \
        sums_##S(x + lo, g + lo, NULL, hi - lo, m, out);                                       \
        return;                                                                                \
    }                                                                                          \
    for (int64_t i = lo, idx, end; i < hi; i = end) {                                          \
        end = run_end(a, r, i, hi, &idx);                                                      \
        if (a->post > 1) {                                                                     \
            double o[2] = {0, 0}, s = sc ? sc[idx] : 1;                                        \
            sums_##S(x + i, g + i, NULL, end - i, m, o);                                       \
            out[0] += s * o[0];                                                                \
            out[1] += s * o[1];                                                                \
            if (acc) {                                                                         \
                acc[idx] += (o[1] - delta * o[0]) * inv;                                       \
                acc[a->A + idx] += o[0];                                                       \
            }                                                                                  \
            continue;                                                                          \
        }                                                                                      \
        for (int64_t t = i; t < end; t += TILE) {                                              \
            int64_t n = end - t < TILE ? end - t : TILE, at = idx + (t - i);                   \
            const T *xt = x + t, *gt = g + t;                                                  \
            sums_##S(xt, gt, sc ? sc + at : NULL, n, m, out);                                  \
            if (!acc) continue;                                                                \
            double *ds = acc + at, *db = acc + a->A + at;                                      \
            for (int64_t j = 0; j < n; j++) {                                                  \
                ds[j] += (double)(gt[j] * ((xt[j] - m) * k + c));                              \
                db[j] += (double)gt[j];                                                        \
            }                                                                                  \
        }                                                                                      \
    }                                                                                          \
}                                                                                              \
                                                                                               \
static void dx_##S(const norm_t *a, int64_t r, int64_t lo, int64_t hi)                        \
{                                                                                              \
    const T *x = (const T *)a->x + r * a->len, *g = (const T *)a->dy + r * a->len;             \
    const T *sc = a->scale;                                                                    \
    T *dx = (T *)a->dx + r * a->len;                                                           \
    double inv = a->invstd[r];                                                                 \
    T m = (T)a->cen[r], kd = (T)inv, kx = (T)a->kx[r], kc = (T)a->kc[r];                       \
    if (!sc) {                                                                                 \
        for (int64_t i = lo; i < hi; i++) dx[i] = g[i] * kd + (x[i] - m) * kx + kc;            \
        return;                                                                                \
    }                                                                                          \
    for (int64_t i = lo, idx, end; i < hi; i = end) {                                          \
        end = run_end(a, r, i, hi, &idx);                                                      \
        const T *xi = x + i, *gi = g + i;                                                      \
        T *di = dx + i;                                                                        \
        int64_t n = end - i;                                                                   \
        if (a->post > 1) {                                                                     \
            T ks = (T)(inv * sc[idx]);                                                         \
            for (int64_t j = 0; j < n; j++) di[j] = gi[j] * ks + (xi[j] - m) * kx + kc;        \
        } else {                                                                               \
            const T *s = sc + idx;                                                             \
            for (int64_t j = 0; j < n; j++) di[j] = gi[j] * s[j] * kd + (xi[j] - m) * kx + kc; \
        }                                                                                      \
    }                                                                                          \
}                                                                                              \
                                                                                               \
static void store_stats_##S(const norm_t *a, int64_t r, double mean, double var)              \
{                                                                                              \
    ((T *)a->mean_out)[r] = (T)mean;                                                           \
    ((T *)a->var_out)[r] = (T)var;                                                             \
}                                                                                              \
                                                                                               \
static void load_stats_##S(const norm_t *a, int64_t r, double *mean, double *var)             \
{                                                                                              \
    *mean = ((const T *)a->mean_in)[r];                                                        \
    *var = ((const T *)a->var_in)[r];                                                          \
}                                                                                              \
                                                                                               \
static void store_##S(void *to, const double *from, int64_t n)                                \
{                                                                                              \
    for (int64_t i = 0; i < n; i++) ((T *)to)[i] = (T)from[i];                                 \
}                                                                                              \
                                                                                               \
static const kind_t kind_##S = {stats_##S, shift_##S, round_##S, apply_##S, grad_##S, dx_##S,  \
                                store_stats_##S, load_stats_##S, store_##S};
