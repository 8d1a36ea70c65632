/* fc_sparse_f32, included by fc_native.c: fc_forward_f32's product, on the same packed
 * weight and with the same bits, for an x most of whose values are zeros (a relu's
 * output). A zero of x adds a zero (of either sign) to each sum it meets, which leaves
 * the sum as it is (a sum that starts at +0 never becomes -0), so a row's sums skip
 * x's zeros, where every value of the weight is finite (0 * inf is NaN): the caller's
 * promise. The sums follow fc_forward_f32's blocks of x's columns (each block's sums
 * start at zero and are then added to out), each in the order of the columns.
 *
 * A register tile is one row of x by FC_SP_PANELS panels: for each nonzero value of the
 * row in a part of a block (FC_SP_KC columns, found as a bit mask), its product with
 * the panels' row of the weight. A part of the panels (24 KiB) stays in L1 while up
 * to FC_SP_ROWS rows run on it, the next part being prefetched; sums that
 * do not end a block wait in `kept` for the next part. The masks of all of x's parts
 * are found once (find_masks), before any sums: every group of panels reads them.
 *
 * A one-row tile reads the weight once a nonzero value where fc_forward_f32's reads it
 * once per FC_MR rows: with more than FC_SP_DENSITY of nonzero values in rows sampled
 * from x, fc_forward_f32 runs instead (2-core AMD EPYC, 128x2048 by 2048 on 2 threads,
 * 43% nonzero: 1.5-1.6 times as fast as fc_forward_f32 with AVX-512 or AVX2; as fast at
 * about 70% nonzero).
 *
 * fc_train_sparse_f32 is fc_train_f32's product the same way (the bits of fc_train_f32,
 * which sums in fc_forward_f32's blocks and order): a thread packs a group's block of
 * the weight (fc_train.h's pack_block, either side transposed) into a buffer of its
 * own and checks its values, then runs the one-row tiles on it, or on every column where
 * a value is not finite; x^T (a weight gradient's A) is first copied as rows. */
#define FC_SP_PANELS (48 / VL) /* panels a register tile: 6 vectors of sums, their part
                                  of the weight 24 KiB (3 panels with AVX-512, 6 else) */
#define FC_SP_KC 64          /* columns of x a part of a block (one 64-bit mask) */
#define FC_SP_ROWS 128       /* rows of x a pass over a block's parts */
#define FC_SP_DENSITY 0.6    /* sampled share of nonzero values above which x is dense */
#define FC_SP_SAMPLE 8       /* rows sampled */

/* Bit q set where x[q] is not zero (NaN included), q < count <= 64. */
static inline uint64_t nonzero_bits(const float *x, int64_t count)
{
    uint64_t bits = 0;
    for (int64_t q = 0; q < count; q += VL) {
        vf v = count - q >= VL ? vf_load(x + q) : vf_load_part(x + q, count - q);
#if defined(__AVX512F__)
        uint64_t lanes = _mm512_cmp_ps_mask((__m512)v, _mm512_setzero_ps(), _CMP_NEQ_UQ);
#elif defined(__AVX2__)
        uint64_t lanes = (uint32_t)_mm256_movemask_ps(
            _mm256_cmp_ps((__m256)v, _mm256_setzero_ps(), _CMP_NEQ_UQ));
#else
        uint64_t lanes = 0;
        for (int l = 0; l < VL; l++) lanes |= (uint64_t)(v[l] != 0) << l;
#endif
        bits |= lanes << q;
    }
    return bits;
}

/* How many masks a block of x's columns has (one a part of FC_SP_KC columns). */
static inline int64_t block_words(const fc_t *a)
{
    return (a->kc + FC_SP_KC - 1) / FC_SP_KC;
}

/* Fills masks (m * a->words words, a->words set by plan_sparse) and points a->masks at
 * it: for each row of a->x and each part of each block (sparse_block's), the part's
 * nonzero_bits. */
static void find_masks(fc_t *a, uint64_t *masks)
{
    for (int64_t r = 0; r < a->m; r++)
        for (int64_t p0 = 0, w = r * a->words; p0 < a->k; p0 += a->kc) {
            int64_t end = p0 + a->kc < a->k ? p0 + a->kc : a->k;
            for (int64_t s0 = p0; s0 < end; s0 += FC_SP_KC, w++)
                masks[w] = nonzero_bits(a->x + r * a->k + s0,
                                        end - s0 < FC_SP_KC ? end - s0 : FC_SP_KC);
        }
    a->masks = masks;
}

/* Row r's sums by PANELS panels over x's columns s0 + q for the bits q set in `bits`,
 * added to acc (PANELS pairs of vectors) in the order of the columns; the panels' rows
 * of column s0 start at wb, `stride` floats from one panel to the next. */
static inline __attribute__((always_inline)) void sparse_sums(const fc_t *a, int64_t r,
                                                              const float *wb,
                                                              int64_t stride, int64_t s0,
                                                              uint64_t bits,
                                                              const int PANELS, vf *acc)
{
    const float *xr = a->x + r * a->k + s0;
    for (; bits; bits &= bits - 1) {
        int q = __builtin_ctzll(bits);
        float xq = xr[q];
        const float *w = wb + q * FC_NR;
        for (int p = 0; p < PANELS; p++) {
            acc[2 * p] += xq * vf_load(w + p * stride);
            acc[2 * p + 1] += xq * vf_load(w + p * stride + VL);
        }
    }
}

/* The values of rows 0 .. count / FC_NR of a packed block: 1 where all are finite. */
static int block_finite(const float *block, int64_t count)
{
    vf sum = {0};
    for (int64_t i = 0; i < count; i += VL) sum += vf_load(block + i) * (vf){0};
    for (int l = 0; l < VL; l++)
        if (sum[l] != 0) return 0;          /* inf * 0 and NaN * 0 are NaN */
    return 1;
}

/* The next block of a group's panels (fc_train_sparse_f32), packed FC_SP_AHEAD rows at
 * a time while the block before runs, the rows after those prefetched into L2. */
typedef struct {
    float *to;                              /* FC_KC rows a panel */
    int64_t j0, panels, p0, kc, done, every, tick;
    int finite;                             /* the values packed so far are finite */
} ahead_t;

#define FC_SP_AHEAD 8                       /* rows a share (pack_block's 8 by 8) */

/* `rows` more rows of h's block (to its end at most), then the next share prefetched. */
static void pack_rows_ahead(const fc_t *a, ahead_t *h, int64_t rows)
{
    int64_t q0 = h->done, q1 = q0 + rows < h->kc ? q0 + rows : h->kc;
    int64_t q2 = q1 + FC_SP_AHEAD < h->kc ? q1 + FC_SP_AHEAD : h->kc;
    for (int64_t p = 0; p < h->panels; p++) {
        float *block = h->to + p * FC_KC * FC_NR;
        pack_block(a, block, h->j0 + p, h->p0, q0, q1);
        h->finite &= block_finite(block + q0 * FC_NR, (q1 - q0) * FC_NR);
        if (!a->wt && q1 < q2) prefetch_rows(a, h->j0 + p, h->p0, q1, q2);
    }
    h->done = q1;
}

static void pack_ahead(const fc_t *a, ahead_t *h)
{
    if (h->done < h->kc) pack_rows_ahead(a, h, FC_SP_AHEAD);
}

/* Row r's sums by panels j0 .. j0 + PANELS written out as write_sums does, acc's values
 * passed on (so that they stay in registers). */
static inline __attribute__((always_inline)) void write_row(const fc_t *a, int64_t r,
                                                            int64_t j0, int first, int last,
                                                            const int PANELS, const vf *acc)
{
    float zeros[FC_NR] = {0};
    for (int p = 0; p < PANELS; p++) {
        int64_t n0 = (j0 + p) * FC_NR;
        if (n0 + FC_NR > a->n) {                       /* a panel past column N */
            vf edge[1][2] = {{acc[2 * p], acc[2 * p + 1]}};
            write_sums(a, r, 1, j0 + p, first, last, edge);
            continue;
        }
        const float *bias = !last ? NULL : a->bias != NULL ? a->bias + n0 : zeros;
        float *to = a->out + r * a->n + n0;
        vf_store(to, finish(acc[2 * p], to, first, bias, (int)a->relu));
        vf_store(to + VL, finish(acc[2 * p + 1], to + VL, first,
                                 bias == NULL ? NULL : bias + VL, (int)a->relu));
    }
}

/* Rows r0 .. r0 + rows (at most FC_SP_ROWS) by the panels j0 .. j0 + PANELS over the
 * block of columns p0 .. p0 + kc, part by part; the panels' rows of column p0 start at
 * wb, `stride` floats apart, and the rows of the weight up to `end` are in reach (the
 * next part's prefetched from there). `dense`: every column's product, zeros too (a
 * block of the weight with a value that is not finite). `ahead`: the next block being
 * packed (a share after every few rows), or NULL. */
static inline __attribute__((always_inline)) void sparse_block(const fc_t *a, const float *wb,
                                                               int64_t stride, int64_t end,
                                                               int64_t j0, int64_t r0,
                                                               int64_t rows, int64_t p0,
                                                               int64_t kc, int dense,
                                                               ahead_t *ahead,
                                                               const int PANELS)
{
    float kept[FC_SP_ROWS][2 * FC_SP_PANELS * VL] __attribute__((aligned(64)));
    const uint64_t *masks = a->masks + r0 * a->words + p0 / a->kc * block_words(a);
    for (int64_t s0 = p0; s0 < p0 + kc; s0 += FC_SP_KC, masks++) {
        int64_t count = p0 + kc - s0 < FC_SP_KC ? p0 + kc - s0 : FC_SP_KC;
        int fresh = s0 == p0, ends = s0 + count == p0 + kc;
        int64_t next = s0 + count;          /* the next part, prefetched over the rows */
        int64_t lines = next >= end ? 0 : (end - next < FC_SP_KC ? end - next : FC_SP_KC)
                                              * FC_NR / 16;           /* 64-byte lines */
        int64_t share = (PANELS * lines + rows - 1) / rows, line = 0, panel = 0;
        const float *part = wb + (s0 - p0) * FC_NR, *fetch = wb + (next - p0) * FC_NR;
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t l = 0; l < share && panel < PANELS; l++) {
                __builtin_prefetch(fetch + panel * stride + line * 16, 0, 3);
                if (++line == lines) {
                    line = 0;
                    panel++;
                }
            }
            vf acc[2 * FC_SP_PANELS];
            for (int v = 0; v < 2 * PANELS; v++)
                acc[v] = fresh ? (vf){0} : vf_load(kept[r] + v * VL);
            sparse_sums(a, r0 + r, part, stride, s0,
                        dense ? ~0ull >> (64 - count) : masks[r * a->words], PANELS, acc);
            if (ahead != NULL && ++ahead->tick % ahead->every == 0) pack_ahead(a, ahead);
            if (!ends) {
                for (int v = 0; v < 2 * PANELS; v++) vf_store(kept[r] + v * VL, acc[v]);
                continue;
            }
            write_row(a, r0 + r, j0, p0 == 0, p0 + kc == a->k, PANELS, acc);
        }
    }
}

/* Rows r0 .. r1 by the panels j0 .. j0 + PANELS, block by block. */
static inline __attribute__((always_inline)) void sparse_unit(const fc_t *a, int64_t j0,
                                                              int64_t r0, int64_t r1,
                                                              const int PANELS)
{
    for (int64_t p0 = 0; p0 < a->k; p0 += a->kc) {
        int64_t kc = a->k - p0 < a->kc ? a->k - p0 : a->kc;
        for (int64_t r = r0; r < r1; r += FC_SP_ROWS)
            sparse_block(a, a->wp + (j0 * a->k + p0) * FC_NR, a->k * FC_NR, a->k, j0, r,
                         r1 - r < FC_SP_ROWS ? r1 - r : FC_SP_ROWS, p0, kc, 0, NULL, PANELS);
    }
}

/* sparse_unit on a weight packed as it is used (fc_train.h's pack_block) into two
 * buffers of FC_KC rows a panel: the unit's first block of the PANELS panels at once,
 * each next one a share at a time while the one before runs (pack_ahead); each block's
 * values checked. Where K is one block, the group's block stays in the first buffer for
 * the next unit of the same group (held: the group's first panel and whether its
 * values are finite). */
static inline __attribute__((always_inline)) void sparse_train_unit(const fc_t *a,
                                                                    float *buffers,
                                                                    int64_t held[2],
                                                                    int64_t j0, int64_t r0,
                                                                    int64_t r1,
                                                                    const int PANELS)
{
    const int64_t stride = (int64_t)FC_KC * FC_NR;
    float *now = buffers, *next = buffers + FC_SP_PANELS * stride;
    int64_t kc = a->k < a->kc ? a->k : a->kc;
    if (held[0] != j0 || a->k > a->kc) {
        ahead_t first = {.to = now, .j0 = j0, .panels = PANELS, .kc = kc, .finite = 1};
        pack_rows_ahead(a, &first, kc);
        held[0] = j0;
        held[1] = first.finite;
    }
    int finite = (int)held[1];
    for (int64_t p0 = 0; p0 < a->k; p0 += kc) {
        kc = a->k - p0 < a->kc ? a->k - p0 : a->kc;
        int64_t next_p0 = p0 + kc, next_kc = a->k - next_p0 < a->kc ? a->k - next_p0 : a->kc;
        int64_t steps = (kc + FC_SP_KC - 1) / FC_SP_KC * (r1 - r0);     /* rows run */
        int64_t shares = (next_kc + FC_SP_AHEAD - 1) / FC_SP_AHEAD;
        ahead_t ahead = {.to = next, .j0 = j0, .panels = PANELS, .p0 = next_p0,
                         .kc = next_p0 < a->k ? next_kc : 0, .finite = 1,
                         .every = shares > 0 && steps > shares ? steps / shares : 1};
        if (!a->wt && ahead.kc > 0)
            for (int p = 0; p < PANELS; p++)
                prefetch_rows(a, j0 + p, next_p0, 0,
                              FC_SP_AHEAD < ahead.kc ? FC_SP_AHEAD : ahead.kc);
        for (int64_t r = r0; r < r1; r += FC_SP_ROWS)
            sparse_block(a, now, stride, p0 + kc, j0, r,
                         r1 - r < FC_SP_ROWS ? r1 - r : FC_SP_ROWS, p0, kc, !finite,
                         ahead.kc > 0 ? &ahead : NULL, PANELS);
        if (ahead.kc == 0) break;
        pack_rows_ahead(a, &ahead, ahead.kc);                /* what is left of it */
        finite = ahead.finite;
        float *done = now;
        now = next;
        next = done;
    }
}

/* Units of work from the shared counter: a group of FC_SP_PANELS panels (fewer at the
 * end) by a chunk of the rows (a->chunks of them), on the packed weight or (the job's
 * `blocks` not NULL) on blocks packed there as they are used. */
static void *sparse_job(void *arg)
{
    fc_t *a = ((fc_job_t *)arg)->a;
    float *buffer = ((fc_job_t *)arg)->blocks;
    int64_t u, groups = (a->panels + FC_SP_PANELS - 1) / FC_SP_PANELS, held[2] = {-1, 0};
    while ((u = __atomic_fetch_add(&a->next_unit, 1, __ATOMIC_RELAXED)) < groups * a->chunks) {
        int64_t j0 = u / a->chunks * FC_SP_PANELS, c = u % a->chunks;
        int64_t r0 = a->m * c / a->chunks, r1 = a->m * (c + 1) / a->chunks;
        int64_t left = a->panels - j0;
        switch (left < FC_SP_PANELS ? left : FC_SP_PANELS) {     /* PANELS a constant */
#define FC_SP_CASE(P)                                                                  \
        case P:                                                                       \
            if (buffer != NULL)                                                       \
                sparse_train_unit(a, buffer, held, j0, r0, r1,                        \
                                  P < FC_SP_PANELS ? P : FC_SP_PANELS);               \
            else                                                                      \
                sparse_unit(a, j0, r0, r1, P < FC_SP_PANELS ? P : FC_SP_PANELS);      \
            break;
        FC_SP_CASE(1) FC_SP_CASE(2) FC_SP_CASE(3) FC_SP_CASE(4) FC_SP_CASE(5) FC_SP_CASE(6)
#undef FC_SP_CASE
        }
    }
    return NULL;
}

/* The share of nonzero values (NaN included) in FC_SP_SAMPLE rows spread over the M
 * rows of x (M, K), or of x^T for x (K, M) where xt. */
static double sampled_density(const float *x, int64_t xt, int64_t m, int64_t k)
{
    int64_t rows = m < FC_SP_SAMPLE ? m : FC_SP_SAMPLE, nonzero = 0;
    for (int64_t s = 0; s < rows; s++) {
        int64_t row = s * m / rows;
        if (xt) {
            for (int64_t q = 0; q < k; q++) nonzero += x[q * m + row] != 0;
            continue;
        }
        for (int64_t q = 0; q < k; q += 64)
            nonzero += __builtin_popcountll(nonzero_bits(x + row * k + q,
                                                         k - q < 64 ? k - q : 64));
    }
    return (double)nonzero / (double)(rows * k);
}

/* a's blocks (fc_forward_f32's), units and threads for the one-row tiles. */
static void plan_sparse(fc_t *a, int64_t threads)
{
    a->panels = (a->n + FC_NR - 1) / FC_NR;
    int64_t parts = (a->k + FC_KC - 1) / FC_KC;
    a->kc = (a->k + parts - 1) / parts;
    a->words = parts * block_words(a);                  /* find_masks's, a row */
    int64_t groups = (a->panels + FC_SP_PANELS - 1) / FC_SP_PANELS;
    /* chunks of at most FC_SP_ROWS rows, and at least two units a thread where M allows */
    int64_t wanted = (2 * threads + groups - 1) / groups;
    a->chunks = (a->m + FC_SP_ROWS - 1) / FC_SP_ROWS;
    if (a->chunks < wanted) a->chunks = wanted;
    if (a->chunks > a->m) a->chunks = a->m;
    a->threads = threads < groups * a->chunks ? threads : groups * a->chunks;
    if (a->threads < 1) a->threads = 1;
    if (a->threads > POOL_MAX_THREADS) a->threads = POOL_MAX_THREADS;
}

/* fc_forward_f32's out, arguments and result (its bits), for a packed weight whose
 * values are all finite: the one-row tiles above where the sampled rows of x are at
 * most FC_SP_DENSITY nonzero, else fc_forward_f32 itself. */
int fc_sparse_f32(const float *x, const float *wp, const float *bias, float *out, int64_t m,
                  int64_t k, int64_t n, int64_t relu, int64_t threads)
{
    if (sampled_density(x, 0, m, k) > FC_SP_DENSITY)
        return fc_forward_f32(x, wp, bias, out, m, k, n, relu, threads);
    fc_t a = {.x = x, .wp = wp, .bias = bias, .out = out, .m = m, .k = k, .n = n,
              .relu = relu};
    plan_sparse(&a, threads);
    uint64_t *masks = malloc((size_t)(m * a.words + 1) * sizeof(uint64_t));
    if (masks == NULL) return fc_forward_f32(x, wp, bias, out, m, k, n, relu, threads);
    find_masks(&a, masks);
    fc_job_t jobs[POOL_MAX_THREADS];
    for (int64_t t = 0; t < a.threads; t++) jobs[t] = (fc_job_t){&a};
    pool_run(sparse_job, jobs, sizeof(fc_job_t), a.threads);
    free(masks);
    return 0;
}

/* dst (cols, rows) = src (rows, cols) transposed, 8 by 8 values at a time. */
static void transpose_into(const float *src, int64_t rows, int64_t cols, float *dst)
{
    int64_t r8 = rows / 8 * 8, c8 = cols / 8 * 8;
    for (int64_t r = 0; r < r8; r += 8)
        for (int64_t c = 0; c < c8; c += 8) {
            v8f t[8];
            for (int l = 0; l < 8; l++) t[l] = *(const v8fu *)(src + (r + l) * cols + c);
            transpose8(t);
            for (int l = 0; l < 8; l++) *(v8fu *)(dst + (c + l) * rows + r) = t[l];
        }
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = r < r8 ? c8 : 0; c < cols; c++) dst[c * rows + r] = src[r * cols + c];
}

/* fc_train_f32's out, arguments and result (its bits): the one-row tiles on blocks of
 * the weight packed as they are used where the rows sampled from A (x, or x^T where xt)
 * are at most FC_SP_DENSITY nonzero (x^T first copied to rows), a block with a value
 * that is not finite summing every column; else fc_train_f32 itself. Returns 0 (the
 * one-row tiles ran), 2 (fc_train_f32 ran and succeeded) or 1 (buffers could not be
 * allocated: out is untouched). */
int fc_train_sparse_f32(const float *x, int64_t xt, const float *w, int64_t wt, float *out,
                        int64_t m, int64_t k, int64_t n, int64_t threads)
{
    if (sampled_density(x, xt, m, k) > FC_SP_DENSITY)
        return fc_train_f32(x, xt, w, wt, out, m, k, n, threads) ? 1 : 2;
    fc_t a = {.x = x, .w = w, .wt = wt, .out = out, .m = m, .k = k, .n = n};
    plan_sparse(&a, threads);
    size_t each = (size_t)2 * FC_SP_PANELS * FC_KC * FC_NR;
    float *rows = xt ? malloc((size_t)(m * k) * sizeof(float)) : NULL;
    float *buffers = aligned_alloc(64, (size_t)a.threads * each * sizeof(float));
    uint64_t *masks = malloc((size_t)(m * a.words + 1) * sizeof(uint64_t));
    if ((xt && rows == NULL) || buffers == NULL || masks == NULL) {
        free(rows);
        free(buffers);
        free(masks);
        return 1;
    }
    if (xt) {
        transpose_into(x, k, m, rows);
        a.x = rows;
    }
    find_masks(&a, masks);
    fc_job_t jobs[POOL_MAX_THREADS];
    for (int64_t t = 0; t < a.threads; t++) jobs[t] = (fc_job_t){&a, buffers + t * each};
    pool_run(sparse_job, jobs, sizeof(fc_job_t), a.threads);
    free(masks);
    free(rows);
    free(buffers);
    return 0;
}
