/* The native CPU kernel of relu's gradient: dx = dout where out > 0, else +0.0, as
 * dout's bits ANDed with a mask of all ones or all zeros, in one pass: the same bits
 * as the numpy kernel (kernels/cpu/activation.py, the reference), so a NaN in out
 * gives 0 and dout's NaN, infinities and signs pass where out > 0. dx may be dout
 * (written over it). Built and loaded by native.py, launched by relu_native.py.
 *
 * Values are split in contiguous ranges over up to `threads` threads
 * (native_pool.h); each value is computed one way, so results do not depend on the
 * number of threads. */
#include <stdint.h>

#include "native_pool.h"

typedef struct {
    const void *out, *dout;
    void *dx;
    int64_t begin, end;
    int f64;
} job_t;

/* The bounds in locals: built with -fno-strict-aliasing, a store through dx could
 * change j->end, and the loop would not be vectorized. */
#define KERNEL(T, U)                                                                    \
    static void relu_grad_##T(const job_t *j) {                                         \
        const T *out = j->out;                                                          \
        const U *dout = j->dout;                                                        \
        U *dx = j->dx;                                                                  \
        const int64_t begin = j->begin, end = j->end;                                   \
        for (int64_t i = begin; i < end; i++)                                           \
            dx[i] = dout[i] & ((U)0 - (U)(out[i] > (T)0));                              \
    }

KERNEL(float, uint32_t)
KERNEL(double, uint64_t)

static void *run(void *arg) {
    const job_t *j = arg;
    if (j->f64)
        relu_grad_double(j);
    else
        relu_grad_float(j);
    return 0;
}

/* dx (n values) = dout where out > 0, else +0.0; float32 (f64 = 0) or float64
 * arrays; dx may be dout. Returns 0. */
int relu_grad(int f64, const void *out, const void *dout, void *dx, int64_t n, int threads) {
    job_t jobs[POOL_MAX_THREADS];
    int64_t parts = pool_parts(threads, n);
    for (int64_t t = 0; t < parts; t++) {
        job_t *j = &jobs[t];
        j->out = out; j->dout = dout; j->dx = dx; j->f64 = f64;
        pool_share(n, parts, t, &j->begin, &j->end);
    }
    pool_run(run, jobs, sizeof(job_t), parts);
    return 0;
}
