/* ---- bn_native.c's passes for one element type (included by bn_native.c) -----------
 * BN_KIND(T, S, V, VU, VI) defines, for T (float or double) in vectors V (VU: the same
 * unaligned, VI: of integers as wide), the passes of bn_native.c's file comment as
 * functions suffixed _S and their table kind_S: per channel (I > 1) channels_S, which
 * takes a tile of channels at a time, their sums row by row in a pass of sums, then
 * their outputs in a fused pass or an apply; per row (I = 1) row_sums_S, row_apply_S,
 * row_shifts_S and row_consts_S. */
#define BN_KIND(T, S, V, VU, VI)                                                               \
static inline V load_##S(const T *p) { return *(const VU *)p; }                              \
static inline void store_##S(T *p, V v) { *(VU *)p = v; }                                    \
static double round_##S(double v) { return (T)v; }                                            \
/* relu's gradient: g where y > 0, else +0 (the bits of g ANDed with a mask) */             \
static inline V keep_##S(V g, V y) { V z = {0}; return (V)((VI)g & (VI)(y > z)); }            \
static inline T keep1_##S(T g, T y) { return y > 0 ? g : (T)0; }                              \
/* relu: v where v > 0 or v is NaN, else +0 */                                                \
static inline V relu_##S(V v) { V z = {0}; return (V)((VI)v & (VI)((v > z) | (v != v))); }   \
static inline T relu1_##S(T v) { return v > 0 || v != v ? v : (T)0; }                         \
                                                                                               \
/* A channel's sums: vectors of T (p, q; t1, t2 the tails) over at most about BLOCK  \
 * values, then in double (s1, s2). */                                                       \
typedef struct { V p, q; T t1, t2; int64_t count; double s1, s2; } acc_##S;                   \
                                                                                               \
static inline __attribute__((always_inline)) void flush_##S(acc_##S *A)                       \
{                                                                                              \
    const int64_t w = sizeof(V) / sizeof(T);                                                   \
    V p = A->p, q = A->q, z = {0};                                                             \
    for (int64_t h = w / 2; h >= 1; h /= 2)                                                    \
        for (int64_t l = 0; l < h; l++) p[l] += p[l + h], q[l] += q[l + h];                    \
    A->s1 += (double)p[0] + A->t1;                                                             \
    A->s2 += (double)q[0] + A->t2;                                                             \
    A->p = A->q = z;                                                                           \
    A->t1 = A->t2 = 0;                                                                         \
    A->count = 0;                                                                              \
}                                                                                              \
                                                                                               \
/* grad 0: sums of d = x - c and d^2; 1: of g and g d; 2: as 1 with g masked by y > 0. */    \
static inline __attribute__((always_inline)) void step_##S(                                   \
    const T *x, const T *g, const T *y, T c, int grad, V *s1, V *s2)                           \
{                                                                                              \
    V d = load_##S(x) - c, v = grad ? load_##S(g) : d;                                         \
    if (grad == 2) v = keep_##S(v, load_##S(y));                                               \
    *s1 += v;                                                                                  \
    *s2 += v * d;                                                                              \
}                                                                                              \
                                                                                               \
/* Add n (<= BLOCK) values of a run to A (in four pairs of vectors, then A's pair), going   \
 * to double once A holds BLOCK. */                                                            \
static inline __attribute__((always_inline)) void run_##S(                                    \
    acc_##S *A, const T *x, const T *g, const T *y, int64_t n, T c, int grad)                  \
{                                                                                              \
    const int64_t w = sizeof(V) / sizeof(T), step = 4 * w;                                    \
    V p0 = A->p, p1 = {0}, p2 = {0}, p3 = {0}, q0 = A->q, q1 = {0}, q2 = {0}, q3 = {0};       \
    int64_t i = 0;                                                                             \
    for (; i + step <= n; i += step) {                                                         \
        step_##S(x + i, g + i, y + i, c, grad, &p0, &q0);                                      \
        step_##S(x + i + w, g + i + w, y + i + w, c, grad, &p1, &q1);                          \
        step_##S(x + i + 2 * w, g + i + 2 * w, y + i + 2 * w, c, grad, &p2, &q2);              \
        step_##S(x + i + 3 * w, g + i + 3 * w, y + i + 3 * w, c, grad, &p3, &q3);              \
    }                                                                                          \
    for (; i + w <= n; i += w) step_##S(x + i, g + i, y + i, c, grad, &p1, &q1);               \
    A->p = (p0 + p1) + (p2 + p3);                                                              \
    A->q = (q0 + q1) + (q2 + q3);                                                              \
    for (; i < n; i++) {                                                                       \
        T d = x[i] - c, v = grad ? g[i] : d;                                                   \
        if (grad == 2) v = keep1_##S(v, y[i]);                                                 \
        A->t1 += v;                                                                            \
        A->t2 += v * d;                                                                        \
    }                                                                                          \
    A->count += n;                                                                             \
    if (A->count >= BLOCK) flush_##S(A);                                                       \
}                                                                                              \
                                                                                               \
/* n outputs o = (x - m) kx + kc (mode 0; relu: max(o, 0)), g kd + (x - m) kx + kc (1) or  \
 * g kd (2), g masked by y > 0 when `masked`: the constants per value (step 1: a row of C   \
 * channels) or one for all (step 0). o may be g. */                                          \
static inline __attribute__((always_inline)) void apply_body_##S(                             \
    const T *x, const T *g, const T *y, T *o, int64_t n, int mode, int relu, int masked,       \
    const T *m, const T *kd, const T *kx, const T *kc, int step)                               \
{                                                                                              \
    const int64_t w = sizeof(V) / sizeof(T);                                                   \
    V cm = {0}, cd = {0}, cx = {0}, cc = {0};                                                  \
    if (!step) cm += *m, cd += *kd, cx += *kx, cc += *kc;                                      \
    int64_t i = 0;                                                                             \
    for (; i + w <= n; i += w) {                                                               \
        V tm = step ? load_##S(m + i) : cm, td = step ? load_##S(kd + i) : cd;                 \
        V tx = step ? load_##S(kx + i) : cx, tc = step ? load_##S(kc + i) : cc;                \
        V gv = {0};                                                                            \
        if (mode) gv = masked ? keep_##S(load_##S(g + i), load_##S(y + i)) : load_##S(g + i);  \
        V v = mode == 2 ? gv * td : (load_##S(x + i) - tm) * tx + tc;                          \
        if (mode == 1) v += gv * td;                                                           \
        if (mode == 0 && relu) v = relu_##S(v);                                                \
        store_##S(o + i, v);                                                                   \
    }                                                                                          \
    for (; i < n; i++) {                                                                       \
        int64_t k = step ? i : 0;                                                              \
        T gv = mode ? (masked ? keep1_##S(g[i], y[i]) : g[i]) : (T)0;                          \
        T v = mode == 2 ? gv * kd[k] : (x[i] - m[k]) * kx[k] + kc[k];                          \
        if (mode == 0 && relu) v = relu1_##S(v);                                               \
        o[i] = mode == 1 ? v + gv * kd[k] : v;                                                 \
    }                                                                                          \
}                                                                                              \
                                                                                               \
static inline __attribute__((always_inline)) void apply_run_##S(                              \
    const T *x, const T *g, const T *y, T *o, int64_t n, int mode, int relu, const T *m,       \
    const T *kd, const T *kx, const T *kc, int step)                                           \
{                                                                                              \
    if (mode == 0 && relu) apply_body_##S(x, g, y, o, n, 0, 1, 0, m, kd, kx, kc, step);        \
    else if (mode == 0) apply_body_##S(x, g, y, o, n, 0, 0, 0, m, kd, kx, kc, step);           \
    else if (mode == 1 && y) apply_body_##S(x, g, y, o, n, 1, 0, 1, m, kd, kx, kc, step);      \
    else if (mode == 1) apply_body_##S(x, g, y, o, n, 1, 0, 0, m, kd, kx, kc, step);           \
    else if (y) apply_body_##S(x, g, y, o, n, 2, 0, 1, m, kd, kx, kc, step);                   \
    else apply_body_##S(x, g, y, o, n, 2, 0, 0, m, kd, kx, kc, step);                          \
}                                                                                              \
                                                                                               \
/* out[j]: the sums over channel c0 + j (I > 1) of d = x - m[j] and d^2, or (grad) of g  \
 * and g d, for the tile's ct channels, row by row. */                                       \
static inline __attribute__((always_inline)) void tile_sums_body_##S(                         \
    const bn_t *a, int64_t c0, int64_t ct, const T *m, int grad, double (*out)[2])             \
{                                                                                              \
    const int64_t stride = a->C * a->I, I = a->I, R = a->R;                                    \
    const T *x = (const T *)a->x + c0 * I, *g = grad ? (const T *)a->dy + c0 * I : x;          \
    const T *y = grad == 2 ? (const T *)a->mask + c0 * I : x;                                  \
    int64_t ahead, reach;                                                                      \
    prefetch_plan(a, ct * I * (int64_t)sizeof(T), &ahead, &reach);                             \
    acc_##S A[MAX_TILE];                                                                       \
    memset(A, 0, sizeof A);                                                                    \
    for (int64_t r = 0; r < R; r++, x += stride, g += stride, y += stride) {                   \
        if (r + ahead < R)                                                                     \
            for (int64_t b = 0; b < reach; b += 64) {                                          \
                __builtin_prefetch((const char *)(x + ahead * stride) + b);                    \
                if (grad) __builtin_prefetch((const char *)(g + ahead * stride) + b);          \
                if (grad == 2) __builtin_prefetch((const char *)(y + ahead * stride) + b);     \
            }                                                                                  \
        for (int64_t j = 0; j < ct; j++)                                                       \
            for (int64_t lo = j * I, end = lo + I; lo < end; lo += BLOCK)                      \
                run_##S(&A[j], x + lo, g + lo, y + lo, end - lo < BLOCK ? end - lo : BLOCK,    \
                        m[j], grad);                                                           \
    }                                                                                          \
    for (int64_t j = 0; j < ct; j++) {                                                         \
        flush_##S(&A[j]);                                                                      \
        out[j][0] = A[j].s1;                                                                   \
        out[j][1] = A[j].s2;                                                                   \
    }                                                                                          \
}                                                                                              \
                                                                                               \
/* out = (x - m) kx + kc (mode 0), g kd + (x - m) kx + kc (1) or g kd (2) on the tile's ct   \
 * channels from c0, row by row, with k[0..3][j] = m, kd, kx, kc of channel c0 + j. */        \
static void tile_apply_##S(const bn_t *a, int64_t c0, int64_t ct, T k[4][MAX_TILE])            \
{                                                                                              \
    const int64_t stride = a->C * a->I, I = a->I, R = a->R;                                    \
    const T *x = (const T *)a->x + c0 * I, *g = a->dy ? (const T *)a->dy + c0 * I : NULL;      \
    const T *y = a->mask ? (const T *)a->mask + c0 * I : NULL;                                 \
    T *o = (T *)a->out + c0 * I;                                                               \
    int64_t ahead, reach;                                                                      \
    prefetch_plan(a, ct * I * (int64_t)sizeof(T), &ahead, &reach);                             \
    for (int64_t r = 0; r < R; r++, x += stride, o += stride, g = g ? g + stride : g,          \
         y = y ? y + stride : y) {                                                             \
        if (r + ahead < R)                                                                     \
            for (int64_t b = 0; b < reach; b += 64) {                                          \
                __builtin_prefetch((const char *)(o + ahead * stride) + b, 1);                 \
                if (!a->fused && a->mode != 2)                                                 \
                    __builtin_prefetch((const char *)(x + ahead * stride) + b);                \
                if (g && !a->fused) __builtin_prefetch((const char *)(g + ahead * stride) + b); \
                if (y && !a->fused) __builtin_prefetch((const char *)(y + ahead * stride) + b); \
            }                                                                                  \
        for (int64_t j = 0; j < ct; j++)                                                       \
            apply_run_##S(x + j * I, g ? g + j * I : NULL, y ? y + j * I : NULL, o + j * I, I,  \
                          a->mode, a->relu, &k[0][j], &k[1][j], &k[2][j], &k[3][j], 0);        \
    }                                                                                          \
}                                                                                              \
                                                                                               \
/* The mean of channel c's first SHIFT_VALUES values (row by row), rounded to T. */           \
static double shift_##S(const bn_t *a, int64_t c)                                              \
{                                                                                              \
    const T *x = (const T *)a->x + c * a->I;                                                   \
    double s = 0;                                                                              \
    int64_t n = 0;                                                                             \
    for (int64_t r = 0; r < a->R && n < SHIFT_VALUES; r++, x += a->C * a->I)                   \
        for (int64_t i = 0; i < a->I && n < SHIFT_VALUES; i++, n++) s += x[i];                 \
    return (T)(s / (double)n);                                                                 \
}                                                                                              \
                                                                                               \
/* Part p's channels (I > 1) in tiles: their sums and, when fused, their outputs; or     \
 * (not sums) their outputs. */                                                                \
static void channels_##S(bn_t *a, int64_t p)                                                   \
{                                                                                              \
    const int64_t c1 = (p + 1) * a->C / a->parts, tile = tile_channels(a);                     \
    for (int64_t c0 = p * a->C / a->parts; c0 < c1; c0 += tile) {                              \
        int64_t ct = c1 - c0 < tile ? c1 - c0 : tile;                                          \
        T k[4][MAX_TILE];                   /* per channel: m, kd, kx, kc */                   \
        double s[MAX_TILE][2];                                                                 \
        if (a->sums) {                                                                         \
            for (int64_t j = 0; j < ct; j++)                                                   \
                k[0][j] = a->grad ? (T)a->mean[c0 + j] : (T)shift_##S(a, c0 + j);             \
            if (a->grad && a->mask) tile_sums_body_##S(a, c0, ct, k[0], 2, s);                 \
            else if (a->grad) tile_sums_body_##S(a, c0, ct, k[0], 1, s);                       \
            else tile_sums_body_##S(a, c0, ct, k[0], 0, s);                                    \
        }                                                                                      \
        for (int64_t j = 0; j < ct; j++) {                                                     \
            double d[4] = {0, 0, 0, 0};                                                        \
            if (!a->sums) {                                                                    \
                apply_consts(a, c0 + j, round_##S, d, d + 1, d + 2, d + 3);                    \
            } else if (a->grad) {                                                              \
                d[0] = k[0][j];                                                                \
                finish_grad(a, c0 + j, d[0], s[j][0], s[j][1], d + 1, d + 2, d + 3);           \
            } else {                                                                           \
                finish_stats(a, c0 + j, k[0][j], s[j][0], s[j][1], round_##S, d, d + 2, d + 3); \
            }                                                                                  \
            for (int q = 0; q < 4; q++) k[q][j] = (T)d[q];                                     \
        }                                                                                      \
        if (!a->sums || a->fused) tile_apply_##S(a, c0, ct, k);                                \
    }                                                                                          \
}                                                                                              \
                                                                                               \
/* ---- I = 1: rows of C values ---------------------------------------------------------- */ \
                                                                                               \
static inline __attribute__((always_inline)) void row_sums_body_##S(bn_t *a, int64_t p,      \
                                                                     int grad)                 \
{                                                                                              \
    const int64_t C = a->C, r0 = p * a->R / a->parts, r1 = (p + 1) * a->R / a->parts;          \
    const T *sh = a->consts;                                                                   \
    T *f1 = (T *)a->work + 2 * C * p, *f2 = f1 + C;                                            \
    double *d1 = a->partial + 2 * C * p, *d2 = d1 + C;                                         \
    for (int64_t c = 0; c < C; c++) f1[c] = f2[c] = 0, d1[c] = d2[c] = 0;                      \
    const int64_t w = sizeof(V) / sizeof(T), cv = C / w * w;                                  \
    for (int64_t r = r0; r < r1; r++) {                                                        \
        const T *x = (const T *)a->x + r * C, *g = grad ? (const T *)a->dy + r * C : x;        \
        const T *y = grad == 2 ? (const T *)a->mask + r * C : x;                               \
        for (int64_t c = 0; c < cv; c += w) {                                                  \
            V d = load_##S(x + c) - load_##S(sh + c), v = grad ? load_##S(g + c) : d;          \
            if (grad == 2) v = keep_##S(v, load_##S(y + c));                                   \
            store_##S(f1 + c, load_##S(f1 + c) + v);                                           \
            store_##S(f2 + c, load_##S(f2 + c) + v * d);                                       \
        }                                                                                      \
        for (int64_t c = cv; c < C; c++) {                                                     \
            T d = x[c] - sh[c], v = grad ? g[c] : d;                                           \
            if (grad == 2) v = keep1_##S(v, y[c]);                                             \
            f1[c] += v;                                                                        \
            f2[c] += v * d;                                                                    \
        }                                                                                      \
        if ((r - r0) % FLUSH_ROWS == FLUSH_ROWS - 1 || r == r1 - 1)                            \
            for (int64_t c = 0; c < C; c++) d1[c] += f1[c], d2[c] += f2[c], f1[c] = f2[c] = 0;  \
    }                                                                                          \
}                                                                                              \
                                                                                               \
static void row_sums_##S(bn_t *a, int64_t p)                                                   \
{                                                                                              \
    if (a->grad && a->mask) row_sums_body_##S(a, p, 2);                                        \
    else if (a->grad) row_sums_body_##S(a, p, 1);                                              \
    else row_sums_body_##S(a, p, 0);                                                           \
}                                                                                              \
                                                                                               \
static void row_apply_##S(bn_t *a, int64_t p)                                                  \
{                                                                                              \
    const int64_t C = a->C, r0 = p * a->R / a->parts, r1 = (p + 1) * a->R / a->parts;          \
    const T *m = a->consts, *kd = m + C, *kx = kd + C, *kc = kx + C;                           \
    for (int64_t r = r0; r < r1; r++) {                                                        \
        const T *x = (const T *)a->x + r * C, *g = a->dy ? (const T *)a->dy + r * C : NULL;    \
        const T *y = a->mask ? (const T *)a->mask + r * C : NULL;                              \
        apply_run_##S(x, g, y, (T *)a->out + r * C, C, a->mode, a->relu, m, kd, kx, kc, 1);    \
    }                                                                                          \
}                                                                                              \
                                                                                               \
/* consts: the shifts of the statistics (the mean of each channel's first SHIFT_VALUES     \
 * values, taken row by row), or the gradient's m = mean rounded. */                          \
static void row_shifts_##S(bn_t *a)                                                            \
{                                                                                              \
    T *m = a->consts;                                                                          \
    const int64_t C = a->C, rows = a->R < SHIFT_VALUES ? a->R : SHIFT_VALUES;                  \
    if (a->grad) {                                                                             \
        for (int64_t c = 0; c < C; c++) m[c] = (T)a->mean[c];                                  \
        return;                                                                                \
    }                                                                                          \
    double *s = a->partial;                 /* free until the sums */                          \
    for (int64_t c = 0; c < C; c++) s[c] = 0;                                                  \
    for (int64_t r = 0; r < rows; r++)                                                         \
        for (int64_t c = 0; c < C; c++) s[c] += ((const T *)a->x)[r * C + c];                  \
    for (int64_t c = 0; c < C; c++) m[c] = (T)(s[c] / (double)rows);                           \
}                                                                                              \
                                                                                               \
/* Fold the parts' sums in part order, finish every channel and, when fused or for an        \
 * apply, lay its output constants out in consts (m, kd, kx, kc). */                           \
static void row_consts_##S(bn_t *a)                                                            \
{                                                                                              \
    const int64_t C = a->C;                                                                    \
    T *tm = a->consts, *tkd = tm + C, *tkx = tkd + C, *tkc = tkx + C;                          \
    for (int64_t c = 0; c < C; c++) {                                                          \
        double m = 0, kd = 0, kx = 0, kc = 0;                                                  \
        if (a->partial) {                                                                      \
            double s1 = 0, s2 = 0;                                                             \
            for (int64_t p = 0; p < a->parts; p++)                                             \
                s1 += a->partial[2 * C * p + c], s2 += a->partial[2 * C * p + C + c];          \
            if (a->grad) finish_grad(a, c, tm[c], s1, s2, &kd, &kx, &kc), m = tm[c];           \
            else finish_stats(a, c, tm[c], s1, s2, round_##S, &m, &kx, &kc);                   \
        } else {                                                                               \
            apply_consts(a, c, round_##S, &m, &kd, &kx, &kc);                                  \
        }                                                                                      \
        tm[c] = (T)m, tkd[c] = (T)kd, tkx[c] = (T)kx, tkc[c] = (T)kc;                          \
    }                                                                                          \
}                                                                                              \
                                                                                               \
static const kind_t kind_##S = {channels_##S, row_sums_##S, row_apply_##S, row_shifts_##S,      \
                                row_consts_##S, sizeof(T)};
