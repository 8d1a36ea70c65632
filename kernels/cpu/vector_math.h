/* Vectors of 8 floats (GCC's vector extensions: AVX where the machine has it, two SSE
 * registers otherwise) and the elementwise functions the native kernels share: a lane
 * select, exp and the standard normal's CDF and density. Each kernel's .c includes this
 * (native.py puts it in the source). */
#include <stdint.h>

typedef float vf __attribute__((vector_size(32)));
typedef float vfu __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi __attribute__((vector_size(32)));

static inline vf select_vf(vi take, vf a, vf b)      /* take ? a : b, lane by lane */
{
    return (vf)(((vi)a & take) | ((vi)b & ~take));
}

/* exp of 8 floats x <= 88 (larger x: undefined; every caller's are <= 0): n =
 * round(x / ln 2) by adding and subtracting 1.5 * 2^23 (no conversions), a degree-5
 * polynomial (Cephes' expf's) of the rest, 2^n added to the exponent bits. Below
 * -87.3 (and -inf) it is 0. Relative error within 2 ulp. */
static inline vf exp_vf(vf x)
{
    const vf zero = {0};
    const vf magic = zero + 12582912.0f;              /* 1.5 * 2^23 */
    const vi dead = (vi)(x < -87.33654f);
    const vf shifted = x * 1.44269504088896341f + magic;
    const vf n = shifted - magic;                     /* round(x / ln 2) */
    const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
    const vf r2 = r * r;
    vf y = zero + 1.9875691500E-4f;
    y = y * r + 1.3981999507E-3f;
    y = y * r + 8.3334519073E-3f;
    y = y * r + 4.1665795894E-2f;
    y = y * r + 1.6666665459E-1f;
    y = y * r + 5.0000001201E-1f;
    y = y * r2 + r + 1.0f;
    const vi scaled = (vi)y + (((vi)shifted - (vi)magic) << 23);
    return (vf)(scaled & ~dead);
}

static inline int any_vi(vi m)                      /* any lane true */
{
    return (m[0] | m[1] | m[2] | m[3] | m[4] | m[5] | m[6] | m[7]) != 0;
}

/* Phi(x) = erfc(-x / sqrt 2) / 2 for 8 floats, and (pdf not NULL) the density
 * phi(x) = exp(-x^2 / 2) / sqrt(2 pi). erfc(z) for z = |x| / sqrt 2 is Numerical
 * Recipes' erfcc, t exp(-z^2 + P(t)) with t = 1 / (1 + z / 2) and P of degree 9
 * (fractional error below 1.2e-7 for every z >= 0, so the left tail keeps its
 * relative accuracy); erfc(-z) = 2 - erfc(z). Where a lane has z >= 3, exp(-z^2) is
 * exp(-s^2) exp(-(z - s)(z + s)), s = trunc(16 z) / 16 (s^2 exact: the square's
 * rounding costs no digits); below, the rounding of z^2 costs at most 5e-7. z is
 * clamped at 10 (erfc(10) underflows a float). NaN where x is NaN. */
static inline vf normal_cdf_vf(vf x, vf *pdf)
{
    const vf zero = {0};
    const vf neg = -x * 0.70710678118654752f;         /* erfc's argument */
    vf z = select_vf((vi)(neg < zero), -neg, neg);
    z = select_vf((vi)(z > 10.0f), zero + 10.0f, z);
    const vf t = 1.0f / (1.0f + 0.5f * z);
    vf p = zero + 0.17087277f;
    p = p * t - 0.82215223f;
    p = p * t + 1.48851587f;
    p = p * t - 1.13520398f;
    p = p * t + 0.27886807f;
    p = p * t - 0.18628806f;
    p = p * t + 0.09678418f;
    p = p * t + 0.37409196f;
    p = p * t + 1.00002368f;
    p = p * t - 1.26551223f;
    vf tail;                                          /* erfc(|neg|) */
    if (any_vi((vi)(z >= 3.0f))) {
        const vf s = __builtin_convertvector(__builtin_convertvector(z * 16.0f, vi), vf) *
                     0.0625f;
        const vf rest = (z - s) * (z + s), big = exp_vf(-s * s);
        tail = t * big * exp_vf(p - rest);
        if (pdf != NULL) *pdf = big * exp_vf(-rest) * 0.39894228040143268f;
    } else if (pdf != NULL) {
        const vf gauss = exp_vf(-z * z);
        tail = t * gauss * exp_vf(p);
        *pdf = gauss * 0.39894228040143268f;
    } else {
        tail = t * exp_vf(p - z * z);
    }
    return 0.5f * select_vf((vi)(neg < zero), 2.0f - tail, tail);
}
