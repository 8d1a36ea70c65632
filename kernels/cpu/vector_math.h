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

/* exp of 8 floats (Cephes' expf: n = round(x / ln 2), a degree-5 polynomial of the
 * rest, 2^n from the exponent bits); below -87.3 (and -inf) it is 0, above 88.7 the
 * largest float's neighbourhood (88.7 is clamped). Relative error within 2 ulp. */
static inline vf exp_vf(vf x)
{
    const vf zero = {0};
    const vf hi = zero + 88.72283f, lo = zero - 87.33654f;
    const vi dead = (vi)(x < lo);
    x = select_vf((vi)(x > hi), hi, x);
    x = select_vf(dead, lo, x);
    const vf fx = x * 1.44269504088896341f + 0.5f;
    vf fl = __builtin_convertvector(__builtin_convertvector(fx, vi), vf);
    fl = select_vf((vi)(fl > fx), fl - 1.0f, fl);       /* floor */
    const vi ni = __builtin_convertvector(fl, vi);
    x = x - fl * 0.693359375f + fl * 2.12194440e-4f;
    const vf z = x * x;
    vf y = zero + 1.9875691500E-4f;
    y = y * x + 1.3981999507E-3f;
    y = y * x + 8.3334519073E-3f;
    y = y * x + 4.1665795894E-2f;
    y = y * x + 1.6666665459E-1f;
    y = y * x + 5.0000001201E-1f;
    y = y * z + x + 1.0f;
    const vi bits = (ni + 127) << 23;
    const vf r = y * (vf)bits;
    return (vf)((vi)r & ~dead);
}

/* exp(-y^2) for y >= 0 with y^2 split as erf.py's _times_gauss does (s = trunc(16 y) /
 * 16: exp(-s^2) exp(-(y - s)(y + s))), so the square's rounding costs no digits. */
static inline vf gauss_vf(vf y)
{
    const vf s = __builtin_convertvector(__builtin_convertvector(y * 16.0f, vi), vf) * 0.0625f;
    return exp_vf(-s * s) * exp_vf(-(y - s) * (y + s));
}

/* Phi(x) = erfc(-x / sqrt 2) / 2 for 8 floats (NaN where x is NaN), by W. J. Cody's rational approximations
 * of erf and erfc (kernels/cpu/erf.py's, evaluated in float; every range computed and
 * the right one kept per lane), so the left tail keeps its relative accuracy. */
static inline vf normal_cdf_vf(vf x)
{
    const vf zero = {0};
    const vf t = -x * 0.70710678118654752f;          /* erfc's argument */
    vf y = select_vf((vi)(t < zero), -t, t);         /* |t|, at most 10: erfc(10) */
    y = select_vf((vi)(y > 10.0f), zero + 10.0f, y); /* underflows a float */
    /* erf(t) for |t| <= 0.46875 */
    const vf ysq = t * t;
    vf num = ysq * 1.85777706184603153e-1f, den = ysq;
    num = (num + 3.16112374387056560e00f) * ysq; den = (den + 2.36012909523441209e01f) * ysq;
    num = (num + 1.13864154151050156e02f) * ysq; den = (den + 2.44024637934444173e02f) * ysq;
    num = (num + 3.77485237685302021e02f) * ysq; den = (den + 1.28261652607737228e03f) * ysq;
    const vf erf_small = t * (num + 3.20937758913846947e03f) / (den + 2.84423683343917062e03f);
    /* erfc(y) for 0.46875 < y <= 4 */
    vf n2 = y * 2.15311535474403846e-8f, d2 = y;
    n2 = (n2 + 5.64188496988670089e-1f) * y; d2 = (d2 + 1.57449261107098347e01f) * y;
    n2 = (n2 + 8.88314979438837594e00f) * y; d2 = (d2 + 1.17693950891312499e02f) * y;
    n2 = (n2 + 6.61191906371416295e01f) * y; d2 = (d2 + 5.37181101862009858e02f) * y;
    n2 = (n2 + 2.98635138197400131e02f) * y; d2 = (d2 + 1.62138957456669019e03f) * y;
    n2 = (n2 + 8.81952221241769090e02f) * y; d2 = (d2 + 3.29079923573345963e03f) * y;
    n2 = (n2 + 1.71204761263407058e03f) * y; d2 = (d2 + 4.36261909014324716e03f) * y;
    n2 = (n2 + 2.05107837782607147e03f) * y; d2 = (d2 + 3.43936767414372164e03f) * y;
    const vf mid = (n2 + 1.23033935479799725e03f) / (d2 + 1.23033935480374942e03f);
    /* erfc(y) for y > 4: the asymptotic form */
    const vf inv = 1.0f / (y * y);
    vf n3 = inv * 1.63153871373020978e-2f, d3 = inv;
    n3 = (n3 + 3.05326634961232344e-1f) * inv; d3 = (d3 + 2.56852019228982242e00f) * inv;
    n3 = (n3 + 3.60344899949804439e-1f) * inv; d3 = (d3 + 1.87295284992346047e00f) * inv;
    n3 = (n3 + 1.25781726111229246e-1f) * inv; d3 = (d3 + 5.27905102951428412e-1f) * inv;
    n3 = (n3 + 1.60837851487422766e-2f) * inv; d3 = (d3 + 6.05183413124413191e-2f) * inv;
    const vf r = inv * (n3 + 6.58749161529837803e-4f) / (d3 + 2.33520497626869185e-3f);
    const vf big = (5.6418958354775628695e-1f - r) / y;
    const vf tail = gauss_vf(y) * select_vf((vi)(y <= 4.0f), mid, big);   /* erfc(|t|) */
    const vf erfc_t = select_vf((vi)(t < zero), 2.0f - tail, tail);
    return 0.5f * select_vf((vi)(y <= 0.46875f), 1.0f - erf_small, erfc_t);
}
