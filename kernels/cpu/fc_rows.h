/* ---- Products of a few rows on a weight as it lies (fc_rows_f32, fc_rows_group_f32) -
 * Included by fc_native.c. out (M, N) = act(x (M, K) @ w + bias + residual) for small M
 * on w (K, N) row-major and unpacked (a weight the optimizer changes: nothing to pack
 * once). A generated token's product reads its whole weight for one row of x, so its
 * time is the weight's trip from memory. The rows of w are split in FC_ROWS_PARTS fixed
 * contiguous blocks, each summed by one job over all the columns: on two threads each
 * core streams half of every weight, the same half token after token (which that
 * core's cache may then keep; a split by columns interleaves the halves' lines, and
 * measured slower). Each output is its blocks' sums (each over k in order) added in
 * order, then + bias, then + residual, then relu: the bits of the product alone
 * followed by the bias add and the residual add, whatever the threads. A group is
 * several products of one x (a layer's q, k and v) in one call: each job sums its block
 * of every weight in turn, so the group costs one hand-out to the threads. out must
 * not overlap x or the residual. */
#define FC_ROWS_PARTS 2             /* blocks of w's rows (the sums below add two), from
                                       FC_ROWS_MIN_K rows */
#define FC_ROWS_MIN_K 64
#define FC_ROWS_VECTORS 8           /* vectors of sums one pass down a block keeps */

typedef struct {
    const float *x, *w;
    float *sums[FC_ROWS_PARTS];            /* each block's (M, N) sums */
    int64_t m, k, n, parts;
} fc_rows_t;

typedef struct {
    const fc_rows_t *a;                     /* the group's products */
    int64_t count, part;
} fc_rows_job_t;

/* Row i's sums over w's rows q0 .. q1 of V vectors of columns from c0 (the last one
 * `last` wide) into `to`. */
static inline __attribute__((always_inline)) void rows_sums(const fc_rows_t *a, int64_t i,
                                                            int64_t q0, int64_t q1,
                                                            int64_t c0, const int V,
                                                            int64_t last, float *to)
{
    const float *xi = a->x + i * a->k, *wq = a->w + q0 * a->n + c0;
    vf s[FC_ROWS_VECTORS] = {{0}};
    if (last == VL) {
        for (int64_t q = q0; q < q1; q++, wq += a->n) {
            float xq = xi[q];
#pragma GCC unroll 8
            for (int v = 0; v < V; v++) s[v] += xq * vf_load(wq + v * VL);
        }
    } else {                                /* V is 1: a vector's first `last` columns */
        for (int64_t q = q0; q < q1; q++, wq += a->n) s[0] += xi[q] * vf_load_part(wq, last);
    }
#pragma GCC unroll 8
    for (int v = 0; v < V; v++) {
        if (v == V - 1 && last < VL) vf_store_part(to + c0 + v * VL, s[v], last);
        else vf_store(to + c0 + v * VL, s[v]);
    }
}

static void rows_block(const fc_rows_t *a, int64_t part)
{
    int64_t q0, q1;
    pool_share(a->k, a->parts, part, &q0, &q1);
    for (int64_t i = 0; i < a->m; i++) {
        float *to = a->sums[part] + i * a->n;
        int64_t c = 0, full = a->n / VL * VL;
        for (; c + FC_ROWS_VECTORS * VL <= full; c += FC_ROWS_VECTORS * VL)
            rows_sums(a, i, q0, q1, c, FC_ROWS_VECTORS, VL, to);
        for (; c + 4 * VL <= full; c += 4 * VL) rows_sums(a, i, q0, q1, c, 4, VL, to);
        for (; c + 2 * VL <= full; c += 2 * VL) rows_sums(a, i, q0, q1, c, 2, VL, to);
        for (; c < full; c += VL) rows_sums(a, i, q0, q1, c, 1, VL, to);
        if (c < a->n) rows_sums(a, i, q0, q1, c, 1, a->n - c, to);
    }
}

static void *rows_job(void *arg)
{
    const fc_rows_job_t *job = arg;
    for (int64_t g = 0; g < job->count; g++) rows_block(&job->a[g], job->part);
    return NULL;
}

/* outs[g] (M, ns[g]) = act(x (M, K) @ ws[g] (K, ns[g]) + biases[g] + residuals[g]) for
 * g < count (at most FC_ROWS_GROUP), on the weights as they lie: biases and residuals
 * NULL or arrays of count pointers, each NULL or (ns[g],) / (M, ns[g]); relu 0 or 1;
 * the blocks on up to `threads` threads. M, K, every ns[g] >= 1. Returns 0, or 1 when
 * the sums of the second blocks could not be allocated (outs untouched), 2 for a count
 * out of range. */
#define FC_ROWS_GROUP 8
int fc_rows_group_f32(const float *x, const float *const *ws, const float *const *biases,
                      const float *const *residuals, float *const *outs, const int64_t *ns,
                      int64_t count, int64_t m, int64_t k, int64_t relu, int64_t threads)
{
    if (count < 1 || count > FC_ROWS_GROUP) return 2;
    fc_rows_t a[FC_ROWS_GROUP];
    const int64_t parts = k >= FC_ROWS_MIN_K ? FC_ROWS_PARTS : 1;
    int64_t room = 0;
    for (int64_t g = 0; g < count; g++) room += m * ns[g];
    float *more = parts > 1 ? malloc((size_t)room * sizeof(float)) : NULL;
    if (parts > 1 && more == NULL) return 1;
    for (int64_t g = 0, at = 0; g < count; at += m * ns[g], g++)
        a[g] = (fc_rows_t){.x = x, .w = ws[g], .sums = {outs[g], more ? more + at : NULL},
                           .m = m, .k = k, .n = ns[g], .parts = parts};
    fc_rows_job_t jobs[FC_ROWS_PARTS];
    for (int64_t p = 0; p < parts; p++) jobs[p] = (fc_rows_job_t){a, count, p};
    if (threads >= parts) {
        pool_run(rows_job, jobs, sizeof(fc_rows_job_t), parts);
    } else {
        for (int64_t p = 0; p < parts; p++) rows_job(&jobs[p]);
    }
    for (int64_t g = 0; g < count; g++) {  /* the blocks' sums added, the bias, the residual,
                                              relu */
        const int64_t n = ns[g];
        const float *bias = biases != NULL ? biases[g] : NULL;
        const float *residual = residuals != NULL ? residuals[g] : NULL;
        for (int64_t i = 0; i < m; i++) {
            float *restrict to = outs[g] + i * n;
            const float *restrict sum2 = parts > 1 ? a[g].sums[1] + i * n : NULL;
            const float *restrict add = residual != NULL ? residual + i * n : NULL;
            for (int64_t j = 0; j < n; j++) {
                float v = sum2 != NULL ? to[j] + sum2[j] : to[j];
                if (bias != NULL) v += bias[j];
                if (add != NULL) v += add[j];
                to[j] = relu && v <= 0 ? 0.0f : v;  /* as max(v, 0): NaN stays, -0 is 0 */
            }
        }
    }
    free(more);
    return 0;
}

/* fc_rows_group_f32 of one product: out (M, N) = act(x @ w + bias + residual), bias
 * (N,) or NULL, residual (M, N) or NULL. */
int fc_rows_f32(const float *x, const float *w, const float *bias, const float *residual,
                float *out, int64_t m, int64_t k, int64_t n, int64_t relu, int64_t threads)
{
    return fc_rows_group_f32(x, &w, &bias, &residual, &out, &n, 1, m, k, relu, threads);
}

/* fc_rows_f32 and fc_rows_group_f32 with their arguments in one int64 array (a prepared
 * call's: one foreign call converts one pointer, not ten values, for a product of a few
 * microseconds). ints: x, w, bias, residual, out, m, k, n, relu, threads; for the group
 * x, ws, biases, residuals, outs, ns, count, m, k, relu, threads (the pointers as
 * integers). */
int fc_rows_f32_packed(const int64_t *ints)
{
    return fc_rows_f32((const float *)ints[0], (const float *)ints[1], (const float *)ints[2],
                       (const float *)ints[3], (float *)ints[4], ints[5], ints[6], ints[7],
                       ints[8], ints[9]);
}

int fc_rows_group_f32_packed(const int64_t *ints)
{
    return fc_rows_group_f32((const float *)ints[0], (const float *const *)ints[1],
                             (const float *const *)ints[2], (const float *const *)ints[3],
                             (float *const *)ints[4], (const int64_t *)ints[5], ints[6],
                             ints[7], ints[8], ints[9], ints[10]);
}
