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
 * do not end a block wait in `kept` for the next part. The masks of those rows are
 * found before their sums, so that their loads of x overlap.
 *
 * A one-row tile reads the weight once a nonzero value where fc_forward_f32's reads it
 * once per FC_MR rows: with more than FC_SP_DENSITY of nonzero values in rows sampled
 * from x, fc_forward_f32 runs instead (2-core AMD EPYC, 128x2048 by 2048 on 2 threads,
 * a relu's output 43% nonzero: 1.4 times as fast with AVX-512, 1.3 with AVX2; as fast
 * at about 65% nonzero). */
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

/* Row r's sums by PANELS panels from j0 over x's columns s0 + q for the bits q set in
 * `bits`, added to acc (PANELS pairs of vectors) in the order of the columns. */
static inline __attribute__((always_inline)) void sparse_sums(const fc_t *a, int64_t r,
                                                              int64_t j0, int64_t s0,
                                                              uint64_t bits,
                                                              const int PANELS, vf *acc)
{
    const float *xr = a->x + r * a->k + s0, *wb = a->wp + (j0 * a->k + s0) * FC_NR;
    int64_t stride = a->k * FC_NR;
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

/* Rows r0 .. r0 + rows (at most FC_SP_ROWS) by the panels j0 .. j0 + PANELS over the
 * block of columns p0 .. p0 + kc, part by part. */
static inline __attribute__((always_inline)) void sparse_block(const fc_t *a, int64_t j0,
                                                               int64_t r0, int64_t rows,
                                                               int64_t p0, int64_t kc,
                                                               const int PANELS)
{
    float kept[FC_SP_ROWS][2 * FC_SP_PANELS * VL] __attribute__((aligned(64)));
    uint64_t bits[FC_SP_ROWS];
    for (int64_t s0 = p0; s0 < p0 + kc; s0 += FC_SP_KC) {
        int64_t count = p0 + kc - s0 < FC_SP_KC ? p0 + kc - s0 : FC_SP_KC;
        int fresh = s0 == p0, ends = s0 + count == p0 + kc;
        for (int64_t r = 0; r < rows; r++)
            bits[r] = nonzero_bits(a->x + (r0 + r) * a->k + s0, count);
        int64_t next = s0 + count;          /* the next part, prefetched over the rows */
        int64_t lines = next >= a->k ? 0 : (a->k - next < FC_SP_KC ? a->k - next : FC_SP_KC)
                                               * FC_NR / 16;          /* 64-byte lines */
        int64_t share = (PANELS * lines + rows - 1) / rows;
        for (int64_t r = 0; r < rows; r++) {
            for (int64_t l = r * share; l < (r + 1) * share && l < PANELS * lines; l++)
                __builtin_prefetch(a->wp + ((j0 + l / lines) * a->k + next) * FC_NR
                                   + l % lines * 16, 0, 3);
            vf acc[2 * FC_SP_PANELS];
            for (int v = 0; v < 2 * PANELS; v++)
                acc[v] = fresh ? (vf){0} : vf_load(kept[r] + v * VL);
            sparse_sums(a, r0 + r, j0, s0, bits[r], PANELS, acc);
            if (!ends) {
                for (int v = 0; v < 2 * PANELS; v++) vf_store(kept[r] + v * VL, acc[v]);
                continue;
            }
            for (int p = 0; p < PANELS; p++)
                write_sums(a, r0 + r, 1, j0 + p, p0 == 0, p0 + kc == a->k,
                           (vf(*)[2])(acc + 2 * p));
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
            sparse_block(a, j0, r, r1 - r < FC_SP_ROWS ? r1 - r : FC_SP_ROWS, p0, kc, PANELS);
    }
}

/* Units of work from the shared counter: a group of FC_SP_PANELS panels (fewer at the
 * end) by a chunk of the rows (a->chunks of them). */
static void *sparse_job(void *arg)
{
    fc_t *a = ((fc_job_t *)arg)->a;
    int64_t u, groups = (a->panels + FC_SP_PANELS - 1) / FC_SP_PANELS;
    while ((u = __atomic_fetch_add(&a->next_unit, 1, __ATOMIC_RELAXED)) < groups * a->chunks) {
        int64_t j0 = u / a->chunks * FC_SP_PANELS, c = u % a->chunks;
        int64_t r0 = a->m * c / a->chunks, r1 = a->m * (c + 1) / a->chunks;
        int64_t left = a->panels - j0;
        switch (left < FC_SP_PANELS ? left : FC_SP_PANELS) {     /* PANELS a constant */
#define FC_SP_CASE(P) \
        case P: sparse_unit(a, j0, r0, r1, P < FC_SP_PANELS ? P : FC_SP_PANELS); break;
        FC_SP_CASE(1) FC_SP_CASE(2) FC_SP_CASE(3) FC_SP_CASE(4) FC_SP_CASE(5) FC_SP_CASE(6)
#undef FC_SP_CASE
        }
    }
    return NULL;
}

/* The share of nonzero values (NaN included) in FC_SP_SAMPLE rows spread over x's. */
static double sampled_density(const float *x, int64_t m, int64_t k)
{
    int64_t rows = m < FC_SP_SAMPLE ? m : FC_SP_SAMPLE, nonzero = 0;
    for (int64_t s = 0; s < rows; s++) {
        const float *row = x + (s * m / rows) * k;
        for (int64_t q = 0; q < k; q += 64)
            nonzero += __builtin_popcountll(nonzero_bits(row + q, k - q < 64 ? k - q : 64));
    }
    return (double)nonzero / (double)(rows * k);
}

/* fc_forward_f32's out, arguments and result (its bits), for a packed weight whose
 * values are all finite: the one-row tiles above where the sampled rows of x are at
 * most FC_SP_DENSITY nonzero, else fc_forward_f32 itself. */
int fc_sparse_f32(const float *x, const float *wp, const float *bias, float *out, int64_t m,
                  int64_t k, int64_t n, int64_t relu, int64_t threads)
{
    if (sampled_density(x, m, k) > FC_SP_DENSITY)
        return fc_forward_f32(x, wp, bias, out, m, k, n, relu, threads);
    fc_t a = {.x = x, .wp = wp, .bias = bias, .out = out, .m = m, .k = k, .n = n,
              .relu = relu, .panels = (n + FC_NR - 1) / FC_NR};
    int64_t parts = (k + FC_KC - 1) / FC_KC;
    a.kc = (k + parts - 1) / parts;         /* fc_forward_f32's blocks */
    int64_t groups = (a.panels + FC_SP_PANELS - 1) / FC_SP_PANELS;
    /* chunks of at most FC_SP_ROWS rows, and at least two units a thread where M allows */
    int64_t wanted = (2 * threads + groups - 1) / groups;
    a.chunks = (m + FC_SP_ROWS - 1) / FC_SP_ROWS;
    if (a.chunks < wanted) a.chunks = wanted;
    if (a.chunks > m) a.chunks = m;
    a.threads = threads < groups * a.chunks ? threads : groups * a.chunks;
    if (a.threads < 1) a.threads = 1;
    if (a.threads > POOL_MAX_THREADS) a.threads = POOL_MAX_THREADS;
    fc_job_t jobs[POOL_MAX_THREADS];
    for (int64_t t = 0; t < a.threads; t++) jobs[t] = (fc_job_t){&a};
    pool_run(sparse_job, jobs, sizeof(fc_job_t), a.threads);
    return 0;
}
