/* Vectors of 8 and of 16 floats (GCC's vector extensions: one AVX or AVX-512 register
 * where the build target has them, several narrower ones otherwise) and the elementwise
 * functions the native kernels share, for both: a lane select, exp and the standard
 * normal's CDF and density (every lane computed alike, so a value's result does not
 * depend on the width). Each kernel's .c includes this
 * (native.py puts it in the source). */
#include <stdint.h>
#include <string.h>

typedef float vf __attribute__((vector_size(32)));
typedef float vfu __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi __attribute__((vector_size(32)));
/* 16 floats: one AVX-512 register where the build target has them (gelu's kernels) */
typedef float vf16 __attribute__((vector_size(64)));
typedef float vf16u __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi16 __attribute__((vector_size(64)));

#if defined(__AVX__)
#include <immintrin.h>
#endif

/* Any lane of m set: one test instruction where the build target has AVX-512 (16 lanes)
 * or AVX (8 lanes), else a loop that extracts each lane (on AVX-512, as much work as the
 * rest of a gelu). */
static inline int any_lane(const int32_t *lanes, int count)
{
    int any = 0;
    for (int i = 0; i < count; i++) any |= lanes[i];
    return any != 0;
}

#if defined(__AVX512F__)
static inline int any_vi16(vi16 m) { return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0; }
#else
static inline int any_vi16(vi16 m) { return any_lane((const int32_t *)&m, 16); }
#endif
#if defined(__AVX__)
static inline int any_vi(vi m) { return !_mm256_testz_si256((__m256i)m, (__m256i)m); }
#else
static inline int any_vi(vi m) { return any_lane((const int32_t *)&m, 8); }
#endif

/* 1 / d for d in [1, 6] (erfc's t): the target's reciprocal estimate refined by Newton
 * steps to within an ulp of the quotient (a division takes as long as the rest of a
 * gelu on AVX-512); the quotient elsewhere. */
static inline vf16 recip_vf16(vf16 d)
{
#if defined(__AVX512F__)
    const vf16 r = (vf16)_mm512_rcp14_ps((__m512)d);            /* 2^-14 */
    return r + r * (1.0f - d * r);
#else
    return 1.0f / d;
#endif
}

static inline vf recip_vf(vf d) { return 1.0f / d; }    /* vn is vf without AVX-512 */

/* The functions below, for a vector type V of LANES floats (VI: as many int32): select_S,
 * exp_S, any_VI, normal_cdf_S; defined for vf (S = vf) and vf16 (S = vf16). */
#define DEFINE_VECTOR_MATH(V, VI, S, LANES)                                                 \
static inline V select_##S(VI take, V a, V b)      /* take ? a : b, lane by lane */         \
{                                                                                           \
    return (V)(((VI)a & take) | ((VI)b & ~take));                                           \
}                                                                                           \
                                                                                            \
/* exp of LANES floats x <= 88 (larger x: undefined; every caller's are <= 0): n =              \
 * round(x / ln 2) by adding and subtracting 1.5 * 2^23 (no conversions), a degree-5        \
 * polynomial (Cephes' expf's) of the rest, 2^n added to the exponent bits. Below           \
 * -87.3 (and -inf) it is 0. Relative error within 2 ulp. */                                \
static inline V exp_##S(V x)                                                                \
{                                                                                           \
    const V zero = {0};                                                                     \
    const V magic = zero + 12582912.0f;              /* 1.5 * 2^23 */                       \
    const VI dead = (VI)(x < -87.33654f);                                                   \
    const V shifted = x * 1.44269504088896341f + magic;                                     \
    const V n = shifted - magic;                     /* round(x / ln 2) */                  \
    const V r = x - n * 0.693359375f + n * 2.12194440e-4f;                                  \
    const V r2 = r * r;                                                                     \
    V y = zero + 1.9875691500E-4f;                                                          \
    y = y * r + 1.3981999507E-3f;                                                           \
    y = y * r + 8.3334519073E-3f;                                                           \
    y = y * r + 4.1665795894E-2f;                                                           \
    y = y * r + 1.6666665459E-1f;                                                           \
    y = y * r + 5.0000001201E-1f;                                                           \
    y = y * r2 + r + 1.0f;                                                                  \
    const VI scaled = (VI)y + (((VI)shifted - (VI)magic) << 23);                            \
    return (V)(scaled & ~dead);                                                             \
}                                                                                           \
                                                                                            \
/* Phi(x) = erfc(-x / sqrt 2) / 2 for LANES floats, and (pdf not NULL) the density              \
 * phi(x) = exp(-x^2 / 2) / sqrt(2 pi). erfc(z) for z = |x| / sqrt 2 is Numerical           \
 * Recipes' erfcc, t exp(-z^2 + P(t)) with t = 1 / (1 + z / 2) and P of degree 9            \
 * (fractional error below 1.2e-7 for every z >= 0, so the left tail keeps its              \
 * relative accuracy); erfc(-z) = 2 - erfc(z). Where a lane has z >= 3, exp(-z^2) is        \
 * exp(-s^2) exp(-(z - s)(z + s)), s = trunc(16 z) / 16 (s^2 exact: the square's            \
 * rounding costs no digits); below, the rounding of z^2 costs at most 5e-7. z is           \
 * clamped at 10 (erfc(10) underflows a float). NaN where x is NaN. */                      \
static inline V normal_cdf_##S(V x, V *pdf)                                                 \
{                                                                                           \
    const V zero = {0};                                                                     \
    const V neg = -x * 0.70710678118654752f;         /* erfc's argument */                  \
    V z = select_##S((VI)(neg < zero), -neg, neg);                                          \
    z = select_##S((VI)(z > 10.0f), zero + 10.0f, z);                                       \
    const V t = recip_##S(1.0f + 0.5f * z);                                                 \
    V p = zero + 0.17087277f;                                                               \
    p = p * t - 0.82215223f;                                                                \
    p = p * t + 1.48851587f;                                                                \
    p = p * t - 1.13520398f;                                                                \
    p = p * t + 0.27886807f;                                                                \
    p = p * t - 0.18628806f;                                                                \
    p = p * t + 0.09678418f;                                                                \
    p = p * t + 0.37409196f;                                                                \
    p = p * t + 1.00002368f;                                                                \
    p = p * t - 1.26551223f;                                                                \
    V tail;                                          /* erfc(|neg|) */                      \
    if (any_##VI((VI)(z >= 3.0f))) {                                                        \
        const V s = __builtin_convertvector(__builtin_convertvector(z * 16.0f, VI), V) *    \
                     0.0625f;                                                               \
        const V rest = (z - s) * (z + s), big = exp_##S(-s * s);                            \
        tail = t * big * exp_##S(p - rest);                                                 \
        if (pdf != NULL) *pdf = big * exp_##S(-rest) * 0.39894228040143268f;                \
    } else if (pdf != NULL) {                                                               \
        const V gauss = exp_##S(-z * z);                                                    \
        tail = t * gauss * exp_##S(p);                                                      \
        *pdf = gauss * 0.39894228040143268f;                                                \
    } else {                                                                                \
        tail = t * exp_##S(p - z * z);                                                      \
    }                                                                                       \
    return 0.5f * select_##S((VI)(neg < zero), 2.0f - tail, tail);                          \
}

DEFINE_VECTOR_MATH(vf, vi, vf, 8)
DEFINE_VECTOR_MATH(vf16, vi16, vf16, 16)

/* vn: the vector the build target runs natively, VN_LANES floats - vf16 where it has
 * AVX-512, else vf (GCC splits a 16-float vector's arithmetic into AVX2 halves, but
 * not all of its compares and selects: gelu ran 10x slower on 16 lanes than on 8). */
#if defined(__AVX512F__)
#define VN_LANES 16
typedef vf16 vn;
typedef vf16u vnu;
typedef vi16 vni;
#define exp_vn exp_vf16
#define select_vn select_vf16
#define normal_cdf_vn normal_cdf_vf16
#else
#define VN_LANES 8
typedef vf vn;
typedef vfu vnu;
typedef vi vni;
#define exp_vn exp_vf
#define select_vn select_vf
#define normal_cdf_vn normal_cdf_vf
#endif

/* The first `count` (< VN_LANES) floats at p as a vector whose other lanes are 0, and
 * the first `count` lanes of v stored at p: a range's last few values go through one
 * vector. */
static inline vn vn_load_first(const float *p, int64_t count)
{
    float lanes[VN_LANES] = {0};
    memcpy(lanes, p, sizeof(float) * count);
    return *(const vnu *)lanes;
}

static inline void vn_store_first(float *p, vn v, int64_t count)
{
    float lanes[VN_LANES];
    *(vnu *)lanes = v;
    memcpy(p, lanes, sizeof(float) * count);
}
