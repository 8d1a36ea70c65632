/* Native CPU kernel of a bias gradient's sum over rows (launched by rows_native.py):
 * out[j] = float(sum over i of double(a[i][j])) for a (R, C) float32 row-major, the
 * float64 sum of each column started at +0.0 and taken over the rows in order, then
 * rounded once to float32. That is the order of numpy's
 * np.add.reduce(a, axis=0, dtype=np.float64) for C >= 2 (rows_native.py says why),
 * so the bits are numpy's. Each column's order is fixed: the columns are vectorized
 * (8 doubles a vector, 64 columns a pass down the rows) and split in contiguous
 * ranges of 64 over up to `threads` threads (native_pool.h), so results do not
 * depend on the count. */
#include <stdint.h>

#include "native_pool.h"

#define ROWS_BLOCK 64               /* columns a pass down the rows */

typedef double vd8 __attribute__((vector_size(64)));
typedef float vf8u __attribute__((vector_size(32), aligned(4)));

typedef struct {
    const float *a;
    float *out;
    int64_t rows, cols, begin, end;  /* the job's columns [begin, end) */
} sum_job_t;

static void *sum_columns(void *arg)
{
    const sum_job_t *j = arg;
    int64_t c = j->begin;
    for (; c + ROWS_BLOCK <= j->end; c += ROWS_BLOCK) {
        vd8 acc[ROWS_BLOCK / 8] = {{0}};
        for (int64_t i = 0; i < j->rows; i++) {
            const float *row = j->a + i * j->cols + c;
            for (int v = 0; v < ROWS_BLOCK / 8; v++)
                acc[v] += __builtin_convertvector(*(const vf8u *)(row + 8 * v), vd8);
        }
        for (int v = 0; v < ROWS_BLOCK / 8; v++)
            for (int l = 0; l < 8; l++) j->out[c + 8 * v + l] = (float)acc[v][l];
    }
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
