/* Native CPU kernels of float32 leaky_relu, sigmoid, tanh and silu and their gradients
 * (the numpy kernels, kernels/cpu/activation.py and silu.py, compute in float64 and are
 * the reference these are tested against). Built by native.py, launched by
 * activation_native.py.
 *
 * - leaky_relu: out = x where x > 0, else alpha x; dx = dout where x > 0, else alpha
 *   dout; alpha x in double, rounded once: the numpy kernel's bits.
 * - sigmoid: 1 / (1 + e) for x >= 0, e / (1 + e) below, e = exp(-|x|) (nothing
 *   overflows); dx = dout out (1 - out).
 * - tanh: for |x| < 0.625, x + x^3 P(x^2) (Cephes' tanhf polynomial: no cancellation
 *   near 0); above, (1 - e) / (1 + e) with e = exp(-2 |x|), x's sign; dx = dout (1 -
 *   out^2).
 * - silu: x sigmoid(x); dx = dout s (1 + x (1 - s)), s = sigmoid(x).
 * In float on vector_math.h's vn (16 lanes where the build target has AVX-512, else
 * 8) with its exp (within 2 ulp), so within a few float32 ulps of the float64 kernels;
 * a NaN stays NaN. Values are split in contiguous
 * ranges over up to `threads` threads (native_pool.h); each is computed one way, so
 * results do not depend on the count. */
#include <stddef.h>
#include <stdint.h>

#include "native_pool.h"
#include "vector_math.h"

enum { LEAKY_RELU, SIGMOID, TANH, SILU };

typedef struct {
    const float *v, *dout;      /* v: x, or out for sigmoid's and tanh's gradients */
    float *out;
    double alpha;
    int64_t begin, end;
    int kind, grad;
} job_t;

static inline vn keep_nan(vn x, vn y) { return select_vn((vni)(x != x), x, y); }

static inline vn sigmoid_v(vn x)
{
    const vn zero = {0};
    const vn e = exp_vn(-select_vn((vni)(x < zero), -x, x));
    const vn r = 1.0f / (1.0f + e);
    return keep_nan(x, select_vn((vni)(x >= zero), r, e * r));
}

static inline vn tanh_v(vn x)
{
    const vn zero = {0};
    const vn a = select_vn((vni)(x < zero), -x, x), z = x * x;
    vn p = zero - 5.70498872745e-3f;
    p = p * z + 2.06390887954e-2f;
    p = p * z - 5.37397155531e-2f;
    p = p * z + 1.33314422036e-1f;
    p = p * z - 3.33332819422e-1f;
    const vn small = p * z * x + x;
    const vn e = exp_vn(-2.0f * a), big = (1.0f - e) / (1.0f + e);
    const vn large = select_vn((vni)(x < zero), -big, big);
    return keep_nan(x, select_vn((vni)(a < 0.625f), small, large));
}

/* One vector of results: the kind's forward of v, or its gradient for dout d. */
static inline vn lanes(int kind, int grad, vn v, vn d)
{
    switch (kind * 2 + grad) {
    case SIGMOID * 2: return sigmoid_v(v);
    case SIGMOID * 2 + 1: return d * v * (1.0f - v);
    case TANH * 2: return tanh_v(v);
    case TANH * 2 + 1: return d * (1.0f - v * v);
    case SILU * 2: return v * sigmoid_v(v);
    default: {
        const vn s = sigmoid_v(v);
        return d * s * (1.0f + v * (1.0f - s));
    }
    }
}

typedef double vd __attribute__((vector_size(64)));     /* 8 doubles: one vf's lanes */

/* leaky_relu 8 lanes at a time (alpha times the value in double, rounded once, as the
 * numpy kernel), the last few one at a time. */
static void leaky(const job_t *j)
{
    const float *x = j->v, *from = j->grad ? j->dout : j->v;
    float *out = j->out;
    const double alpha = j->alpha;
    const vf zero = {0};
    int64_t i = j->begin;
    for (; i + 8 <= j->end; i += 8) {
        const vf v = *(const vfu *)(from + i);
        const vf scaled = __builtin_convertvector(alpha * __builtin_convertvector(v, vd), vf);
        *(vfu *)(out + i) = select_vf((vi)(*(const vfu *)(x + i) > zero), v, scaled);
    }
    for (; i < j->end; i++) out[i] = x[i] > 0 ? from[i] : (float)(alpha * (double)from[i]);
}

/* One job's range for a constant kind and grad: each call below is a loop of its own.
 * With the switch inside one loop, every vector branched and loaded its constants again,
 * and AVX2 builds, whose vectors are half as wide, took 1.3-1.9x the time of AVX-512
 * ones (1.0-1.4x with a loop per function). */
static inline __attribute__((always_inline)) void run_kind(const job_t *j, const int kind,
                                                           const int grad)
{
    const float *v = j->v, *dout = j->dout;
    float *out = j->out;
    const int64_t end = j->end;
    const vn zero = {0};
    int64_t i = j->begin;
    for (; i + VN_LANES <= end; i += VN_LANES) {
        const vn d = grad ? *(const vnu *)(dout + i) : zero;
        *(vnu *)(out + i) = lanes(kind, grad, *(const vnu *)(v + i), d);
    }
    if (i < end) {                                 /* the last few, through a vector */
        const vn d = grad ? vn_load_first(dout + i, end - i) : zero;
        vn_store_first(out + i, lanes(kind, grad, vn_load_first(v + i, end - i), d), end - i);
    }
}

static void *run(void *arg)
{
    const job_t *j = arg;
    switch (j->kind * 2 + j->grad) {
    case SIGMOID * 2: run_kind(j, SIGMOID, 0); break;
    case SIGMOID * 2 + 1: run_kind(j, SIGMOID, 1); break;
    case TANH * 2: run_kind(j, TANH, 0); break;
    case TANH * 2 + 1: run_kind(j, TANH, 1); break;
    case SILU * 2: run_kind(j, SILU, 0); break;
    case SILU * 2 + 1: run_kind(j, SILU, 1); break;
    default: leaky(j);
    }
    return NULL;
}

/* kind 0-3 (leaky_relu, sigmoid, tanh, silu): out[i] = its forward of v[i] (grad 0), or
 * its gradient for dout[i] (grad 1; v is out for sigmoid and tanh, else x), i < n, on up
 * to `threads` threads; out may be dout. Returns 0, or 1 for an unknown kind. */
int activation_f32(int kind, int grad, const float *v, const float *dout, float *out,
                   int64_t n, double alpha, int threads)
{
    if (kind < LEAKY_RELU || kind > SILU) return 1;
    job_t jobs[POOL_MAX_THREADS];
    const int64_t blocks16 = (n + 15) / 16, parts = pool_parts(threads, blocks16);
    for (int64_t t = 0; t < parts; t++) {
        int64_t b0, b1;
        pool_share(blocks16, parts, t, &b0, &b1);
        jobs[t] = (job_t){v, dout, out, alpha, b0 * 16 < n ? b0 * 16 : n,
                          b1 * 16 < n ? b1 * 16 : n, kind, grad};
    }
    pool_run(run, jobs, sizeof(job_t), parts);
    return 0;
}
