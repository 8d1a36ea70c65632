/* The native CPU kernel of batch norm's running estimates after a training batch
 * (built by native.py, launched by bn_estimates.py): the numpy steps of
 * kernels/cpu/batch_norm.blended_estimates (the reference) in one call over the
 * channels, each value rounded as numpy rounds it (products and sums apart: no
 * contraction into fused multiply-adds), so the bits are numpy's:
 *   unbiased = var * factor
 *   rule 0 (the first batch sets them): new = (mean, unbiased)
 *   rule 1 (momentum m):  new = m * est + (1 - m) * batch  (1 - m given as `rest`)
 *   rule 2 (cumulative):  new = est + (batch - est) * w
 * each new value cast to the estimates' dtype (float32 or float64). */
#include <math.h>
#include <stdint.h>

#ifdef __clang__
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")
#endif

static inline double blend(int rule, double est, double batch, double m, double rest)
{
    if (rule == 1) return m * est + rest * batch;
    if (rule == 2) return est + (batch - est) * m;
    return batch;
}

/* Writes the new estimates of c channels into new_mean and new_var (float64 when
 * est_f64, else float32, like est_mean and est_var, which are only read). Returns 0,
 * or 1 when a batch statistic or a new estimate is not finite (the caller then
 * raises and keeps the old estimates). */
int bn_estimates(int64_t c, const double *mean, const double *var, double factor, int rule,
                 double m, double rest, int est_f64, const void *est_mean, const void *est_var,
                 void *new_mean, void *new_var)
{
    int finite = 1;
    for (int64_t i = 0; i < c; i++) {
        const double unbiased = var[i] * factor;
        const double em = est_f64 ? ((const double *)est_mean)[i] : ((const float *)est_mean)[i];
        const double ev = est_f64 ? ((const double *)est_var)[i] : ((const float *)est_var)[i];
        double nm = blend(rule, em, mean[i], m, rest), nv = blend(rule, ev, unbiased, m, rest);
        if (est_f64) {
            ((double *)new_mean)[i] = nm;
            ((double *)new_var)[i] = nv;
        } else {
            ((float *)new_mean)[i] = (float)nm;
            ((float *)new_var)[i] = (float)nv;
            nm = (float)nm;
            nv = (float)nv;
        }
        finite &= isfinite(mean[i]) && isfinite(unbiased) && isfinite(nm) && isfinite(nv);
    }
    return !finite;
}
