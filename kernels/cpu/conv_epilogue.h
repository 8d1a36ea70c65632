/* The forward tile's epilogue of conv_native.c (included there, after conv_t and the
 * tile's sizes): acc (+ bias) (+ residual) (then max(., 0)) to the tile's outputs.
 * store_tile's one loop (store_outputs) takes the dense case (every output in place:
 * osw 1) through store_row_dense and store8_dense, with what it reads of the conv in
 * locals (a float store could alias the struct under -fno-strict-aliasing) and the
 * residual and relu branches taken once a tile; the phases of an input gradient
 * (every osw-th output) through store_row and store8. Both do the same operations in
 * the same order. */

/* One output vector's epilogue of 8 lanes where the outputs are not dense: val
 * (+ residual) (then max(., 0)) to the `lanes` outputs from `at`, every osw-th. */
static inline void store8(const conv_t *a, int64_t at, v8 val, int64_t lanes)
{
    if (lanes == 8 && !a->residual) {      /* a phase of dx: every osw-th output */
        if (a->relu) val = (v8)((v8i)val & ~(val < 0));
#if VL == 16
        if (a->osw == 2) {                 /* lane l to lane 2 l, as store_row's */
            const __m512i spread = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6,
                                                     7, 7);
            _mm512_mask_storeu_ps(a->out + at, (__mmask16)0x5555u,
                                  _mm512_permutexvar_ps(spread,
                                                        _mm512_castps256_ps512((__m256)val)));
            return;
        }
#endif
        for (int l = 0; l < 8; l++) a->out[at + a->osw * l] = val[l];
        return;
    }
    for (int64_t l = 0; l < lanes; l++) {
        int64_t to = at + a->osw * l;
        float s = val[l] + (a->residual ? a->residual[to] : 0.0f);
        a->out[to] = a->relu && s < 0 ? 0.0f : s;
    }
}

/* The same for a vector of VL lanes in one row. */
static inline void store_row(const conv_t *a, int64_t at, vf val, int64_t lanes)
{
#if VL == 8
    store8(a, at, val, lanes);
#else
    if (!a->residual && a->osw == 2) {    /* a phase of dx at stride 2: every other output */
        if (a->relu) val = vf_relu(val);
        /* lane l to lane 2 l of two vectors, stored under a mask of the even lanes:
         * two permutes and two masked stores where a scatter took 16 stores */
        const __m512i low = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
        const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
        uint64_t even = 0x55555555u & ((1ull << (2 * lanes)) - 1);
        _mm512_mask_storeu_ps(a->out + at, (__mmask16)even,
                              _mm512_permutexvar_ps(low, (__m512)val));
        if (lanes > 8)
            _mm512_mask_storeu_ps(a->out + at + 16, (__mmask16)(even >> 16),
                                  _mm512_permutexvar_ps(high, (__m512)val));
        return;
    }
    if (!a->residual && a->osw < (1 << 20)) {    /* a phase of dx: every osw-th output */
        if (a->relu) val = vf_relu(val);
        __m512i index = _mm512_mullo_epi32(_mm512_set1_epi32((int)a->osw),
                                           _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10,
                                                             11, 12, 13, 14, 15));
        _mm512_mask_i32scatter_ps(a->out + at, (__mmask16)((1u << lanes) - 1), index,
                                  (__m512)val, 4);
        return;
    }
    for (int64_t l = 0; l < lanes; l++) {
        int64_t to = at + a->osw * l;
        float s = val[l] + (a->residual ? a->residual[to] : 0.0f);
        a->out[to] = a->relu && s < 0 ? 0.0f : s;
    }
#endif
}

/* 8 lanes of a pair's row to `lanes` outputs at out (+ the residual at res); the
 * relu keeps NaN (NaN < 0 is false). */
static inline __attribute__((always_inline)) void store8_dense(float *out, const float *res,
                                                              v8 val, int64_t lanes,
                                                              const int RES, const int RELU)
{
    if (lanes == 8) {
        if (RES) val += load(res);
        if (RELU) val = (v8)((v8i)val & ~(val < 0));
        *(v8u *)out = val;
        return;
    }
    if (RES) val += v8f_load_part(res, lanes);
    if (RELU) val = (v8)((v8i)val & ~(val < 0));
    v8f_store_part(out, val, lanes);
}

/* A vector of VL lanes of a row to `lanes` outputs at out (+ the residual at res). */
static inline __attribute__((always_inline)) void store_row_dense(float *out, const float *res,
                                                                 vf val, int64_t lanes,
                                                                 const int RES, const int RELU)
{
    if (lanes == VL) {
        if (RES) val += vf_load(res);
        if (RELU) val = vf_relu(val);
        vf_store(out, val);
        return;
    }
    if (RES) val += vf_load_part(res, lanes);
    if (RELU) val = vf_relu(val);
    vf_store_part(out, val, lanes);
}

/* store_tile's loop over the tile's outputs. DENSE (osw 1): through store_row_dense
 * and store8_dense, with what they read of `a` in locals first (a float store could
 * alias it) and the residual and relu branches (RES, RELU) taken once; else through
 * store_row and store8. The same operations either way. */
static inline __attribute__((always_inline)) void store_outputs(
    const conv_t *a, vf acc[MR][NV], int nv, int64_t blk, int64_t v0, int64_t img,
    const int DENSE, const int RES, const int RELU, const int PAIR)
{
    float *const out = a->out;
    const float *const res = a->residual, *const bias = a->bias;
    const int64_t plane = a->out_h * a->out_w, o = a->o, pair_out = a->pair_out;
    const int64_t *const vout = a->vout + v0, *const vlanes = a->vlanes + v0;
    const int64_t rows = o - blk * MR < MR ? o - blk * MR : MR, ho = a->ho;
    for (int r = 0; r < rows; r++) {
        int64_t oc = blk * MR + r, base = (img * o + oc) * plane;
        float b = bias ? bias[oc] : 0.0f;
        for (int v = 0; v < nv; v++) {
            int64_t at = base + vout[v], lanes = vlanes[v];
            vf val = acc[r][v] + b;
#if VL == 16
            if (PAIR) {             /* the pair's halves to its two rows */
                v8 first = __builtin_shufflevector(val, val, 0, 1, 2, 3, 4, 5, 6, 7);
                v8 second = __builtin_shufflevector(val, val, 8, 9, 10, 11, 12, 13, 14, 15);
                int both = 2 * (v0 + v) + 1 < ho;
                if (DENSE) {
                    store8_dense(out + at, RES ? res + at : NULL, first, lanes, RES, RELU);
                    if (both)
                        store8_dense(out + at + pair_out, RES ? res + at + pair_out : NULL,
                                     second, lanes, RES, RELU);
                } else {
                    store8(a, at, first, lanes);
                    if (both) store8(a, at + pair_out, second, lanes);
                }
                continue;
            }
#endif
            if (DENSE)
                store_row_dense(out + at, RES ? res + at : NULL, val, lanes, RES, RELU);
            else
                store_row(a, at, val, lanes);
        }
    }
}

/* The epilogue of a forward tile: acc (+ bias) (+ residual) (then max(., 0)) to
 * the outputs of channels blk MR .. and vectors v0 .. v0 + nv - 1. */
static __attribute__((noinline)) void store_tile(const conv_t *a, vf acc[MR][NV], int nv,
                                                 int64_t blk, int64_t v0, int64_t img)
{
#define STORE(D, R, L)                                                                 \
    (a->pair ? store_outputs(a, acc, nv, blk, v0, img, D, R, L, 1)                      \
             : store_outputs(a, acc, nv, blk, v0, img, D, R, L, 0))
    int res = a->residual != NULL, relu = a->relu != 0;
    if (a->osw != 1) STORE(0, 0, 0);
    else if (res && relu) STORE(1, 1, 1);
    else if (res) STORE(1, 1, 0);
    else if (relu) STORE(1, 0, 1);
    else STORE(1, 0, 0);
#undef STORE
}
