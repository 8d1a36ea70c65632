/* Native CPU kernels of rows: a bias gradient's sum over rows, the adds of two arrays
 * or of a bias to each row, a sum of squares (a gradient norm's) and a product by a
 * scalar (launched by rows_native.py).
 *
 * The sum over rows: out[j] = float(sum over i of double(a[i][j])) for a (R, C) float32
 * row-major, the float64 sum of each column started at +0.0 and taken over the rows in
 * order, then rounded once to float32. That is the order of numpy's
 * np.add.reduce(a, axis=0, dtype=np.float64) for C >= 2 (rows_native.py says why),
 * so the bits are numpy's. Each column's order is fixed: the columns are vectorized
 * (native_simd.h's VD doubles a vector; passes down the rows of ROWS_WIDE columns where
 * a thread's range has them, then of half as many, then of one vector, then of one
 * column) and split in contiguous ranges of 64 over up to `threads` threads
 * (native_pool.h), so results do not depend on the count.
 *
 * The adds: out = a + b (the same number of values), out[i][j] = x[i][j] + bias[j] and
 * out[i][j] = x[i][j] + bias[i % channels] (a channel's bias over an NCHW plane),
 * float32 or float64, each value one IEEE add, as numpy's (the bits are numpy's, on
 * any number of threads); out may be a or x (in place). Contiguous ranges of values
 * (of rows, for a bias) go to up to `threads` threads; so do the sum of squares's
 * and the product's (see theirs below). */
#include <stdint.h>

#include "native_pool.h"
#include "native_simd.h"

#define ROWS_BLOCK 64               /* columns the threads' ranges are made of */
#if VD == 8                         /* columns a pass down the rows, where a range has them */
#define ROWS_WIDE 128               /* 16 of AVX-512's 32 registers */
#else
#define ROWS_WIDE 32                /* 8 of AVX2's 16 (16 would leave none for the loads) */
#endif

typedef struct {
    const float *a;
    float *out;
    int64_t rows, cols, begin, end;  /* the job's columns [begin, end) */
} sum_job_t;

/* out[c .. c + width) = the columns' sums down all the rows (width: a multiple of VD up
 * to ROWS_WIDE, kept in registers). */
static inline __attribute__((always_inline)) void sum_block(const sum_job_t *j, int64_t c,
                                                            int width)
{
    vd acc[ROWS_WIDE / VD] = {{0}};
    for (int64_t i = 0; i < j->rows; i++) {
        const float *row = j->a + i * j->cols + c;
        for (int v = 0; v < width / VD; v++) acc[v] += vd_of_floats(row + VD * v);
    }
    for (int v = 0; v < width / VD; v++)
        for (int l = 0; l < VD; l++) j->out[c + VD * v + l] = (float)acc[v][l];
}

static void *sum_columns(void *arg)
{
    const sum_job_t *j = arg;
    int64_t c = j->begin;
    for (; c + ROWS_WIDE <= j->end; c += ROWS_WIDE) sum_block(j, c, ROWS_WIDE);
    for (; c + ROWS_WIDE / 2 <= j->end; c += ROWS_WIDE / 2) sum_block(j, c, ROWS_WIDE / 2);
    for (; c + VD <= j->end; c += VD) sum_block(j, c, VD);
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
    int64_t channels;                /* a row's bias: b[row % channels] (bias 2) */
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
        if (j->bias == 2) {                                                             \
            const int64_t channels = j->channels;                                       \
            for (int64_t r = begin; r < end; r++) {                                     \
                const T *row = a + r * cols;                                            \
                const T v = b[r % channels];                                            \
                T *to = out + r * cols;                                                 \
                IVDEP                                                                   \
                for (int64_t c = 0; c < cols; c++) to[c] = row[c] + v;                  \
            }                                                                           \
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

/* out = a + b over n values (bias 0), or out[i][j] = a[i][j] + b[j] (bias 1) or + b[i %
 * channels] (bias 2) over n rows of `cols` values; float64 where f64, else float32; on
 * up to `threads` threads. Returns 0. */
int rows_add(int f64, int bias, const void *a, const void *b, void *out, int64_t n,
             int64_t cols, int64_t channels, int threads)
{
    add_job_t jobs[POOL_MAX_THREADS];
    const int64_t parts = pool_parts(threads, n);
    for (int64_t t = 0; t < parts; t++) {
        int64_t begin, end;
        pool_share(n, parts, t, &begin, &end);
        jobs[t] = (add_job_t){a, b, out, cols, begin, end, channels, bias, f64};
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

/* VD values of a as doubles */
static inline vd some_float(const float *a) { return vd_of_floats(a); }
static inline vd some_double(const double *a) { return *(const vdu *)a; }

/* Four sums of 8 lanes each, a lane's value at a + i + 8 v + l (v < 4, l < 8), held as
 * 32 / VD vectors of VD lanes (the same sums with AVX2's 4 doubles as AVX-512's 8). */
#define SQUARES_RANGE(T)                                                                 \
    static double squares_##T(const T *a, int64_t begin, int64_t end)                  \
    {                                                                                   \
        enum { H = 8 / VD };                                                            \
        vd acc[4 * H] = {{0}};                                                          \
        int64_t i = begin;                                                              \
        for (; i + 32 <= end; i += 32)                                                  \
            for (int v = 0; v < 4 * H; v++) {                                           \
                const vd d = some_##T(a + i + VD * v);                                  \
                acc[v] += d * d;                                                        \
            }                                                                           \
        double sum = 0.0;                                                               \
        for (int h = 0; h < H; h++) {                                                   \
            const vd both = (acc[h] + acc[H + h]) + (acc[2 * H + h] + acc[3 * H + h]);  \
            for (int l = 0; l < VD; l++) sum += both[l];                                \
        }                                                                               \
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
 * squared in float64): contiguous ranges on up to `threads` threads, each summed as
 * SQUARES_RANGE says, then the ranges' sums added in order (the same
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
 * changes nothing, to a zero makes it +0.0). No add, so no multiply-add to fuse; VD values
 * a vector (a zero's sign bit cleared by a mask), the last ones one at a time. */
typedef int64_t vdl __attribute__((vector_size(VD * 8)));

static inline vd nonzero_or_plus(vd p) { return (vd)((vdl)p & ~(vdl)(p == 0.0)); }
static inline void put_float(float *to, vd p) { *(vfhu *)to = __builtin_convertvector(p, vfh); }
static inline void put_double(double *to, vd p) { *(vdu *)to = p; }

#define SCALE_RANGE(T)                                                                   \
    static void scale_##T(const scale_job_t *j)                                         \
    {                                                                                   \
        const T *x = j->x;                       /* locals: a store may alias *j */     \
        T *out = j->out;                                                                \
        const double s = j->s;                                                          \
        const int64_t end = j->end;                                                     \
        int64_t i = j->begin;                                                           \
        for (; i + VD <= end; i += VD) put_##T(out + i, nonzero_or_plus(some_##T(x + i) * s)); \
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
