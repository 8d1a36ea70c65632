/* Native CPU kernels of rows: a bias gradient's sum over rows, the adds of two arrays
 * or of a bias to each row, a sum of squares (a gradient norm's) and a product by a
 * scalar (launched by rows_native.py).
 *
 * The sum over rows: out[j] = float(sum over i of double(a[i][j])) for a (R, C) float32
 * row-major, the float64 sum of each column started at +0.0 and taken over the rows in
 * order, then rounded once to float32. That is the order of numpy's
 * np.add.reduce(a, axis=0, dtype=np.float64) for C >= 2 (rows_native.py says why),
 * so the bits are numpy's. Each column's order is fixed: the columns are vectorized
 * (8 doubles a vector, 128 columns a pass down the rows where a thread's range has
 * them, else 64) and split in contiguous ranges of 64 over up to `threads` threads
 * (native_pool.h), so results do not depend on the count.
 *
 * The adds: out = a + b (the same number of values) and out[i][j] = x[i][j] + bias[j],
 * float32 or float64, each value one IEEE add, as numpy's (the bits are numpy's, on
 * any number of threads); out may be a or x (in place). Contiguous ranges of values
 * (of rows, for the bias) go to up to `threads` threads; so do the sum of squares's
 * and the product's (see theirs below). */
#include <stdint.h>

#include "native_pool.h"

#define ROWS_BLOCK 64               /* columns the threads' ranges are made of */
#define ROWS_WIDE 128               /* columns a pass down the rows, where a range has them */

typedef double vd8 __attribute__((vector_size(64)));
typedef float vf8u __attribute__((vector_size(32), aligned(4)));

typedef struct {
    const float *a;
    float *out;
    int64_t rows, cols, begin, end;  /* the job's columns [begin, end) */
} sum_job_t;

/* out[c .. c + width) = the columns' sums down all the rows (width: a multiple of 8 up to
 * ROWS_WIDE, kept in registers). */
static inline __attribute__((always_inline)) void sum_block(const sum_job_t *j, int64_t c,
                                                            int width)
{
    vd8 acc[ROWS_WIDE / 8] = {{0}};
    for (int64_t i = 0; i < j->rows; i++) {
        const float *row = j->a + i * j->cols + c;
        for (int v = 0; v < width / 8; v++)
            acc[v] += __builtin_convertvector(*(const vf8u *)(row + 8 * v), vd8);
    }
    for (int v = 0; v < width / 8; v++)
        for (int l = 0; l < 8; l++) j->out[c + 8 * v + l] = (float)acc[v][l];
}

static void *sum_columns(void *arg)
{
    const sum_job_t *j = arg;
    int64_t c = j->begin;
    for (; c + ROWS_WIDE <= j->end; c += ROWS_WIDE) sum_block(j, c, ROWS_WIDE);
    for (; c + ROWS_BLOCK <= j->end; c += ROWS_BLOCK) sum_block(j, c, ROWS_BLOCK);
    for (; c < j->end; c++) {          /* the last columns, one at a time */
        double acc = 0.0;
        for (int64_t i = 0; i < j->rows; i++) acc += (double)j->a[i * j->cols + c];
        j->out[c] = (float)acc;
    }
    return NULL;
}

/* out[j] (C floats) = the rounded float64 sum over the R rows of column j of a, as
 * the file's comment says, on up to `threads` threads. R, C >= 0. Returns 0. */
int rows_sum_f32(const float *a, float *out, int64_t rows, int64_t cols, int threads)
{
    sum_job_t jobs[POOL_MAX_THREADS];
    int64_t blocks = (cols + ROWS_BLOCK - 1) / ROWS_BLOCK;
    int64_t parts = pool_parts(threads, blocks);
    for (int64_t t = 0; t < parts; t++) {
        int64_t b0, b1;
        pool_share(blocks, parts, t, &b0, &b1);
        jobs[t] = (sum_job_t){a, out, rows, cols, b0 * ROWS_BLOCK < cols ? b0 * ROWS_BLOCK : cols,
                              b1 * ROWS_BLOCK < cols ? b1 * ROWS_BLOCK : cols};
    }
    pool_run(sum_columns, jobs, sizeof(sum_job_t), parts);
    return 0;
}

/* Each value depends only on the same value of the inputs, also in place: IVDEP spares
 * the compiler the overlap checks (as in optim_native.c). */
#if defined(__GNUC__) && !defined(__clang__)
#define IVDEP _Pragma("GCC ivdep")
#else
#define IVDEP
#endif

typedef struct {
    const void *a, *b;
    void *out;
    int64_t cols, begin, end;        /* the job's values (rows, with a bias) [begin, end) */
    int bias, f64;
} add_job_t;

#define ADD_RANGE(T)                                                                     \
    static void add_##T(const add_job_t *j)                                             \
    {                                                                                   \
        const T *a = j->a, *b = j->b;            /* locals: a store may alias *j */   \
        T *out = j->out;                                                                \
        const int64_t begin = j->begin, end = j->end, cols = j->cols;                   \
        if (!j->bias) {                                                                 \
            IVDEP                                                                       \
            for (int64_t i = begin; i < end; i++) out[i] = a[i] + b[i];                 \
            return;                                                                     \
        }                                                                               \
        for (int64_t r = begin; r < end; r++) {                                         \
            const T *row = a + r * cols;                                                \
            T *to = out + r * cols;                                                     \
            IVDEP                                                                       \
            for (int64_t c = 0; c < cols; c++) to[c] = row[c] + b[c];                   \
        }                                                                               \
    }

ADD_RANGE(float)
ADD_RANGE(double)

static void *add_job(void *arg)
{
    const add_job_t *j = arg;
    if (j->f64)
        add_double(j);
    else
        add_float(j);
    return NULL;
}

/* out = a + b over n values (bias 0), or out[i][j] = a[i][j] + b[j] over n rows of
 * `cols` values (bias 1); float64 where f64, else float32; on up to `threads` threads.
 * Returns 0. */
int rows_add(int f64, int bias, const void *a, const void *b, void *out, int64_t n,
             int64_t cols, int threads)
{
    add_job_t jobs[POOL_MAX_THREADS];
    const int64_t parts = pool_parts(threads, n);
    for (int64_t t = 0; t < parts; t++) {
        int64_t begin, end;
        pool_share(n, parts, t, &begin, &end);
        jobs[t] = (add_job_t){a, b, out, cols, begin, end, bias, f64};
    }
    pool_run(add_job, jobs, sizeof(add_job_t), parts);
    return 0;
}

typedef struct {
    const void *a;
    int64_t begin, end;              /* the job's values [begin, end) */
    int f64;
    double sum;
} squares_job_t;

typedef double vd8u __attribute__((vector_size(64), aligned(8)));

/* 8 values of a as doubles */
static inline vd8 eight_float(const float *a) { return __builtin_convertvector(*(const vf8u *)a, vd8); }
static inline vd8 eight_double(const double *a) { return *(const vd8u *)a; }

#define SQUARES_RANGE(T)                                                                 \
    static double squares_##T(const T *a, int64_t begin, int64_t end)                  \
    {                                                                                   \
        vd8 acc[4] = {{0}};                                                             \
        int64_t i = begin;                                                              \
        for (; i + 32 <= end; i += 32)                                                  \
            for (int v = 0; v < 4; v++) {                                               \
                const vd8 d = eight_##T(a + i + 8 * v);                                 \
                acc[v] += d * d;                                                        \
            }                                                                           \
        const vd8 both = (acc[0] + acc[1]) + (acc[2] + acc[3]);                         \
        double sum = 0.0;                                                               \
        for (int l = 0; l < 8; l++) sum += both[l];                                     \
        for (; i < end; i++) sum += (double)a[i] * (double)a[i];                        \
        return sum;                                                                     \
    }

SQUARES_RANGE(float)
SQUARES_RANGE(double)

static void *squares_job(void *arg)
{
    squares_job_t *j = arg;
    j->sum = j->f64 ? squares_double(j->a, j->begin, j->end)
                    : squares_float(j->a, j->begin, j->end);
    return NULL;
}

/* The float64 sum of the squares of n values (float64 where f64, else float32, each
 * squared in float64): contiguous ranges on up to `threads` threads, each summed in
 * vectors of 8 doubles, 4 at a time, then the ranges' sums added in order (the same
 * result for a given number of threads). */
double rows_sum_squares(int f64, const void *a, int64_t n, int threads)
{
    squares_job_t jobs[POOL_MAX_THREADS];
    const int64_t parts = pool_parts(threads, n);
    for (int64_t t = 0; t < parts; t++) {
        int64_t begin, end;
        pool_share(n, parts, t, &begin, &end);
        jobs[t] = (squares_job_t){a, begin, end, f64, 0.0};
    }
    pool_run(squares_job, jobs, sizeof(squares_job_t), parts);
    double sum = 0.0;
    for (int64_t t = 0; t < parts; t++) sum += jobs[t].sum;
    return sum;
}

typedef struct {
    const void *x;
    void *out;
    double s;
    int64_t begin, end;              /* the job's values [begin, end) */
    int f64;
} scale_job_t;

/* out = x * s, the product p taken in double and rounded to T, +0.0 where p is 0: the bits
 * of numpy's x.astype(float64) * s + 0.0 rounded to T (adding 0.0 to a nonzero double
 * changes nothing, to a zero makes it +0.0). No add, so no multiply-add to fuse; 8 values
 * a vector (a zero's sign bit cleared by a mask), the last ones one at a time. */
typedef int64_t vl8 __attribute__((vector_size(64)));
typedef float vf8 __attribute__((vector_size(32)));

static inline vd8 nonzero_or_plus(vd8 p) { return (vd8)((vl8)p & ~(vl8)(p == 0.0)); }
static inline void put8_float(float *to, vd8 p) { *(vf8u *)to = __builtin_convertvector(p, vf8); }
static inline void put8_double(double *to, vd8 p) { *(vd8u *)to = p; }

#define SCALE_RANGE(T)                                                                   \
    static void scale_##T(const scale_job_t *j)                                         \
    {                                                                                   \
        const T *x = j->x;                       /* locals: a store may alias *j */     \
        T *out = j->out;                                                                \
        const double s = j->s;                                                          \
        const int64_t end = j->end;                                                     \
        int64_t i = j->begin;                                                           \
        for (; i + 8 <= end; i += 8) put8_##T(out + i, nonzero_or_plus(eight_##T(x + i) * s)); \
        for (; i < end; i++) {                                                          \
            const double p = (double)x[i] * s;                                          \
            out[i] = p == 0.0 ? (T)0 : (T)p;                                            \
        }                                                                               \
    }

SCALE_RANGE(float)
SCALE_RANGE(double)

static void *scale_job(void *arg)
{
    const scale_job_t *j = arg;
    if (j->f64)
        scale_double(j);
    else
        scale_float(j);
    return NULL;
}

/* out[i] = x[i] * s over n values as SCALE_RANGE says (float64 where f64, else float32;
 * out may be x), on up to `threads` threads. Returns 0. */
int rows_scale(int f64, const void *x, void *out, int64_t n, double s, int threads)
{
    scale_job_t jobs[POOL_MAX_THREADS];
    const int64_t parts = pool_parts(threads, n);
    for (int64_t t = 0; t < parts; t++) {
        int64_t begin, end;
        pool_share(n, parts, t, &begin, &end);
        jobs[t] = (scale_job_t){x, out, s, begin, end, f64};
    }
    pool_run(scale_job, jobs, sizeof(scale_job_t), parts);
    return 0;
}
