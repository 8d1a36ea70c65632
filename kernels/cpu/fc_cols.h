/* ---- Products of a few columns on a packed weight (fc_cols_f32) -------------------
 * Included by fc_native.c. out (M, N) = act(x (M, K) @ w + bias) for N <= FC_COLS_MAX
 * (a classifier's last product: 10 columns), where a panel of fc_native.c's would be
 * mostly zeros (10 columns of 32 with AVX-512). The weight is packed transposed: each
 * column's K values side by side, zeros up to a whole vector, and columns of zeros up
 * to whole groups of cols_group(N) columns. A tile is two rows of x, read where they
 * lie, by a group of columns: one vector of sums per (row, column), whose lane l sums
 * the products of the k = l (mod VL) in order; the lanes are then added in a fixed
 * order (lanes_sum), then the bias, then relu (NaN stays NaN). The threads split the
 * pairs of rows in contiguous ranges, so each output is summed by one thread in one
 * order: the same bits on any number of threads. */
#define FC_COLS_MAX 16              /* the most columns fc_cols_f32 takes */
#define FC_COLS_GROUP 6             /* the most columns of a tile */

typedef struct {
    const float *x, *wt, *bias;
    float *out;
    int64_t m, k, n, relu, parts;
} fc_cols_t;

typedef struct {
    const fc_cols_t *a;
    int64_t part;
} fc_cols_job_t;

/* The columns of a tile for N columns: groups of equal width, at most FC_COLS_GROUP. */
static inline int64_t cols_group(int64_t n)
{
    int64_t groups = (n + FC_COLS_GROUP - 1) / FC_COLS_GROUP;
    return (n + groups - 1) / groups;
}

/* A packed column's length: K rounded up to whole vectors. */
static inline int64_t cols_length(int64_t k) { return (k + VL - 1) / VL * VL; }

int64_t fc_cols_packed_size(int64_t k, int64_t n)
{
    int64_t width = cols_group(n);
    return (n + width - 1) / width * width * cols_length(k);
}

/* w (K, N) into wt (fc_cols_packed_size(K, N) floats), N <= FC_COLS_MAX. */
void fc_cols_pack_f32(const float *w, int64_t k, int64_t n, float *wt)
{
    int64_t length = cols_length(k), columns = fc_cols_packed_size(k, n) / length;
    for (int64_t c = 0; c < columns; c++)
        for (int64_t q = 0; q < length; q++)
            wt[c * length + q] = c < n && q < k ? w[q * n + c] : 0.0f;
}

/* The sum of v's lanes, halves added pairwise (lane i + lane i + VL / 2, and so on down
 * to one): the same order every time, by vector adds of halves where the target has
 * AVX2 or AVX-512. v is never addressed: that would keep a tile's sums in memory
 * through its loop. */
static inline __attribute__((always_inline)) float lanes_sum(vf v)
{
#if defined(__AVX512F__) || defined(__AVX2__)
#if VL == 16
    __m256 eight = _mm256_add_ps(_mm512_castps512_ps256((__m512)v),
                                 (__m256)_mm512_extractf64x4_pd((__m512d)v, 1));
#else
    __m256 eight = (__m256)v;
#endif
    __m128 four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps(eight, 1));
    __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    return _mm_cvtss_f32(two) + _mm_cvtss_f32(_mm_shuffle_ps(two, two, 1));
#else
    float s[VL];
    for (int i = 0; i < VL; i++) s[i] = v[i];
    for (int width = VL / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++) s[i] += s[i + width];
    return s[0];
#endif
}

static inline float cols_finish(const fc_cols_t *a, vf sums, int64_t c)
{
    float s = lanes_sum(sums);
    if (a->bias != NULL) s += a->bias[c];
    return a->relu && s < 0 ? 0.0f : s;
}

/* Column c's outputs of rows r (sums s) and r + 1 (sums t, where `two`), if c < N. */
static inline void cols_store(const fc_cols_t *a, int64_t r, int64_t c, int two, vf s, vf t)
{
    if (c >= a->n) return;
    a->out[r * a->n + c] = cols_finish(a, s, c);
    if (two) a->out[(r + 1) * a->n + c] = cols_finish(a, t, c);
}

static inline __attribute__((always_inline)) void cols_tile(const fc_cols_t *a, int64_t r,
                                                            int64_t c0, const int WIDTH)
{
    const int64_t k = a->k, length = cols_length(k), tail = k % VL, whole = k - tail;
    const int two = r + 1 < a->m;
    const float *x0 = a->x + r * k, *x1 = two ? x0 + k : x0, *w = a->wt + c0 * length;
    vf s[2][FC_COLS_GROUP];
    for (int c = 0; c < FC_COLS_GROUP; c++) s[0][c] = s[1][c] = (vf){0};
    for (int64_t q = 0; q < whole; q += VL) {
        vf u = vf_load(x0 + q), v = vf_load(x1 + q);
        for (int c = 0; c < WIDTH; c++) {
            vf wc = vf_load(w + c * length + q);
            s[0][c] += u * wc;
            s[1][c] += v * wc;
        }
    }
    if (tail) {
        vf u = vf_load_part(x0 + whole, tail), v = vf_load_part(x1 + whole, tail);
        for (int c = 0; c < WIDTH; c++) {
            vf wc = vf_load(w + c * length + whole);
            s[0][c] += u * wc;
            s[1][c] += v * wc;
        }
    }
    for (int c = 0; c < WIDTH; c++) cols_store(a, r, c0 + c, two, s[0][c], s[1][c]);
}

static inline __attribute__((always_inline)) void cols_pairs(const fc_cols_t *a,
                                                             int64_t p0, int64_t p1,
                                                             const int WIDTH)
{
    for (int64_t p = p0; p < p1; p++)
        for (int64_t c0 = 0; c0 < a->n; c0 += WIDTH) cols_tile(a, 2 * p, c0, WIDTH);
}

static void *cols_job(void *arg)
{
    const fc_cols_job_t *job = arg;
    const fc_cols_t *a = job->a;
    int64_t p0, p1;
    pool_share((a->m + 1) / 2, a->parts, job->part, &p0, &p1);
    switch (cols_group(a->n)) {          /* a tile's width, known to the compiler */
    case 1: cols_pairs(a, p0, p1, 1); break;
    case 2: cols_pairs(a, p0, p1, 2); break;
    case 3: cols_pairs(a, p0, p1, 3); break;
    case 4: cols_pairs(a, p0, p1, 4); break;
    case 5: cols_pairs(a, p0, p1, 5); break;
    default: cols_pairs(a, p0, p1, FC_COLS_GROUP); break;
    }
    return NULL;
}

/* out (M, N) = act(x (M, K) @ w + bias) with wt = fc_cols_pack_f32(w), bias (N,) or
 * NULL, relu 0 or 1, on `threads` threads (at most one a pair of rows). M, K >= 1,
 * 1 <= N <= FC_COLS_MAX; out must not overlap x. Returns 0 (fc_forward_f32's
 * contract, which allocates; this does not). */
int fc_cols_f32(const float *x, const float *wt, const float *bias, float *out, int64_t m,
                 int64_t k, int64_t n, int64_t relu, int64_t threads)
{
    fc_cols_t a = {x, wt, bias, out, m, k, n, relu, pool_parts(threads, (m + 1) / 2)};
    fc_cols_job_t jobs[POOL_MAX_THREADS];
    for (int64_t t = 0; t < a.parts; t++) jobs[t] = (fc_cols_job_t){&a, t};
    pool_run(cols_job, jobs, sizeof(fc_cols_job_t), a.parts);
    return 0;
}
