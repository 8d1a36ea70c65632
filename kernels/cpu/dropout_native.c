/* The native CPU kernel of dropout's training forward: the keep mask from
 * Philox4x32-10 and the scaled output in one pass, the same bits as the numpy
 * kernel (kernels/cpu/dropout.py with philox.py, the reference) and the GPU's:
 * word i is word i % 4 of philox(counter (i / 4 low, i / 4 high, stream, 0), key
 * (seed low, seed high)); u_i = (word >> 8) / 2^24; keep_i = u_i >= p (in double);
 * out_i = x_i * (keep_i ? factor : 0) in x's dtype. Built and loaded by native.py,
 * launched by dropout_native.py.
 *
 * Values are split in contiguous ranges of whole generator calls (four values)
 * over up to `threads` threads (native_pool.h); each value is computed one
 * way, so results do not depend on the number of threads. */
#include <stdint.h>

#include "native_pool.h"

typedef struct {
    const void *x;
    void *out;
    uint8_t *mask;
    int64_t begin, end, n;             /* generator calls [begin, end); n values */
    double p, factor;
    uint32_t stream, k0, k1;
    int f64;
} job_t;

static void philox(uint64_t call, uint32_t stream, uint32_t k0, uint32_t k1, uint32_t w[4]) {
    uint32_t c0 = (uint32_t)call, c1 = (uint32_t)(call >> 32), c2 = stream, c3 = 0;
    for (int r = 0; r < 10; r++) {
        const uint64_t p0 = (uint64_t)c0 * 0xD2511F53u, p1 = (uint64_t)c2 * 0xCD9E8D57u;
        const uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = n0;
        c2 = n2;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    w[0] = c0; w[1] = c1; w[2] = c2; w[3] = c3;
}

#define KERNEL(T)                                                                       \
    static void dropout_##T(const job_t *j) {                                           \
        const T *x = j->x;                                                              \
        T *out = j->out;                                                                \
        const T factor = (T)j->factor;                                                  \
        uint32_t w[4];                                                                  \
        for (int64_t call = j->begin; call < j->end; call++) {                          \
            philox((uint64_t)call, j->stream, j->k0, j->k1, w);                         \
            for (int64_t k = 0; k < 4 && 4 * call + k < j->n; k++) {                    \
                const int64_t i = 4 * call + k;                                         \
                const int keep = (double)(w[k] >> 8) * (1.0 / 16777216.0) >= j->p;      \
                j->mask[i] = (uint8_t)keep;                                             \
                out[i] = x[i] * (keep ? factor : (T)0);                                 \
            }                                                                           \
        }                                                                               \
    }

KERNEL(float)
KERNEL(double)

static void *run(void *arg) {
    const job_t *j = arg;
    if (j->f64)
        dropout_double(j);
    else
        dropout_float(j);
    return 0;
}

/* out and mask (n values each) of dropout with probability p, factor 1 / (1 - p)
 * (computed by the caller, rounded to x's dtype here), seed64 and stream (see the
 * file comment). Returns 0. */
int dropout_forward(int f64, const void *x, void *out, uint8_t *mask, int64_t n, double p,
                    double factor, uint64_t seed64, uint32_t stream, int threads) {
    job_t jobs[POOL_MAX_THREADS];
    const int64_t calls = (n + 3) / 4;
    int64_t parts = pool_parts(threads, calls);
    for (int64_t t = 0; t < parts; t++) {
        job_t *j = &jobs[t];
        j->x = x; j->out = out; j->mask = mask; j->n = n;
        pool_share(calls, parts, t, &j->begin, &j->end);
        j->p = p; j->factor = factor; j->stream = stream;
        j->k0 = (uint32_t)seed64; j->k1 = (uint32_t)(seed64 >> 32);
        j->f64 = f64;
    }
    pool_run(run, jobs, sizeof(job_t), parts);
    return 0;
}
