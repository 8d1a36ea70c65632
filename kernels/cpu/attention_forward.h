/* The forward pass of attention_native.c's kernels (included by it, as
 * attention_backward.h is for the backward pass). DEFINE_KERNELS(T, S, V, VU, VW, VI)
 * defines, for T (float or double) in vectors V (VU: the same unaligned, VW lanes, VI:
 * of integers as wide), the functions suffixed _S of a forward pass: the tiles'
 * products, the packing of keys and values, dropout's keep factors, the scores of a
 * block, forward_unit_S (one unit of work) and forward_job_S, which takes units from a
 * shared counter. */
#define DEFINE_KERNELS(T, S, V, VU, VW, VI)                                                \
/* The largest of the ATT_BC values of a row and `top`, VW lanes at a time. */           \
static inline T row_max_##S(const T *row, T top)                                          \
{                                                                                         \
    V m = *(const VU *)row;                                                               \
    for (int64_t c = VW; c < ATT_BC; c += VW) {                                           \
        const V x = *(const VU *)(row + c);                                               \
        const VI bigger = (VI)(x > m);                                                    \
        m = (V)(((VI)x & bigger) | ((VI)m & ~bigger));                                    \
    }                                                                                     \
    T lanes[VW];                                                                          \
    memcpy(lanes, &m, sizeof lanes);                                                      \
    for (int i = 0; i < VW; i++) top = lanes[i] > top ? lanes[i] : top;                  \
    return top;                                                                           \
}                                                                                         \
                                                                                          \
/* C[r][x] (+)= sum_t A[r*ars + t*acs] * B[t*bs + x] for r < R, t < K, x < X (X a      \
 * multiple of 2*VW; B's rows and C's rows vector-aligned or not). */                     \
static void mm_##S(int64_t R, int64_t K, int64_t X, const T *A, int64_t ars, int64_t acs, \
                   const T *B, int64_t bs, T *C, int64_t cs, int acc)                     \
{                                                                                         \
    int64_t r = 0;                                                                        \
    for (; r + 4 <= R; r += 4) {                                                          \
        const T *a0 = A + r * ars, *a1 = a0 + ars, *a2 = a1 + ars, *a3 = a2 + ars;        \
        for (int64_t x = 0; x < X; x += 2 * VW) {                                         \
            T *c = C + r * cs + x;                                                        \
            V c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0},           \
              c30 = {0}, c31 = {0};                                                       \
            if (acc) {                                                                    \
                c00 = *(VU *)c; c01 = *(VU *)(c + VW);                                    \
                c10 = *(VU *)(c + cs); c11 = *(VU *)(c + cs + VW);                        \
                c20 = *(VU *)(c + 2 * cs); c21 = *(VU *)(c + 2 * cs + VW);                \
                c30 = *(VU *)(c + 3 * cs); c31 = *(VU *)(c + 3 * cs + VW);                \
            }                                                                             \
            const T *b = B + x;                                                           \
            for (int64_t t = 0; t < K; t++, b += bs) {                                    \
                const V b0 = *(const VU *)b, b1 = *(const VU *)(b + VW);                  \
                const T w0 = a0[t * acs], w1 = a1[t * acs], w2 = a2[t * acs],             \
                        w3 = a3[t * acs];                                                 \
                c00 += w0 * b0; c01 += w0 * b1; c10 += w1 * b0; c11 += w1 * b1;           \
                c20 += w2 * b0; c21 += w2 * b1; c30 += w3 * b0; c31 += w3 * b1;           \
            }                                                                             \
            *(VU *)c = c00; *(VU *)(c + VW) = c01;                                        \
            *(VU *)(c + cs) = c10; *(VU *)(c + cs + VW) = c11;                            \
            *(VU *)(c + 2 * cs) = c20; *(VU *)(c + 2 * cs + VW) = c21;                    \
            *(VU *)(c + 3 * cs) = c30; *(VU *)(c + 3 * cs + VW) = c31;                    \
        }                                                                                 \
    }                                                                                     \
    for (; r < R; r++) {                                                                  \
        const T *a0 = A + r * ars;                                                        \
        for (int64_t x = 0; x < X; x += 2 * VW) {                                         \
            T *c = C + r * cs + x;                                                        \
            V c00 = {0}, c01 = {0};                                                       \
            if (acc) { c00 = *(VU *)c; c01 = *(VU *)(c + VW); }                           \
            const T *b = B + x;                                                           \
            for (int64_t t = 0; t < K; t++, b += bs) {                                    \
                const T w0 = a0[t * acs];                                                 \
                c00 += w0 * *(const VU *)b; c01 += w0 * *(const VU *)(b + VW);            \
            }                                                                             \
            *(VU *)c = c00; *(VU *)(c + VW) = c01;                                        \
        }                                                                                 \
    }                                                                                     \
}                                                                                         \
                                                                                          \
/* Keys j0 .. j0 + kc of head (n, h) packed: kt (dp x ATT_BC, K transposed), kp (ATT_BC  \
 * x dp) and vt (dvp x ATT_BC) or vp (ATT_BC x dvp), zeros past the data; NULL: skip. */ \
static void pack_keys_##S(const att_t *a, int64_t n, int64_t h, int64_t j0, int64_t kc,   \
                          T *kt, T *kp, T *vt, T *vp)                                     \
{                                                                                         \
    const int64_t *st = a->st;                                                            \
    const T *k = (const T *)a->k + n * st[S_K] + h * st[S_K + 1] + j0 * st[S_K + 2];      \
    const T *v = (const T *)a->v + n * st[S_V] + h * st[S_V + 1] + j0 * st[S_V + 2];      \
    if (kt) memset(kt, 0, sizeof(T) * a->dp * ATT_BC);                                    \
    if (kp) memset(kp, 0, sizeof(T) * a->dp * ATT_BC);                                    \
    if (vt) memset(vt, 0, sizeof(T) * a->dvp * ATT_BC);                                   \
    if (vp) memset(vp, 0, sizeof(T) * a->dvp * ATT_BC);                                   \
    for (int64_t j = 0; j < kc; j++) {                                                    \
        const T *kr = k + j * st[S_K + 2], *vr = v + j * st[S_V + 2];                     \
        if (kt) for (int64_t c = 0; c < a->hd; c++) kt[c * ATT_BC + j] = kr[c];            \
        if (kp) memcpy(kp + j * a->dp, kr, sizeof(T) * a->hd);                             \
        if (vt) for (int64_t c = 0; c < a->vd; c++) vt[c * ATT_BC + j] = vr[c];           \
        if (vp) memcpy(vp + j * a->dvp, vr, sizeof(T) * a->vd);                           \
    }                                                                                     \
}                                                                                         \
                                                                                          \
/* z[0 .. count) = the dropout factors (factor, or 0 where dropped) of the pairs        \
 * first, first + 1, ... (count <= ATT_BC). */                                            \
static void keep_factors_##S(const att_t *a, uint64_t first, int64_t count, T *z)         \
{                                                                                         \
    uint32_t words[4 * PHX_LANES * ((ATT_BC + 3 + 4 * PHX_LANES - 1) / (4 * PHX_LANES))]; \
    const uint32_t k0 = (uint32_t)a->seed64, k1 = (uint32_t)(a->seed64 >> 32);            \
    const int64_t skip = (int64_t)(first & 3), calls = (skip + count + 3) / 4;             \
    for (int64_t c = 0; c < calls; c += PHX_LANES)                                        \
        philox_lanes((first >> 2) + (uint64_t)c, a->stream, k0, k1, words + 4 * c);       \
    const T factor = (T)a->factor;                                                        \
    const uint32_t *w = words + skip;                                                     \
    for (int64_t j = 0; j < count; j++) z[j] = (w[j] >> 8) >= a->threshold ? factor : (T)0; \
}                                                                                         \
                                                                                          \
/* The scores s (rows x ATT_BC) of query rows i0.. against keys j0 .. j0 + kc: scaled,   \
 * the mask added or applied, the causal rule, -inf past the keys. s holds q k^T. */     \
static void finish_scores_##S(const att_t *a, int64_t n, int64_t h, int64_t i0,           \
                              int64_t rows, int64_t j0, int64_t kc, T *s)                 \
{                                                                                         \
    const int64_t *ms = a->st + S_M;                                                      \
    const T scale = (T)a->scale, ninf = (T)-INFINITY;                                     \
    for (int64_t r = 0; r < rows; r++) {                                                  \
        T *row = s + r * ATT_BC;                                                          \
        const int64_t i = i0 + r;                                                         \
        const int64_t last = row_keys(a, i, j0, kc);      /* keys j0 + c, c < last, pass */ \
        for (int64_t c = 0; c < ATT_BC; c++) row[c] *= scale;                             \
        if (a->mask_kind == 1) {                                                          \
            const uint8_t *m = (const uint8_t *)a->mask + n * ms[0] + h * ms[1] + i * ms[2] \
                               + j0 * ms[3];                                              \
            for (int64_t c = 0; c < last; c++)                                            \
                if (!m[c * ms[3]]) row[c] = ninf;                                         \
        } else if (a->mask_kind == 2) {                                                   \
            const T *m = (const T *)a->mask + n * ms[0] + h * ms[1] + i * ms[2]           \
                         + j0 * ms[3];                                                    \
            for (int64_t c = 0; c < last; c++) row[c] += m[c * ms[3]];                    \
        }                                                                                 \
        for (int64_t c = last; c < ATT_BC; c++) row[c] = ninf;                            \
    }                                                                                     \
}                                                                                         \
                                                                                          \
/* The keys a block of query rows i0 .. i0 + rows can see: [0, the returned end). */     \
static int64_t keys_seen_##S(const att_t *a, int64_t i0, int64_t rows)                    \
{                                                                                         \
    if (!a->causal) return a->tk;                                                         \
    int64_t end = i0 + rows - 1 + a->offset + 1;                                          \
    return end < 0 ? 0 : end < a->tk ? end : a->tk;                                       \
}                                                                                         \
                                                                                          \
/* sum of x[t] y[t] for t < n: VW lanes at a time, then the lanes and the rest. */        \
DEFINE_ROW_KERNELS(T, S, V, VU, VW)                                                       \
                                                                                          \
static void forward_unit_##S(att_t *a, T *kt, T *vp, T *s, T *o, T *z, int64_t unit)    \
{                                                                                         \
    const int64_t *st = a->st;                                                            \
    const int64_t hh = unit / a->qblocks, n = hh / a->h, h = hh % a->h;                   \
    const int64_t i0 = unit % a->qblocks * ATT_BR;                                        \
    const int64_t rows = a->tq - i0 < ATT_BR ? a->tq - i0 : ATT_BR;                       \
    const T *q = (const T *)a->q + n * st[S_Q] + h * st[S_Q + 1] + i0 * st[S_Q + 2];      \
    T m[ATT_BR], l[ATT_BR];                                                               \
    for (int64_t r = 0; r < rows; r++) { m[r] = (T)-INFINITY; l[r] = 0; }                 \
    memset(o, 0, sizeof(T) * rows * a->dvp);                                              \
    const int64_t seen = keys_seen_##S(a, i0, rows);                                      \
    for (int64_t j0 = 0; j0 < seen; j0 += ATT_BC) {                                       \
        const int64_t kc = a->tk - j0 < ATT_BC ? a->tk - j0 : ATT_BC;                     \
        if (rows == 1) {                      /* a cached pass's token: no packing */    \
            row_scores_##S(a, n, h, q, j0, kc, s);                                        \
        } else {                                                                          \
            pack_keys_##S(a, n, h, j0, kc, kt, NULL, NULL, vp);                           \
            mm_##S(rows, a->hd, ATT_BC, q, st[S_Q + 2], 1, kt, ATT_BC, s, ATT_BC, 0);      \
        }                                                                                 \
        finish_scores_##S(a, n, h, i0, rows, j0, kc, s);                                  \
        for (int64_t r = 0; r < rows; r++) {                                              \
            T *row = s + r * ATT_BC;                                                      \
            const T top = row_max_##S(row, m[r]);                                         \
            if (top == (T)-INFINITY) {                 /* nothing here for this row */   \
                memset(row, 0, sizeof(T) * ATT_BC);                                       \
                continue;                                                                 \
            }                                                                             \
            const T alpha = m[r] == (T)-INFINITY ? (T)0 : (T)exp(m[r] - top);             \
            m[r] = top;                                                                   \
            T sum = exp_row_##S(row, top);                                                \
            l[r] = l[r] * alpha + sum;                                                    \
            if (alpha != (T)1) {                                                          \
                T *orow = o + r * a->dvp;                                                 \
                for (int64_t c = 0; c < a->dvp; c++) orow[c] *= alpha;                    \
            }                                                                             \
            if (a->p > 0) {                    /* past `last`, the row is 0 already */   \
                const int64_t last = row_keys(a, i0 + r, j0, kc);                         \
                keep_factors_##S(a, (uint64_t)((hh * a->tq + i0 + r) * a->tk + j0), last, z); \
                for (int64_t c = 0; c < last; c++) row[c] *= z[c];                        \
            }                                                                             \
        }                                                                                 \
        if (rows == 1)                                                                    \
            row_values_##S(a, n, h, s, j0, kc, o);                                        \
        else                                                                              \
            mm_##S(rows, kc, a->dvp, s, ATT_BC, 1, vp, a->dvp, o, a->dvp, 1);             \
    }                                                                                     \
    T *out = (T *)a->out + n * st[S_O] + h * st[S_O + 1] + i0 * st[S_O + 2];              \
    T *lse = a->lse ? (T *)a->lse + hh * a->tq + i0 : NULL;                               \
    for (int64_t r = 0; r < rows; r++) {                                                  \
        T *dst = out + r * st[S_O + 2];                                                   \
        const T *orow = o + r * a->dvp;                                                   \
        if (l[r] > 0) {                                                                   \
            const T inv = (T)1 / l[r];                                                    \
            for (int64_t c = 0; c < a->vd; c++) dst[c] = orow[c] * inv;                   \
            if (lse) lse[r] = m[r] + (T)log(l[r]);                                        \
        } else {                                                                          \
            for (int64_t c = 0; c < a->vd; c++) dst[c] = 0;                               \
            if (lse) lse[r] = (T)-INFINITY;                                               \
        }                                                                                 \
    }                                                                                     \
}                                                                                         \
                                                                                          \
static void *forward_job_##S(void *arg)                                                   \
{                                                                                         \
    att_job_t *job = arg;                                                                 \
    att_t *a = job->a;                                                                    \
    /* a pass of single query rows (a cached token) packs nothing: no kt, vp */          \
    const int64_t br = a->tq < ATT_BR ? a->tq : ATT_BR, packs = br > 1;                   \
    T *kt = packs ? aligned_zeros(sizeof(T) * a->dp * ATT_BC) : NULL;                     \
    T *vp = packs ? aligned_zeros(sizeof(T) * a->dvp * ATT_BC) : NULL;                    \
    T *s = aligned_zeros(sizeof(T) * br * ATT_BC);                                        \
    T *o = aligned_zeros(sizeof(T) * br * a->dvp);                                        \
    T *z = aligned_zeros(sizeof(T) * ATT_BC);                                             \
    if ((packs && (!kt || !vp)) || !s || !o || !z) {                                      \
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);                                \
    } else {                                                                              \
        for (;;) {                                                                        \
            const int64_t unit = __atomic_fetch_add(&a->next, 1, __ATOMIC_RELAXED);       \
            if (unit >= a->units) break;                                                  \
            forward_unit_##S(a, kt, vp, s, o, z, unit);                                   \
        }                                                                                 \
    }                                                                                     \
    free(kt); free(vp); free(s); free(o); free(z);                                        \
    return NULL;                                                                          \
}
