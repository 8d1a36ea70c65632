/* The native CPU kernels of softmax_with_cross_entropy on float32 logits with hard
 * labels (built by native.py, launched by swce_native.py): the numpy kernels'
 * arithmetic (kernels/cpu/softmax_with_cross_entropy.py, the reference) in one pass
 * a row, in float64 like them. A row's logits shifted by their max, z, give
 * lse = log(sum exp z) (the sum in numpy's pairwise order), log_softmax = z - lse,
 * softmax = exp(log_softmax) and loss = -log_softmax[label]; with label smoothing
 * eps, loss = (1 - eps) loss - eps mean(log_softmax). The gradient (dloss given, no
 * dsoftmax) is (softmax - eps / K - (1 - eps) onehot) * dloss, each value one
 * subtraction after another and one product, as numpy's in-place steps make it.
 * exp and log are the C library's, which may differ from numpy's in a float64's
 * last bit: the float32 results then differ in rare last bits at most.
 *
 * Rows are split in contiguous ranges over up to `threads` threads (native_pool.h);
 * each row is computed one way, so results do not depend on the count. */
#include <math.h>
#include <stdint.h>

#include "native_pool.h"

#ifdef __clang__
#pragma clang fp contract(off)
#else
#pragma GCC optimize("fp-contract=off")     /* numpy rounds each product and sum */
#endif

typedef struct {
    const float *logits, *sm, *dloss;
    const int64_t *label;
    float *softmax, *loss, *dlogits;
    double eps;
    int64_t k, begin, end;
} job_t;

/* A row's value c of either sum: exp(x[c] - top), or (lse given) log_softmax[c] =
 * (x[c] - top) - lse. */
static inline double row_value(const float *x, double top, double lse, int log_softmax,
                               int64_t c)
{
    const double z = (double)x[c] - top;
    return log_softmax ? z - lse : exp(z);
}

/* The sum of a row's values [begin, begin + k) (row_value) as numpy's add.reduce of a
 * contiguous float64 row adds them: in order from -0.0 below 8 values, else 8 running
 * sums over whole blocks of 8, combined pairwise, then the rest in order; halves cut
 * at a multiple of 8 above 128 values. */
static double pairwise_sum(const float *x, double top, double lse, int log_softmax,
                           int64_t begin, int64_t k)
{
    if (k < 8) {
        double s = -0.0;
        for (int64_t c = begin; c < begin + k; c++) s += row_value(x, top, lse, log_softmax, c);
        return s;
    }
    if (k <= 128) {
        double r[8];
        for (int i = 0; i < 8; i++) r[i] = row_value(x, top, lse, log_softmax, begin + i);
        int64_t c;
        for (c = 8; c < k - k % 8; c += 8)
            for (int i = 0; i < 8; i++) r[i] += row_value(x, top, lse, log_softmax, begin + c + i);
        double s = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; c < k; c++) s += row_value(x, top, lse, log_softmax, begin + c);
        return s;
    }
    int64_t half = k / 2;
    half -= half % 8;
    return pairwise_sum(x, top, lse, log_softmax, begin, half) +
           pairwise_sum(x, top, lse, log_softmax, begin + half, k - half);
}

static void *forward_job(void *arg)
{
    const job_t *j = arg;
    const int64_t k = j->k;
    for (int64_t i = j->begin; i < j->end; i++) {
        const float *x = j->logits + i * k;
        float top = x[0];
        for (int64_t c = 1; c < k; c++) top = x[c] > top ? x[c] : top;
        const double lse = log(0.0 + pairwise_sum(x, top, 0.0, 0, 0, k));
        for (int64_t c = 0; c < k; c++)
            j->softmax[i * k + c] = (float)exp(row_value(x, top, lse, 1, c));
        double loss = -row_value(x, top, lse, 1, j->label[i]);
        if (j->eps != 0.0)
            loss = (1.0 - j->eps) * loss -
                   j->eps * ((0.0 + pairwise_sum(x, top, lse, 1, 0, k)) / (double)k);
        j->loss[i] = (float)loss;
    }
    return NULL;
}

static void *backward_job(void *arg)
{
    const job_t *j = arg;
    const int64_t k = j->k;
    const double spread = j->eps / (double)k, kept = 1.0 - j->eps;
    for (int64_t i = j->begin; i < j->end; i++) {
        const float *s = j->sm + i * k;
        float *d = j->dlogits + i * k;
        const double scale = j->dloss[i];
        const int64_t at = j->label[i];
        for (int64_t c = 0; c < k; c++) {
            double v = (double)s[c] - spread;
            if (c == at) v -= kept;
            d[c] = (float)(v * scale);
        }
    }
    return NULL;
}

/* The first row whose label is outside [0, k), or -1. */
static int64_t bad_label(const int64_t *label, int64_t n, int64_t k)
{
    for (int64_t i = 0; i < n; i++)
        if (label[i] < 0 || label[i] >= k) return i;
    return -1;
}

static void run_rows(pool_fn fn, job_t *proto, int64_t n, int threads)
{
    job_t jobs[POOL_MAX_THREADS];
    const int64_t parts = pool_parts(threads, n);
    for (int64_t t = 0; t < parts; t++) {
        jobs[t] = *proto;
        pool_share(n, parts, t, &jobs[t].begin, &jobs[t].end);
    }
    pool_run(fn, jobs, sizeof(job_t), parts);
}

/* softmax (n, k) and loss (n,) of float32 logits (n, k), k >= 1, and int64 labels:
 * -1, or the first row whose label is outside [0, k) (nothing written then). */
int64_t swce_forward(const float *logits, const int64_t *label, float *softmax, float *loss,
                     int64_t n, int64_t k, double eps, int threads)
{
    const int64_t bad = bad_label(label, n, k);
    if (bad >= 0) return bad;
    job_t proto = {.logits = logits, .label = label, .softmax = softmax, .loss = loss,
                   .eps = eps, .k = k};
    run_rows(forward_job, &proto, n, threads);
    return -1;
}

/* dlogits (n, k) = (softmax - eps / k - (1 - eps) onehot(label)) * dloss[:, None], all
 * float32: -1, or the first row whose label is outside [0, k) (nothing written). */
int64_t swce_backward(const float *sm, const int64_t *label, const float *dloss,
                      float *dlogits, int64_t n, int64_t k, double eps, int threads)
{
    const int64_t bad = bad_label(label, n, k);
    if (bad >= 0) return bad;
    job_t proto = {.sm = sm, .label = label, .dloss = dloss, .dlogits = dlogits, .eps = eps,
                   .k = k};
    run_rows(backward_job, &proto, n, threads);
    return -1;
}
