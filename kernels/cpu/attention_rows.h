/* A generated token's pass in attention_native.c's forward (included by it; its
 * DEFINE_KERNELS expands DEFINE_ROW_KERNELS): one query row against a block of keys,
 * the keys and values read where they are (a KV cache's slabs), since packing them
 * would cost more than the products. The key scores are dot products (hsum_*: the
 * sum of their vector's lanes). */

/* The sum of a float vector's lanes, by halves (one 256-bit extract and add on
 * AVX-512, then 128-bit halves): a handful of independent instructions a key where
 * adding the 16 lanes one by one made a chain. Doubles keep the lane-by-lane sum,
 * which measured the faster for them (and keeps their bits). */
typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

static inline float hsum_f32(va x)
{
    v8f h;
    if (sizeof(va) == 64) {
        v8f lo, hi;
        memcpy(&lo, &x, 32);
        memcpy(&hi, (const char *)&x + 32, 32);
        h = lo + hi;
    } else {
        memcpy(&h, &x, 32);
    }
    v4f a, b;
    memcpy(&a, &h, 16);
    memcpy(&b, (const char *)&h + 16, 16);
    const v4f q = a + b;
    return (q[0] + q[2]) + (q[1] + q[3]);
}

static inline double hsum_f64(vd x)
{
    double lanes[sizeof(vd) / sizeof(double)], sum = 0;
    memcpy(lanes, &x, sizeof lanes);
    for (size_t i = 0; i < sizeof(vd) / sizeof(double); i++) sum += lanes[i];
    return sum;
}

#define DEFINE_ROW_KERNELS(T, S, V, VU, VW)                                                 \
static inline T dot_##S(const T *x, const T *y, int64_t n)                                \
{                                                                                         \
    V acc = {0};                                                                          \
    int64_t t = 0;                                                                        \
    for (; t + VW <= n; t += VW) acc += *(const VU *)(x + t) * *(const VU *)(y + t);      \
    T sum = hsum_##S(acc);                                                                \
    for (; t < n; t++) sum += x[t] * y[t];                                                \
    return sum;                                                                           \
}                                                                                         \
                                                                                          \
/* One query row against the keys j0 .. j0 + kc of head (n, h), read where they are (a  \
 * cached pass's new token: packing the keys would cost more than the products). */      \
static void row_scores_##S(const att_t *a, int64_t n, int64_t h, const T *q, int64_t j0,  \
                           int64_t kc, T *s)                                              \
{                                                                                         \
    const int64_t *st = a->st;                                                            \
    const T *k = (const T *)a->k + n * st[S_K] + h * st[S_K + 1] + j0 * st[S_K + 2];      \
    for (int64_t c = 0; c < kc; c++) s[c] = dot_##S(q, k + c * st[S_K + 2], a->hd);       \
}                                                                                         \
                                                                                          \
/* o[0 .. dvp) += sum over c < kc of p[c] v[j0 + c] (one query row, v read in place;     \
 * two vectors of o at a time stay in registers over the keys). */                        \
static void row_values_##S(const att_t *a, int64_t n, int64_t h, const T *p, int64_t j0,  \
                           int64_t kc, T *o)                                              \
{                                                                                         \
    const int64_t *st = a->st, width = a->vd, rs = st[S_V + 2];                           \
    const T *v = (const T *)a->v + n * st[S_V] + h * st[S_V + 1] + j0 * rs;               \
    int64_t e = 0;                                                                        \
    for (; e + 2 * VW <= width; e += 2 * VW) {                                            \
        V acc0 = *(VU *)(o + e), acc1 = *(VU *)(o + e + VW);                              \
        for (int64_t c = 0; c < kc; c++) {                                                \
            const T *vr = v + c * rs + e;                                                 \
            acc0 += p[c] * *(const VU *)vr;                                               \
            acc1 += p[c] * *(const VU *)(vr + VW);                                        \
        }                                                                                 \
        *(VU *)(o + e) = acc0;                                                            \
        *(VU *)(o + e + VW) = acc1;                                                       \
    }                                                                                     \
    for (; e < width; e++) {                                                              \
        T acc = o[e];                                                                     \
        for (int64_t c = 0; c < kc; c++) acc += p[c] * v[c * rs + e];                     \
        o[e] = acc;                                                                       \
    }                                                                                     \
}
