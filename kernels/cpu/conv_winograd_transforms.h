/* The transforms of conv_winograd.h's F(4x4, 3x3) (included there, before it uses
 * them): the data transforms B' d B and A' M A on vectors of 8 channels (v8) and, with
 * AVX-512, of 16 (vf), and the filter's G g G' on vectors of 8 output channels. */

/* The data transforms on vectors of type T (v8, or vf where the channels come in whole
 * vectors of VL), as wg_bt##S and wg_at##S:
 * r = B' d (6 values): B' = [4 0 -5 0 1 0; 0 -4 -4 1 1 0; 0 4 -4 -1 1 0;
 * 0 -2 -1 2 1 0; 0 2 -1 -2 1 0; 0 4 0 -5 0 1];
 * s = A' m (4 values of 6): A' = [1 1 1 1 1 0; 0 1 -1 2 -2 0; 0 1 1 4 4 0;
 * 0 1 -1 8 -8 1]. */
#define WG_DATA_TRANSFORMS(T, S)                                                          \
    static inline __attribute__((always_inline)) void wg_bt##S(const T d[6], T r[6])      \
    {                                                                                     \
        T a = d[3] + d[4], b = d[1] + d[2], c = d[4] - d[3], e = d[1] - d[2];             \
        T f = d[4] - d[2], g = d[3] - d[1];                                               \
        r[0] = 4.0f * d[0] - 5.0f * d[2] + d[4];                                          \
        r[1] = a - 4.0f * b;                                                              \
        r[2] = c + 4.0f * e;                                                              \
        r[3] = f + 2.0f * g;                                                              \
        r[4] = f - 2.0f * g;                                                              \
        r[5] = 4.0f * d[1] - 5.0f * d[3] + d[5];                                          \
    }                                                                                     \
    static inline __attribute__((always_inline)) void wg_at##S(const T m[6], T s[4])      \
    {                                                                                     \
        T p = m[1] + m[2], q = m[1] - m[2], r = m[3] + m[4], t = m[3] - m[4];             \
        s[0] = m[0] + p + r;                                                              \
        s[1] = q + 2.0f * t;                                                              \
        s[2] = p + 4.0f * r;                                                              \
        s[3] = q + 8.0f * t + m[5];                                                       \
    }

/* One tile's transforms on W channels at a time (vectors T, read and written through U):
 * wg_in##S: V = B' d B of the 6x6 window at p (positions cp, rows wb cp floats apart)
 * to q (its 36 positions step floats apart); wg_out##S: Y = A' M A of the 36 positions
 * at p (step apart) to the 4x4 outputs at q (row and op floats apart). */
#define WG_LANES(T, U, S)                                                                 \
    WG_DATA_TRANSFORMS(T, S)                                                              \
    static inline __attribute__((always_inline)) void wg_in##S(                           \
        const float *p, int64_t wb, int64_t cp, float *q, int64_t step)                   \
    {                                                                                     \
        T d[6], r[6][6], col[6], out[6];                                                  \
        for (int i = 0; i < 6; i++) {                 /* B' d, by rows of d */            \
            for (int j = 0; j < 6; j++) d[j] = *(const U *)(p + (i * wb + j) * cp);      \
            wg_bt##S(d, r[i]);                        /* r[i][j]: d's row i, B */         \
        }                                                                                 \
        for (int j = 0; j < 6; j++) {                 /* B' (d B) */                      \
            for (int i = 0; i < 6; i++) col[i] = r[i][j];                                 \
            wg_bt##S(col, out);                                                           \
            for (int i = 0; i < 6; i++) *(U *)(q + (6 * i + j) * step) = out[i];          \
        }                                                                                 \
    }                                                                                     \
    static inline __attribute__((always_inline)) void wg_out##S(                          \
        const float *p, int64_t step, float *q, int64_t row, int64_t op)                  \
    {                                                                                     \
        T s[4][6], col[6], out[4];                                                        \
        for (int j = 0; j < 6; j++) {                 /* A' M, by columns */              \
            for (int i = 0; i < 6; i++) col[i] = *(const U *)(p + (6 * i + j) * step);   \
            wg_at##S(col, out);                                                           \
            for (int i = 0; i < 4; i++) s[i][j] = out[i];                                 \
        }                                                                                 \
        for (int i = 0; i < 4; i++) {                 /* (A' M) A */                      \
            wg_at##S(s[i], out);                                                          \
            for (int j = 0; j < 4; j++) *(U *)(q + i * row + j * op) = out[j];            \
        }                                                                                 \
    }

WG_LANES(v8, v8u, 8)
#if VL == 16
WG_LANES(vf, vfu, 16)
#endif

/* g G' (6 values of 3): G = [1/4 0 0; -1/6 -1/6 -1/6; -1/6 1/6 -1/6;
 * 1/24 1/12 1/6; 1/24 -1/12 1/6; 0 0 1]. */
static inline __attribute__((always_inline)) void wg_g(const v8 g[3], v8 t[6])
{
    t[0] = 0.25f * g[0];
    t[1] = (-1.0f / 6) * (g[0] + g[1] + g[2]);
    t[2] = (-1.0f / 6) * (g[0] - g[1] + g[2]);
    t[3] = (1.0f / 24) * g[0] + (1.0f / 12) * g[1] + (1.0f / 6) * g[2];
    t[4] = (1.0f / 24) * g[0] - (1.0f / 12) * g[1] + (1.0f / 6) * g[2];
    t[5] = g[2];
}
