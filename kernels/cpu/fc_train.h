/* fc_train_f32, included by fc_native.c: fc_forward_f32's product (no bias, no relu)
 * on a weight an optimizer changes at every step, so never packed whole. A thread
 * packs a panel's block (at most FC_KC rows of FC_NR values, 64 KiB with AVX-512)
 * into one of its two buffers, which stay in L2, while its row tiles run on the block
 * packed before in the other: a share of the next block after each tile, so that the
 * packing's loads from memory overlap the tiles' arithmetic (w^T's block all after
 * the first tile: see run_train_unit). The tiles read a buffer as they read a packed
 * weight's block. Either side may be read transposed, for a training step's three
 * products of a layer: x @ w (the forward), dout @ w^T (the input gradient) and
 * x^T @ dout (the weight gradient); x is packed by row tiles as fc_forward_f32 packs
 * it (pack_rows reads the transpose's columns as rows). Each output is summed by one
 * thread in one order, block by block as fc_forward_f32 sums it: the same bits on any
 * number of threads. */

/* Rows q0 .. q1 of the block of columns p0 .. p0 + kc of the weight's panel j (rows
 * p0 + q of the product's right side, columns j FC_NR ..) into `block`, rows of FC_NR
 * values, zeros past column N; q0 a multiple of 8. The right side is w (K, N), or w^T
 * for w (N, K) where a->wt. */
static void pack_block(const fc_t *a, float *block, int64_t j, int64_t p0, int64_t q0,
                       int64_t q1)
{
    int64_t n0 = j * FC_NR, cols = a->n - n0 < FC_NR ? a->n - n0 : FC_NR;
    if (!a->wt) {
        const float *src = a->w + (p0 + q0) * a->n + n0;
        for (int64_t q = q0; q < q1; q++, src += a->n) {
            if (cols == FC_NR) {
                vf_store(block + q * FC_NR, vf_load(src));
                vf_store(block + q * FC_NR + VL, vf_load(src + VL));
                continue;
            }
            memcpy(block + q * FC_NR, src, (size_t)cols * sizeof(float));
            memset(block + q * FC_NR + cols, 0, (size_t)(FC_NR - cols) * sizeof(float));
        }
        return;
    }
    /* column c of the block is row n0 + c of w: 8 by 8 values transposed */
    int64_t q8 = q0 + (q1 - q0) / 8 * 8;
    for (int64_t c0 = 0; c0 < FC_NR; c0 += 8) {
        const float *src[8];
        for (int l = 0; l < 8; l++)
            src[l] = c0 + l < cols ? a->w + (n0 + c0 + l) * a->k + p0 : NULL;
        for (int64_t q = q0; q < q8; q += 8) {
            v8f r[8];
            for (int l = 0; l < 8; l++)
                r[l] = src[l] != NULL ? *(const v8fu *)(src[l] + q) : (v8f){0};
            transpose8(r);
            for (int t = 0; t < 8; t++) *(v8fu *)(block + (q + t) * FC_NR + c0) = r[t];
        }
        for (int64_t q = q8; q < q1; q++)
            for (int l = 0; l < 8; l++)
                block[q * FC_NR + c0 + l] = src[l] != NULL ? src[l][q] : 0.0f;
    }
}

/* The lines pack_block reads for rows q0 .. q1 of panel j's block from p0 (w not
 * transposed), prefetched into L2 while a tile runs: its rows of w lie N apart, and
 * with N a power of two they would fall into the same few sets of L1. */
static void prefetch_rows(const fc_t *a, int64_t j, int64_t p0, int64_t q0, int64_t q1)
{
    int64_t n0 = j * FC_NR, cols = a->n - n0 < FC_NR ? a->n - n0 : FC_NR;
    const float *src = a->w + (p0 + q0) * a->n + n0;
    for (int64_t q = q0; q < q1; q++, src += a->n) {
        __builtin_prefetch(src, 0, 2);
        __builtin_prefetch(src + cols - 1, 0, 2);
    }
}

/* run_unit for an unpacked weight: row tiles i0 .. i1 by panels j0 .. j1 in
 * run_unit's order, each (block, panel) packed into one of the two buffers at
 * `blocks` during the tiles of the one before. */
static void run_train_unit(const fc_t *a, float *blocks, int64_t j0, int64_t j1, int64_t i0,
                           int64_t i1)
{
    float *now = blocks, *next = blocks + FC_KC * FC_NR;
    pack_block(a, now, j0, 0, 0, a->k < a->kc ? a->k : a->kc);
    for (int64_t p0 = 0; p0 < a->k; p0 += a->kc) {
        int64_t kc = a->k - p0 < a->kc ? a->k - p0 : a->kc;
        for (int64_t j = j0; j < j1; j++) {
            int64_t next_j = j + 1 < j1 ? j + 1 : j0, next_p0 = j + 1 < j1 ? p0 : p0 + kc;
            int64_t next_kc = next_p0 >= a->k ? 0
                              : a->k - next_p0 < a->kc ? a->k - next_p0 : a->kc;
            /* w^T's block is packed in one go, after the first tile: its rows of w are
             * read along, and spread over the tiles the packing took longer */
            int64_t share = a->wt ? next_kc
                                  : ((next_kc + (i1 - i0) - 1) / (i1 - i0) + 7) / 8 * 8;
            for (int64_t i = i0; i < i1; i++) {
                int64_t q0 = (i - i0) * share, q1 = q0 + share < next_kc ? q0 + share : next_kc;
                if (!a->wt && q0 < q1) prefetch_rows(a, next_j, next_p0, q0, q1);
                tile(a, now, i, j, p0, kc);
                if (q0 < q1) pack_block(a, next, next_j, next_p0, q0, q1);
            }
            float *done = now;
            now = next;
            next = done;
        }
    }
}

/* out (M, N) float32 = A @ B, A = x (M, K) or, where xt, x^T for x (K, M); B = w (K, N)
 * or, where wt, w^T for w (N, K); all row-major and unpacked, M, N, K >= 1, on at
 * most `threads` threads. Returns 0, or 1 when its buffers could not be allocated
 * (out is then untouched). */
int fc_train_f32(const float *x, int64_t xt, const float *w, int64_t wt, float *out,
                 int64_t m, int64_t k, int64_t n, int64_t threads)
{
    fc_t a = {.x = x, .xt = xt, .w = w, .wt = wt, .out = out, .m = m, .k = k, .n = n};
    plan_units(&a, threads);
    size_t two = (size_t)2 * FC_KC * FC_NR;
    a.xp = malloc((size_t)(a.mp * k) * sizeof(float));
    float *blocks = aligned_alloc(64, (size_t)a.threads * two * sizeof(float));
    if (a.xp == NULL || blocks == NULL) {
        free(a.xp);
        free(blocks);
        return 1;
    }
    fc_job_t jobs[POOL_MAX_THREADS];
    for (int64_t t = 0; t < a.threads; t++) jobs[t] = (fc_job_t){&a, blocks + t * two};
    pool_run(multiply_job, jobs, sizeof(fc_job_t), a.threads);
    free(a.xp);
    free(blocks);
    return 0;
}
