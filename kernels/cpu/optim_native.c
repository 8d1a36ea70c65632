/* The native CPU kernels of the optimizer updates (sgd, momentum, adam): one pass
 * over the parameter, its gradient and its state, in the parameter's dtype (float32
 * or float64), in the order of operations of the numpy kernels they replace
 * (kernels/cpu/optimizer_ops.py, adam.py; the contract is there). Each reads its
 * inputs and writes its outputs through separate pointers, which may be the same
 * arrays (an update in place) or other ones of the same size (an update written
 * out of place). Built and loaded by native.py, launched by optim_native.py.
 *
 * Arrays of at least MIN_SPLIT values are split in contiguous ranges over up to
 * `threads` threads (native_pool.h); every value is computed by one thread in one
 * way, so the results do not depend on the number of threads. optim_update_list
 * makes the update of a list of arrays in one call (merged_momentum's), splitting
 * their values laid end to end the same way. */
#include <math.h>
#include <stdint.h>

#include "native_pool.h"

#define MAX_THREADS 64
#define MIN_SPLIT 16384     /* adam on 64Ki float32 values: 44 us on 2 threads, 86 on 1 */

typedef struct {
    int kind;                          /* 0 sgd, 1 momentum, 2 adam */
    int f64;
    const void *p, *g, *m, *v;         /* m: velocity for momentum, moment1 for adam */
    void *p_out, *m_out, *v_out;
    int64_t begin, end;
    double lr, wd, mu, b1, b2, eps, c1, c2;   /* c1 = lr / (1 - b1^t), c2 = sqrt(1 - b2^t) */
    int nesterov, decoupled;
} job_t;

/* Each value's update reads only that value's inputs, so the loops carry no
 * dependence even when outputs are inputs (in place): IVDEP says so, and spares
 * the compiler the overlap checks of seven arrays, more than it makes before it
 * gives up vectorizing. */
#if defined(__clang__)
#define IVDEP _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define IVDEP _Pragma("GCC ivdep")
#else
#define IVDEP
#endif

/* Every field of the job is read into a local first: with -fno-strict-aliasing a
 * store through po could change *j, so a field read inside a loop would be read
 * again on every value and keep the loop from being vectorized. */
#define UPDATE(T, SQRT)                                                                 \
    static void update_##T(const job_t *j) {                                            \
        const T *p = j->p, *g = j->g, *m = j->m, *v = j->v;                             \
        T *po = j->p_out, *mo = j->m_out, *vo = j->v_out;                               \
        const int64_t begin = j->begin, end = j->end;                                   \
        const T lr = (T)j->lr, wd = (T)j->wd;                                           \
        if (j->kind == 0) {                                                             \
            IVDEP                                                                       \
            for (int64_t i = begin; i < end; i++) {                                     \
                T d = wd != 0 ? g[i] + wd * p[i] : g[i];                                \
                po[i] = p[i] - d * lr;                                                  \
            }                                                                           \
        } else if (j->kind == 1) {                                                      \
            const T mu = (T)j->mu;                                                      \
            const int nesterov = j->nesterov;                                           \
            IVDEP                                                                       \
            for (int64_t i = begin; i < end; i++) {                                     \
                T d = wd != 0 ? g[i] + wd * p[i] : g[i];                                \
                T nv = mu * m[i] + d;                                                   \
                T step = nesterov ? d + mu * nv : nv;                                   \
                mo[i] = nv;                                                             \
                po[i] = p[i] - lr * step;                                               \
            }                                                                           \
        } else {                                                                        \
            const T b1c = (T)(1.0 - j->b1), b2 = (T)j->b2, b2c = (T)(1.0 - j->b2);      \
            const T c1 = (T)j->c1, c2 = (T)j->c2, eps = (T)j->eps;                      \
            const T shrink = (T)(1.0 - j->lr * j->wd);                                  \
            const int decoupled = j->decoupled, coupled = !j->decoupled && wd != 0;     \
            IVDEP                                                                       \
            for (int64_t i = begin; i < end; i++) {                                     \
                T pv = p[i], gv = g[i];                                                 \
                T pi = decoupled ? pv * shrink : pv;                                    \
                T gi = coupled ? gv + wd * pv : gv;                                     \
                T nm = m[i] + b1c * (gi - m[i]);                                        \
                T nv = v[i] * b2 + b2c * gi * gi;                                       \
                T denom = SQRT(nv) / c2 + eps;                                          \
                mo[i] = nm;                                                             \
                vo[i] = nv;                                                             \
                po[i] = pi - c1 * nm / denom;                                           \
            }                                                                           \
        }                                                                               \
    }

UPDATE(float, sqrtf)
UPDATE(double, sqrt)

static void *run(void *arg) {
    const job_t *j = arg;
    if (j->f64)
        update_double(j);
    else
        update_float(j);
    return 0;
}

/* A job of `kind` without its arrays and range: scalars lr, wd, mu, b1, b2, eps, c1,
 * c2 (those a kind does not use are ignored); flags nesterov, decoupled. */
static job_t job_of(int kind, int f64, const double *scalars, int nesterov, int decoupled) {
    job_t j = {0};
    j.kind = kind; j.f64 = f64;
    j.lr = scalars[0]; j.wd = scalars[1]; j.mu = scalars[2]; j.b1 = scalars[3];
    j.b2 = scalars[4]; j.eps = scalars[5]; j.c1 = scalars[6]; j.c2 = scalars[7];
    j.nesterov = nesterov; j.decoupled = decoupled;
    return j;
}

/* How many contiguous ranges n values split in (1 below MIN_SPLIT, else `threads`,
 * at most MAX_THREADS), and the length of each (*chunk, a multiple of 16). */
static int64_t parts_of(int64_t n, int threads, int64_t *chunk) {
    int64_t parts = n >= MIN_SPLIT ? threads : 1;
    if (parts < 1) parts = 1;
    if (parts > MAX_THREADS) parts = MAX_THREADS;
    *chunk = ((n + parts - 1) / parts + 15) / 16 * 16;
    return parts;
}

/* The update of n values (see the file comment). kind: 0 sgd, 1 momentum, 2 adam;
 * scalars and flags as job_of takes them. */
int optim_update(int kind, int f64, const void *p, const void *g, const void *m,
                 const void *v, void *p_out, void *m_out, void *v_out, int64_t n,
                 const double *scalars, int nesterov, int decoupled, int threads) {
    job_t jobs[MAX_THREADS];
    int64_t chunk, parts = parts_of(n, threads, &chunk);
    for (int64_t t = 0; t < parts; t++) {
        job_t *j = &jobs[t];
        *j = job_of(kind, f64, scalars, nesterov, decoupled);
        j->p = p; j->g = g; j->m = m; j->v = v;
        j->p_out = p_out; j->m_out = m_out; j->v_out = v_out;
        j->begin = t * chunk < n ? t * chunk : n;
        j->end = (t + 1) * chunk < n ? (t + 1) * chunk : n;
    }
    pool_run(run, jobs, sizeof(job_t), parts);
    return 0;
}

/* A job of optim_update_list: values [begin, end) of the arrays laid end to end. */
typedef struct {
    const job_t *base;                 /* kind, dtype, scalars and flags */
    int64_t count;
    void *const *ptrs;                 /* 7 per array: p, g, m, v, p_out, m_out, v_out */
    const int64_t *starts;             /* count + 1: where each array starts */
    int64_t begin, end;
} list_job_t;

static void *run_list(void *arg) {
    const list_job_t *l = arg;
    for (int64_t k = 0; k < l->count; k++) {
        int64_t lo = l->starts[k], hi = l->starts[k + 1];
        if (hi <= l->begin || lo >= l->end) continue;
        void *const *a = l->ptrs + 7 * k;
        job_t j = *l->base;
        j.p = a[0]; j.g = a[1]; j.m = a[2]; j.v = a[3];
        j.p_out = a[4]; j.m_out = a[5]; j.v_out = a[6];
        j.begin = (l->begin > lo ? l->begin : lo) - lo;
        j.end = (l->end < hi ? l->end : hi) - lo;
        run(&j);
    }
    return 0;
}

/* The update of `count` arrays in one call, each as optim_update would make it
 * (ptrs: 7 per array, as optim_update's p, g, m, v, p_out, m_out, v_out; sizes: their
 * lengths). The arrays' values, laid end to end, are split in contiguous ranges over
 * up to `threads` threads once there are MIN_SPLIT of them in all. */
int optim_update_list(int kind, int f64, int64_t count, void *const *ptrs,
                      const int64_t *sizes, const double *scalars, int nesterov, int decoupled,
                      int threads) {
    int64_t small_starts[65], *starts = small_starts;
    if (count > 64 && !(starts = malloc((size_t)(count + 1) * sizeof *starts))) return 1;
    starts[0] = 0;
    for (int64_t k = 0; k < count; k++) starts[k + 1] = starts[k] + sizes[k];
    int64_t n = starts[count];
    const job_t base = job_of(kind, f64, scalars, nesterov, decoupled);
    list_job_t jobs[MAX_THREADS];
    int64_t chunk, parts = parts_of(n, threads, &chunk);
    for (int64_t t = 0; t < parts; t++) {
        list_job_t *l = &jobs[t];
        l->base = &base; l->count = count; l->ptrs = ptrs; l->starts = starts;
        l->begin = t * chunk < n ? t * chunk : n;
        l->end = (t + 1) * chunk < n ? (t + 1) * chunk : n;
    }
    pool_run(run_list, jobs, sizeof(list_job_t), parts);
    if (starts != small_starts) free(starts);
    return 0;
}
