/* Native CPU kernels of gelu and its gradient for float32 (the float64 ones stay in
 * numpy, kernels/cpu/activation.py, which is also the reference these are tested
 * against): out = x Phi(x), dx = dout (Phi(x) + x phi(x)), Phi the standard normal's
 * CDF and phi its density exp(-x^2 / 2) / sqrt(2 pi), in float on vector_math.h's vn
 * (16 lanes with AVX-512, else 8; vector_math.h: erfc to a fractional error of 1.2e-7,
 * the left tail included). Built and loaded by native.py, launched by gelu_native.py.
 * Values are split in contiguous ranges of whole blocks of 16 over up to `threads`
 * threads (native_pool.h); each is computed one way, so results do not depend on the
 * count. */
#include <stddef.h>
#include <stdint.h>

#include "native_pool.h"
#include "vector_math.h"

typedef struct {
    const float *x, *dout;
    float *out;
    int64_t begin, end;
} job_t;

static inline vn gelu_v(vn x, vn d, int grad)
{
    if (!grad) return x * normal_cdf_vn(x, NULL);
    vn density;
    const vn cdf = normal_cdf_vn(x, &density);
    return d * (cdf + x * density);
}

static void run(const job_t *j, int grad)
{
    const float *x = j->x, *dout = j->dout;
    float *out = j->out;
    const int64_t end = j->end;     /* locals: stores to out would make j's be read again */
    const vn zero = {0};
    int64_t i = j->begin;
    for (; i + VN_LANES <= end; i += VN_LANES) {
        const vn d = grad ? *(const vnu *)(dout + i) : zero;
        *(vnu *)(out + i) = gelu_v(*(const vnu *)(x + i), d, grad);
    }
    if (i < end) {                                 /* the last few, through a vector */
        const vn d = grad ? vn_load_first(dout + i, end - i) : zero;
        vn_store_first(out + i, gelu_v(vn_load_first(x + i, end - i), d, grad), end - i);
    }
}

static void *run_forward(void *arg) { run(arg, 0); return NULL; }
static void *run_backward(void *arg) { run(arg, 1); return NULL; }

static void launch(const float *x, const float *dout, float *out, int64_t n, int threads,
                   int grad)
{
    job_t jobs[POOL_MAX_THREADS];
    const int64_t blocks16 = (n + 15) / 16;
    const int64_t parts = pool_parts(threads, blocks16);
    for (int64_t t = 0; t < parts; t++) {
        int64_t b0, b1;
        pool_share(blocks16, parts, t, &b0, &b1);
        jobs[t].x = x; jobs[t].dout = dout; jobs[t].out = out;
        jobs[t].begin = b0 * 16 < n ? b0 * 16 : n;
        jobs[t].end = b1 * 16 < n ? b1 * 16 : n;
    }
    pool_run(grad ? run_backward : run_forward, jobs, sizeof(job_t), parts);
}

/* out[i] = gelu(x[i]) for i < n. Returns 0. */
int gelu_forward_f32(const float *x, float *out, int64_t n, int threads)
{
    launch(x, NULL, out, n, threads, 0);
    return 0;
}

/* gelu_forward_f32 with its arguments in one int64 array (a prepared call's: one foreign
 * call converts one pointer, not four values). ints: x, out (as integers), n, threads. */
int gelu_forward_f32_packed(const int64_t *ints)
{
    return gelu_forward_f32((const float *)ints[0], (float *)ints[1], ints[2], (int)ints[3]);
}

/* dx[i] = dout[i] (Phi(x[i]) + x[i] phi(x[i])) for i < n (dx may be dout). Returns 0. */
int gelu_backward_f32(const float *x, const float *dout, float *dx, int64_t n, int threads)
{
    launch(x, dout, dx, n, threads, 1);
    return 0;
}
