/* Native CPU kernel of fused_fc (fc_native.py holds the contract): float32
 * out = act(x @ w + bias), x (M, K) and w (K, N) row-major, act = relu or the
 * identity, with w packed once. The few-rows kernels on unpacked weights (a generated
 * token's products) are fc_rows.h's, those of a few columns on a packed weight (a
 * classifier's last product) fc_cols.h's, training's products on weights packed block
 * by block as they are used fc_train.h's, and those for an x mostly of zeros (a relu's
 * output, on a packed weight or in training) fc_sparse.h's, all included at the end.
 *
 * A packed weight holds ceil(N / FC_NR) panels, each the K rows of FC_NR
 * consecutive columns (zeros past column N): two vectors of native_simd.h's VL
 * floats, so the values a step of the inner loop reads are one 64-byte line (AVX2)
 * or two (AVX-512). x's columns fall into blocks of at most
 * FC_KC (of equal size); a register tile is FC_MR rows of x times a panel's rows of
 * one block: FC_MR x FC_NR sums, two vectors per row, while the panel's block stays
 * in cache for the next tile's rows. Tiles of FC_MR rows cover x's rows, and the
 * last ones have FC_MR4 rows where that wastes fewer (128 rows: 20 of 6 and 2 of 4,
 * not 22 of 6). With FC_PACK_PANELS panels or more, x is first packed into blocks of
 * a tile's rows, the values of a column side by side (its rows are read once per
 * panel, and rows of a power-of-two length would fall into the same lines of L1);
 * with fewer, the tiles read x's rows where they are.
 *
 * Threads take units of work (a few panels, fewer as fewer are left so that the
 * threads finish together; with few panels, a panel and a chunk of the rows) from
 * a shared counter. Each output is summed by one thread in one
 * order, so the results do not depend on the number of threads. The bias and relu
 * are added to a tile as it is written after its last block of x's columns. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "native_pool.h"
#include "native_simd.h"

#define FC_MR 6          /* rows of x per register tile */
#define FC_MR4 4         /* rows of x per register tile of the last rows, where fewer */
#define FC_NR (2 * VL)   /* columns of w per panel and register tile (two vectors) */
#define FC_KC 512        /* at most this many columns of x (rows of w) per block */
#define FC_GROUP 8       /* at most this many panels a unit of work */
#define FC_PACK_PANELS 8 /* x is packed for products of at least this many panels */

/* Keeps a step's two vectors of the weight in registers: without it, gcc reads them
 * from memory again for each row of a tile of FC_MR4 rows. */
#if defined(__AVX512F__)
#define FC_IN_REGISTERS(a, b) __asm__("" : "+v"(a), "+v"(b))
#elif defined(__AVX__)
#define FC_IN_REGISTERS(a, b) __asm__("" : "+x"(a), "+x"(b))
#else
#define FC_IN_REGISTERS(a, b) ((void)0)
#endif

typedef struct {
    const float *x, *wp, *bias;
    float *out, *xp;                       /* xp: x packed, or NULL */
    const float *w;                        /* fc_train.h: the weight unpacked, else NULL */
    int64_t xt, wt;                        /* x (K, M) and w (N, K) read transposed */
    int64_t m, k, n, relu, panels, threads;
    int64_t tiles, tiles6, mp;             /* row tiles, those of FC_MR rows; their rows */
    int64_t kc, group, chunks;             /* columns a block; a unit: at most group
                                              panels, or a panel by 1 / chunks of the rows
                                              (fc_sparse.h: a group of its panels by 1 /
                                              chunks of the rows) */
    int64_t next_rows, packed_rows, next_unit, next_panel;     /* the shared counters */
    const uint64_t *masks;                 /* fc_sparse.h: x's nonzero values, words a row */
    int64_t words;
} fc_t;

typedef struct {
    fc_t *a;
    float *blocks;      /* fc_train.h: this thread's two packed blocks of the weight */
} fc_job_t;

int64_t fc_packed_size(int64_t k, int64_t n)
{
    return (n + FC_NR - 1) / FC_NR * k * FC_NR;
}

/* w (K, N) into wp (fc_packed_size(K, N) floats). */
void fc_pack_weight_f32(const float *w, int64_t k, int64_t n, float *wp)
{
    for (int64_t j = 0; j * FC_NR < n; j++) {
        int64_t n0 = j * FC_NR, cols = n - n0 < FC_NR ? n - n0 : FC_NR;
        float *panel = wp + j * k * FC_NR;
        for (int64_t r = 0; r < k; r++) {
            memcpy(panel + r * FC_NR, w + r * n + n0, (size_t)cols * sizeof(float));
            memset(panel + r * FC_NR + cols, 0, (size_t)(FC_NR - cols) * sizeof(float));
        }
    }
}

/* The first row of row tile i and its number of rows (FC_MR or FC_MR4). */
static inline int64_t tile_row(const fc_t *a, int64_t i)
{
    return i < a->tiles6 ? i * FC_MR : a->tiles6 * FC_MR + (i - a->tiles6) * FC_MR4;
}

/* The rows of tile i of x (of x's transpose where a->xt), every block of columns,
 * into xp: in each block, the tile's values of a column side by side; rows past M
 * repeat row M - 1. */
static void pack_rows(const fc_t *a, int64_t i)
{
    int64_t row0 = tile_row(a, i), rows = i < a->tiles6 ? FC_MR : FC_MR4;
    int64_t at[FC_MR], step = a->xt ? a->m : 1;     /* row r's column q: at[r] + q step */
    for (int64_t r = 0; r < rows; r++) {
        int64_t row = row0 + r < a->m ? row0 + r : a->m - 1;
        at[r] = a->xt ? row : row * a->k;
    }
    for (int64_t p0 = 0; p0 < a->k; p0 += a->kc) {
        int64_t kc = a->k - p0 < a->kc ? a->k - p0 : a->kc;
        float *dst = a->xp + p0 * a->mp + row0 * kc;
        for (int64_t q = p0; q < p0 + kc; q++)
            for (int64_t r = 0; r < rows; r++) *dst++ = a->x[at[r] + q * step];
    }
}

static inline vf finish(vf v, const float *to, int first, const float *bias, int relu)
{
    if (!first) v += vf_load(to);
    if (bias != NULL) {
        v += vf_load(bias);
        if (relu) v = vf_relu(v);
    }
    return v;
}

/* The sums of the tile of ROWS rows from row0 (a constant: FC_MR or FC_MR4) by a
 * panel's block of columns p0 .. p0 + kc, whose kc rows of FC_NR values start at wb,
 * into acc. */
static inline __attribute__((always_inline)) void tile_sums(const fc_t *a, const float *wb,
                                                            int64_t row0, int64_t p0,
                                                            int64_t kc, const int ROWS,
                                                            vf acc[FC_MR][2])
{
    vf c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0};
    vf c30 = {0}, c31 = {0}, c40 = {0}, c41 = {0}, c50 = {0}, c51 = {0};
#define FC_SUMS(STEP)                                                                  \
    for (int64_t q = 0, at = 0; q < kc; q++, at += (STEP), wb += FC_NR) {              \
        vf b0 = vf_load(wb), b1 = vf_load(wb + VL);                                    \
        FC_IN_REGISTERS(b0, b1);                                                        \
        c00 += x0[at] * b0; c01 += x0[at] * b1; c10 += x1[at] * b0; c11 += x1[at] * b1; \
        c20 += x2[at] * b0; c21 += x2[at] * b1; c30 += x3[at] * b0; c31 += x3[at] * b1; \
        if (ROWS > FC_MR4) {                                                            \
            c40 += x4[at] * b0; c41 += x4[at] * b1; c50 += x5[at] * b0; c51 += x5[at] * b1; \
        }                                                                               \
    }
    if (a->xp != NULL) {                /* the block's ROWS values of a column side by side */
        const float *x0 = a->xp + p0 * a->mp + row0 * kc;
        const float *x1 = x0 + 1, *x2 = x0 + 2, *x3 = x0 + 3, *x4 = x0 + 4, *x5 = x0 + 5;
        FC_SUMS(ROWS)
    } else {                            /* x's rows; rows past M repeat row M - 1 */
        const float *row[FC_MR];
        for (int64_t r = 0; r < FC_MR; r++)
            row[r] = a->x + (row0 + r < a->m ? row0 + r : a->m - 1) * a->k + p0;
        const float *x0 = row[0], *x1 = row[1], *x2 = row[2], *x3 = row[3], *x4 = row[4];
        const float *x5 = row[5];
        FC_SUMS(1)
    }
#undef FC_SUMS
    vf sums[FC_MR][2] = {{c00, c01}, {c10, c11}, {c20, c21}, {c30, c31}, {c40, c41},
                         {c50, c51}};
    memcpy(acc, sums, sizeof(sums));
}

/* The sums acc of ROWS rows from row0 by panel j over a block of x's columns: added
 * to out (first: written), then (last) the bias and relu. Rows past M are dropped. */
static void write_sums(const fc_t *a, int64_t row0, int64_t rows, int64_t j, int first,
                       int last, vf acc[][2])
{
    if (rows > a->m - row0) rows = a->m - row0;
    int64_t n0 = j * FC_NR, cols = a->n - n0 < FC_NR ? a->n - n0 : FC_NR;
    const float *bias = NULL;       /* set on the last block only (zeros without one):
                                       finish() adds it and applies relu where set */
    float zeros[FC_NR] = {0}, edge_bias[FC_NR];
    if (last) bias = a->bias != NULL ? a->bias + n0 : zeros;
    if (cols == FC_NR) {
        for (int64_t r = 0; r < rows; r++) {
            float *to = a->out + (row0 + r) * a->n + n0;
            vf lo = finish(acc[r][0], to, first, bias, (int)a->relu);
            vf hi = finish(acc[r][1], to + VL, first, bias == NULL ? NULL : bias + VL,
                           (int)a->relu);
            vf_store(to, lo);
            vf_store(to + VL, hi);
        }
        return;
    }
    if (bias != NULL) {                 /* a panel past column N: through a buffer */
        memcpy(edge_bias, bias, (size_t)cols * sizeof(float));
        memset(edge_bias + cols, 0, (size_t)(FC_NR - cols) * sizeof(float));
        bias = edge_bias;
    }
    for (int64_t r = 0; r < rows; r++) {
        float *to = a->out + (row0 + r) * a->n + n0, row[FC_NR] = {0};
        memcpy(row, to, (size_t)cols * sizeof(float));
        vf_store(row, finish(acc[r][0], row, first, bias, (int)a->relu));
        vf_store(row + VL, finish(acc[r][1], row + VL, first,
                                  bias == NULL ? NULL : bias + VL, (int)a->relu));
        memcpy(to, row, (size_t)cols * sizeof(float));
    }
}

/* Row tile i by panel j over the block of columns p0 .. p0 + kc, the panel's block
 * at wb (write_sums). */
static void tile(const fc_t *a, const float *wb, int64_t i, int64_t j, int64_t p0,
                 int64_t kc)
{
    vf acc[FC_MR][2];
    int64_t row0 = tile_row(a, i), rows = i < a->tiles6 ? FC_MR : FC_MR4;
    if (rows == FC_MR)
        tile_sums(a, wb, row0, p0, kc, FC_MR, acc);
    else
        tile_sums(a, wb, row0, p0, kc, FC_MR4, acc);
    write_sums(a, row0, rows, j, p0 == 0, p0 + kc == a->k, acc);
}

static void run_train_unit(const fc_t *a, float *blocks, int64_t j0, int64_t j1, int64_t i0,
                           int64_t i1);

/* Row tiles i0 .. i1 by panels j0 .. j1, block by block of x's columns, so that the
 * unit's outputs stay in cache over the blocks; each panel's block read from the
 * packed weight, or (`blocks` not NULL) packed there from the unpacked one as it is
 * needed (fc_train.h). */
static void run_unit(const fc_t *a, float *blocks, int64_t j0, int64_t j1, int64_t i0,
                     int64_t i1)
{
    if (blocks != NULL) {
        run_train_unit(a, blocks, j0, j1, i0, i1);
        return;
    }
    for (int64_t p0 = 0; p0 < a->k; p0 += a->kc) {
        int64_t kc = a->k - p0 < a->kc ? a->k - p0 : a->kc;
        for (int64_t j = j0; j < j1; j++) {
            /* the unit's next block of the weight, a share of it during each tile */
            int64_t next_p0 = j + 1 < j1 ? p0 : p0 + kc, next_j = j + 1 < j1 ? j + 1 : j0;
            int64_t lines = next_p0 < a->k ? (a->k - next_p0 < a->kc ? a->k - next_p0
                                                                     : a->kc) : 0;
            const float *next = a->wp + (next_j * a->k + next_p0) * FC_NR;
            int64_t share = (lines + (i1 - i0) - 1) / (i1 - i0);
            for (int64_t i = i0; i < i1; i++) {
                for (int64_t l = (i - i0) * share; l < (i - i0 + 1) * share && l < lines; l++)
                    for (int64_t line = 0; line < FC_NR; line += 16)
                        __builtin_prefetch(next + l * FC_NR + line, 0, 2);
                tile(a, a->wp + (j * a->k + p0) * FC_NR, i, j, p0, kc);
            }
        }
    }
}

/* A thread packs row tiles of x while some are left and waits for the others'
 * (a thread that starts late finds them done), then takes units of work from a
 * shared counter, so that a thread slowed down (by another process on its core)
 * takes fewer: with few panels, a panel by a chunk of the rows; else all rows by a
 * share of the panels left (at most a group, at least one), so that the last units
 * are small and the threads finish close together. */
static void *multiply_job(void *arg)
{
    fc_t *a = ((fc_job_t *)arg)->a;
    float *blocks = ((fc_job_t *)arg)->blocks;
    int64_t u;
    if (a->xp != NULL) {        /* first the row tiles no thread took yet, then the wait */
        while ((u = __atomic_fetch_add(&a->next_rows, 1, __ATOMIC_RELAXED)) < a->tiles) {
            pack_rows(a, u);
            __atomic_fetch_add(&a->packed_rows, 1, __ATOMIC_RELEASE);
        }
        while (__atomic_load_n(&a->packed_rows, __ATOMIC_ACQUIRE) < a->tiles)
            ;
    }
    if (a->chunks > 1) {
        while ((u = __atomic_fetch_add(&a->next_unit, 1, __ATOMIC_RELAXED))
               < a->panels * a->chunks) {
            int64_t j = u / a->chunks, c = u % a->chunks;
            run_unit(a, blocks, j, j + 1, a->tiles * c / a->chunks,
                     a->tiles * (c + 1) / a->chunks);
        }
        return NULL;
    }
    int64_t j0 = __atomic_load_n(&a->next_panel, __ATOMIC_RELAXED), size;
    for (;;) {
        do {
            if (j0 >= a->panels) return NULL;
            size = (a->panels - j0) / (2 * a->threads);
            size = size < 1 ? 1 : size > a->group ? a->group : size;
        } while (!__atomic_compare_exchange_n(&a->next_panel, &j0, j0 + size, 0,
                                              __ATOMIC_RELAXED, __ATOMIC_RELAXED));
        run_unit(a, blocks, j0, j0 + size, 0, a->tiles);
        j0 = __atomic_load_n(&a->next_panel, __ATOMIC_RELAXED);
    }
}

/* a's row tiles, blocks of columns and units of work for x (a->m, a->k) by a->n
 * columns on at most `threads` threads (a->threads: at most one a tile). */
static void plan_units(fc_t *a, int64_t threads)
{
    int64_t m = a->m, k = a->k;
    a->panels = (a->n + FC_NR - 1) / FC_NR;
    a->threads = threads;
    a->chunks = 1;
    /* M = FC_MR q + r: the last r rows in a tile of FC_MR4 where r is 3 or 4 (or M
     * is), the last FC_MR + r in two where r is 1 or 2 */
    int64_t r = m % FC_MR, tiles4 = r == 0 || r == 5 ? 0 : r >= 3 || m < FC_MR ? 1 : 2;
    int64_t left = m - tiles4 * FC_MR4;
    a->tiles6 = left > 0 ? (left + FC_MR - 1) / FC_MR : 0;
    a->tiles = a->tiles6 + tiles4;
    a->mp = a->tiles6 * FC_MR + tiles4 * FC_MR4;
    int64_t parts = (k + FC_KC - 1) / FC_KC;
    a->kc = (k + parts - 1) / parts;
    a->group = a->panels / (4 * a->threads);    /* at first, four units a thread at least */
    if (a->group > FC_GROUP) a->group = FC_GROUP;
    if (a->group < 1) a->group = 1;
    if (a->panels < 4 * a->threads) a->chunks = (4 * a->threads + a->panels - 1) / a->panels;
    if (a->chunks > a->tiles) a->chunks = a->tiles;
    if (a->threads > a->tiles * a->panels) a->threads = a->tiles * a->panels;
    if (a->threads < 1) a->threads = 1;
    if (a->threads > POOL_MAX_THREADS) a->threads = POOL_MAX_THREADS;
}

/* out (M, N) = act(x (M, K) @ w + bias) with wp = fc_pack_weight_f32(w), bias
 * (N,) or NULL, relu 0 or 1, on `threads` threads (at most one a tile). M, N, K
 * >= 1. Returns 0, or 1 when the packed copy of x could not be allocated (out is
 * then untouched). */
int fc_forward_f32(const float *x, const float *wp, const float *bias, float *out, int64_t m,
                   int64_t k, int64_t n, int64_t relu, int64_t threads)
{
    fc_t a = {.x = x, .wp = wp, .bias = bias, .out = out, .m = m, .k = k, .n = n,
              .relu = relu};
    plan_units(&a, threads);
    fc_job_t jobs[POOL_MAX_THREADS];
    for (int64_t t = 0; t < a.threads; t++) jobs[t] = (fc_job_t){&a};
    if (a.panels >= FC_PACK_PANELS) {
        a.xp = malloc((size_t)(a.mp * k) * sizeof(float));
        if (a.xp == NULL) return 1;
    }
    pool_run(multiply_job, jobs, sizeof(fc_job_t), a.threads);
    free(a.xp);
    return 0;
}

#include "fc_rows.h"
#include "fc_cols.h"
#include "fc_train.h"
#include "fc_sparse.h"
