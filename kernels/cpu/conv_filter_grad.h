/* The filter gradient of conv_native.c's convolutions (included there, after its
 * buffers and job runner; the contract is conv_native.py's filter_grad).
 *
 * A tile is GV vectors of VL output channels (native_simd.h: 16 floats with AVX-512,
 * else 8) by GK taps, or one vector by GK1 taps where O <= VL (a last tile of one
 * vector has as few of 6, 9 and 12 taps as hold the taps left): per output, dout's
 * values (dout transposed per image to (outputs, O padded to a whole tile), eight by
 * eight through vector transposes) times one broadcast input value per tap, summed
 * over every output of a group of images (group_size; adjacent outputs of a one-vector
 * tile share their input values: fg_shared). Each thread sums a fixed range
 * of images into its own K x O array; the calling thread adds those in thread order
 * (results depend on the number of threads only). */

/* GCC's predictive commoning keeps a tile's input values for the next output (three
 * taps across read overlapping values), which leaves AVX2's 16 registers short: its
 * tiles spilled their sums to the stack at every output and took 1.3-1.8x as long.
 * AVX-512's 32 registers hold them: there it stays (0-7% faster with it). */
#if defined(__GNUC__) && !defined(__clang__) && !defined(__AVX512F__)
#define FG_NO_PREDICTIVE_COMMONING
#pragma GCC push_options
#pragma GCC optimize("no-predictive-commoning")
#endif

/* GV vectors by GK taps: 18 of AVX-512's 32 registers, 12 of AVX2's 16; one vector by
 * GK1 taps: 24, 12 */
#define GV 2
#define GK (VL == 16 ? 9 : 6)
#define GK1 (VL == 16 ? 24 : 12)
#define GROUP_OUTPUTS 256

/* Images per group of the filter gradient: enough outputs that the loads and
 * stores around each tile's loop are a small part of it. */
static int64_t group_size(const conv_t *a)
{
    int64_t per_image = a->ho * a->wo, g = (GROUP_OUTPUTS + per_image - 1) / per_image;
    return g < 1 ? 1 : g;
}

/* Output channels of the filter gradient's tiles: VL where O <= VL (one vector), else
 * GV vectors; its sums have O rounded up to a whole tile. */
static int64_t fg_channels(const conv_t *a) { return a->o <= VL ? VL : GV * VL; }

static int64_t fg_padded(const conv_t *a)
{
    int64_t t = fg_channels(a);
    return (a->o + t - 1) / t * t;
}

/* dout of one image (O, plane) into dt (plane, opad): eight channels by eight outputs
 * at a time through vector transposes, the rest one by one (columns past O stay
 * zero). */
static void fg_transpose(const float *d, float *dt, int64_t o, int64_t plane, int64_t opad)
{
    int64_t oc = 0;
    for (; oc + 8 <= o; oc += 8) {
        int64_t q = 0;
        for (; q + 8 <= plane; q += 8) {
            v8f r[8];
            for (int i = 0; i < 8; i++) r[i] = *(const v8fu *)(d + (oc + i) * plane + q);
            transpose8(r);
            for (int i = 0; i < 8; i++) *(v8fu *)(dt + (q + i) * opad + oc) = r[i];
        }
        for (; q < plane; q++)
            for (int64_t i = 0; i < 8; i++) dt[q * opad + oc + i] = d[(oc + i) * plane + q];
    }
    for (; oc < o; oc++)
        for (int64_t q = 0; q < plane; q++) dt[q * opad + oc] = d[oc * plane + q];
}

/* In a tile of one vector by taps in threes (T3), adjacent outputs share input values:
 * tap kx of output x + p reads the value at offset kx + p. FG_SHARE outputs at a time,
 * each value of a three is broadcast once for the (up to 3) products that use it, which
 * halves the loads per product (more outputs would not fit in registers); every sum
 * still adds its outputs in order, so the bits are those of one output at a time. */
#define FG_SHARE (VL == 16 ? 4 : 2)

static inline __attribute__((always_inline)) void fg_shared(
    const float *brow, const float *drow, int64_t opad, const int64_t *off, int64_t x,
    vf *acc, const int KT)
{
    vf dv[FG_SHARE];
#pragma GCC unroll 4
    for (int p = 0; p < FG_SHARE; p++) dv[p] = vf_load(drow + (x + p) * opad);
#pragma GCC unroll 32
    for (int t = 0; t < KT; t += 3) {
        const float *src = brow + off[t] + x;
#pragma GCC unroll 6
        for (int j = 0; j < FG_SHARE + 2; j++) {
            float b = src[j];
#pragma GCC unroll 3
            for (int kx = 0; kx < 3; kx++)
                if (j - kx >= 0 && j - kx < FG_SHARE) acc[t + kx] += dv[j - kx] * b;
        }
    }
}

/* The sums of one tile, VO vectors of output channels from o0 by KT taps from k0, over
 * the m images of a group (buffers buf, transposed dout dt), added to dw (K x opad).
 * T3: the taps come in threes of adjacent buffer offsets (3 taps across, stride and
 * dilation 1 across, k0 a multiple of 3), so a third of the offsets are kept and the
 * rest are constant displacements from them (24 offsets would not fit in registers). */
static inline __attribute__((always_inline)) void fg_tile(
    const conv_t *a, const float *buf, const float *dt, int64_t m, int64_t dsize,
    int64_t opad, int64_t o0, int64_t k0, float *dw, const int VO, const int KT, const int T3)
{
    vf acc[GV][GK1];
    int64_t off[GK1];
#pragma GCC unroll 32
    for (int t = 0; t < KT; t += T3 ? 3 : 1) {
        off[t] = a->koff[k0 + t < a->k ? k0 + t : k0];
#pragma GCC unroll 2
        for (int v = 0; v < VO; v++) acc[v][t] = acc[v][t + (T3 ? 1 : 0)] =
            acc[v][t + (T3 ? 2 : 0)] = (vf){0};
    }
    const int64_t ho = a->ho, wo = a->wo, row_step = a->sh * a->wb, buf_size = a->buf_size;
    for (int64_t g = 0; g < m; g++)
        for (int64_t y = 0; y < ho; y++) {
            const float *drow = dt + g * dsize + y * wo * opad + o0;
            const float *brow = buf + g * buf_size + y * row_step;
            int64_t x = 0;
            if (T3 && VO == 1)        /* FG_SHARE outputs at a time: see fg_shared */
                for (; x + FG_SHARE <= wo; x += FG_SHARE)
                    fg_shared(brow, drow, opad, off, x, acc[0], KT);
            for (; x < wo; x++) {
                vf dv[GV];
#pragma GCC unroll 2
                for (int v = 0; v < VO; v++) dv[v] = vf_load(drow + x * opad + VL * v);
#pragma GCC unroll 32                       /* the whole tile in registers */
                for (int t = 0; t < KT; t++) {
                    float b = T3 ? brow[off[t - t % 3] + t % 3 + x] : brow[off[t] + x];
#pragma GCC unroll 2
                    for (int v = 0; v < VO; v++) acc[v][t] += dv[v] * b;
                }
            }
        }
    for (int t = 0; t < KT && k0 + t < a->k; t++)
        for (int v = 0; v < VO; v++) {
            float *dst = dw + (k0 + t) * opad + o0 + VL * v;
            vf_store(dst, vf_load(dst) + acc[v][t]);
        }
}

/* fg_tile's tiles of one vector by taps from k0: GK1 taps, or the fewest of 6, 9 and 12
 * (multiples of 3, for T3) that hold the taps left (a one-channel conv's 9 taps ran as
 * a tile of 24). */
static inline __attribute__((always_inline)) void fg_tile_one(
    const conv_t *a, const float *buf, const float *dt, int64_t m, int64_t dsize,
    int64_t opad, int64_t o0, int64_t k0, float *dw, const int T3)
{
    int64_t left = a->k - k0;
    if (left <= 6)
        fg_tile(a, buf, dt, m, dsize, opad, o0, k0, dw, 1, 6, T3);
    else if (left <= 9)
        fg_tile(a, buf, dt, m, dsize, opad, o0, k0, dw, 1, 9, T3);
    else if (left <= 12)
        fg_tile(a, buf, dt, m, dsize, opad, o0, k0, dw, 1, 12, T3);
    else
        fg_tile(a, buf, dt, m, dsize, opad, o0, k0, dw, 1, GK1, T3);
}

static void *filter_grad_job(void *p)
{
    job_t *job = p;
    const conv_t *a = job->a;
    int64_t plane = a->ho * a->wo, opad = fg_padded(a), dsize = plane * opad;
    int64_t group = group_size(a);
    if (group > job->last - job->first) group = job->last - job->first;
    float *buf = calloc(group * a->buf_size, sizeof(float));
    float *dt = calloc(group * dsize, sizeof(float));      /* columns past O: zeros */
    if (!buf || !dt) { job->failed = 1; free(buf); free(dt); return NULL; }
    int one = a->o <= VL;                 /* tiles of one vector by GK1 taps */
    int64_t kt = one ? GK1 : GK, ot = fg_channels(a);
    int threes = a->kw == 3 && a->dw == 1 && a->sw == 1;   /* GK, GK1: multiples of 3 */
    for (int64_t img0 = job->first; img0 < job->last; img0 += group) {
        int64_t m = job->last - img0 < group ? job->last - img0 : group;
        for (int64_t g = 0; g < m; g++) {
            fill_buffer(a, img0 + g, buf + g * a->buf_size);
            fg_transpose(a->dout + (img0 + g) * a->o * plane, dt + g * dsize, a->o, plane,
                         opad);
        }
        for (int64_t o0 = 0; o0 < opad; o0 += ot)
            for (int64_t k0 = 0; k0 < a->k; k0 += kt) {
                if (one && threes)
                    fg_tile_one(a, buf, dt, m, dsize, opad, o0, k0, job->dw, 1);
                else if (one)
                    fg_tile_one(a, buf, dt, m, dsize, opad, o0, k0, job->dw, 0);
                else if (threes)
                    fg_tile(a, buf, dt, m, dsize, opad, o0, k0, job->dw, GV, GK, 1);
                else
                    fg_tile(a, buf, dt, m, dsize, opad, o0, k0, job->dw, GV, GK, 0);
            }
    }
    free(buf);
    free(dt);
    return NULL;
}

/* dw (O x C kh kw, zeroed by the caller) += the filter gradient of the conv
 * `dims` (relu unused) for dout (N, O, ho, wo). Returns 0, or 1 when memory
 * ran out (dw is then unchanged). */
int conv2d_filter_grad_f32(const float *x, const float *dout, float *dw, const int64_t *dims,
                           int64_t threads)
{
    conv_t a = {.x = x, .dout = dout};
    setup(&a, dims);
    if (!a.koff) return 1;
    threads = clamp_threads(threads, a.n);
    int64_t opad = fg_padded(&a), size = opad * a.k;
    float *sums = calloc(threads * size, sizeof(float));
    job_t jobs[MAX_THREADS];
    int failed = !sums;
    if (!failed) {
        for (int64_t t = 0; t < threads; t++)
            jobs[t] = (job_t){.a = &a, .first = t * a.n / threads,
                              .last = (t + 1) * a.n / threads, .dw = sums + t * size};
        failed = run_jobs(filter_grad_job, jobs, threads);
    }
    if (!failed)
        for (int64_t t = 0; t < threads; t++)
            for (int64_t oc = 0; oc < a.o; oc++)
                for (int64_t k = 0; k < a.k; k++) dw[oc * a.k + k] += sums[t * size + k * opad + oc];
    free(sums);
    free(a.koff);
    return failed;
}

#ifdef FG_NO_PREDICTIVE_COMMONING
#pragma GCC pop_options
#endif
