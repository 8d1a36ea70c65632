/* Native CPU kernel of a weight gradient's product (wgrad_native.py holds the
 * contract): float32 out (K, M) = x' d for x (R, K) and d (R, M), both row-major.
 *
 * A register tile is WG_KR rows of out (WG_KR adjacent columns of x) by two vectors of
 * native_simd.h's VL columns (a panel of d): each step down the rows adds WG_KR
 * broadcast values of x times the panel's two vectors, the tile's 2 WG_KR sums in
 * registers. The rows come in blocks of WG_RB. A unit of work is WG_TT tiles of rows
 * of out by WG_PP panels; for each block of rows it copies its columns of x into a
 * buffer (rows of a power-of-two length, read in place, would fall into a few sets of
 * L1 and evict each other), then, per panel, the panel's rows of d, and runs its tiles
 * on the two copies while they stay in L1. Between blocks a tile's sums go through
 * out, which changes no value (they are float32 in both).
 *
 * Threads take units from a shared counter. Every output is one thread's, summed over
 * the rows in their order with one multiply-add each, so the results do not depend
 * on the number of threads. OpenBLAS splits such a product (few outputs over a long
 * sum) badly: on two threads it ran (1024, 128)' (1024, 128) no faster than on one. */
#include <stdint.h>
#include <string.h>

#include "native_pool.h"
#include "native_simd.h"

#define WG_KR 6             /* rows of out per register tile */
#define WG_TT 6             /* tiles of rows of out per unit of work */
#define WG_PP 4             /* panels of 2 VL columns per unit of work */
#define WG_RB 64            /* rows of x and d per block */
#define WG_XS 48            /* the x buffer's row length: WG_TT WG_KR columns and
                                       zeros, whole vectors, not a power of two */
#define WG_L2_FLOATS (1 << 18)   /* x's and d's rows of a pass: at most 1 MiB */
#define WG_MAX_THREADS 64

typedef struct {
    const float *x, *d;
    float *out;
    int64_t r, k, m, tiles, panels, tile_units, units;
    int64_t r_begin, r_end;               /* this pass's rows (a block that stays in L2) */
    int64_t next;                         /* the shared counter of units */
} wg_t;

/* Rows k0 .. k0 + rows - 1 of out by columns m0 .. m0 + cols - 1 (at most 2 VL; PART:
 * fewer): the sums over a block's rows of xb (the tile's columns, row stride WG_XS)
 * times db (the panel, rows of 2 VL), added to what out holds unless `first`. */
static inline __attribute__((always_inline)) void wg_tile(
    const wg_t *a, int64_t k0, int rows, int64_t m0, int64_t cols, int64_t count,
    const float *xb, const float *db, int first, const int PART)
{
    const int64_t m = a->m;
    const int64_t c0 = cols < VL ? cols : VL, c1 = cols > VL ? cols - VL : 0;
    vf acc[WG_KR][2];
    for (int i = 0; i < WG_KR; i++) {
        const float *o = a->out + (k0 + (i < rows ? i : 0)) * m + m0;
        if (first) {
            acc[i][0] = acc[i][1] = (vf){0};
        } else {
            acc[i][0] = PART ? vf_load_part(o, c0) : vf_load(o);
            acc[i][1] = PART ? vf_load_part(o + VL, c1) : vf_load(o + VL);
        }
    }
    for (int64_t r = 0; r < count; r++, xb += WG_XS, db += 2 * VL) {
        vf b0 = vf_load(db), b1 = vf_load(db + VL);
#pragma GCC unroll 6
        for (int i = 0; i < WG_KR; i++) {
            acc[i][0] += xb[i] * b0;
            acc[i][1] += xb[i] * b1;
        }
    }
    for (int i = 0; i < rows; i++) {
        float *o = a->out + (k0 + i) * m + m0;
        if (PART) {
            vf_store_part(o, acc[i][0], c0);
            vf_store_part(o + VL, acc[i][1], c1);
        } else {
            vf_store(o, acc[i][0]);
            vf_store(o + VL, acc[i][1]);
        }
    }
}

/* Unit u: its tiles by its panels, block by block of rows. */
static void wg_unit(const wg_t *a, int64_t u, float *xb, float *db)
{
    int64_t t0 = u % a->tile_units * WG_TT, p0 = u / a->tile_units * WG_PP;
    int64_t t1 = t0 + WG_TT < a->tiles ? t0 + WG_TT : a->tiles;
    int64_t p1 = p0 + WG_PP < a->panels ? p0 + WG_PP : a->panels;
    int64_t c0 = t0 * WG_KR, ncols = (a->k < t1 * WG_KR ? a->k : t1 * WG_KR) - c0;
    for (int64_t r0 = a->r_begin; r0 < a->r_end; r0 += WG_RB) {
        int64_t count = a->r_end - r0 < WG_RB ? a->r_end - r0 : WG_RB;
        for (int64_t r = 0; r < count; r++) {          /* x's columns; zeros past K */
            const float *from = a->x + (r0 + r) * a->k + c0;
            for (int64_t j = 0; j < WG_XS; j += VL) {
                int64_t left = ncols - j > 0 ? ncols - j : 0;
                vf_store(xb + r * WG_XS + j,
                         left >= VL ? vf_load(from + j) : vf_load_part(from + j, left));
            }
        }
        for (int64_t p = p0; p < p1; p++) {
            int64_t m0 = p * 2 * VL, cols = a->m - m0 < 2 * VL ? a->m - m0 : 2 * VL;
            for (int64_t r = 0; r < count; r++) {      /* the panel; zeros past M */
                const float *from = a->d + (r0 + r) * a->m + m0;
                float *to = db + r * 2 * VL;
                if (cols == 2 * VL) {
                    vf_store(to, vf_load(from));
                    vf_store(to + VL, vf_load(from + VL));
                } else {
                    vf_store(to, vf_load_part(from, cols < VL ? cols : VL));
                    vf_store(to + VL, vf_load_part(from + VL, cols > VL ? cols - VL : 0));
                }
            }
            for (int64_t t = t0; t < t1; t++) {
                int64_t k0 = t * WG_KR;
                int rows = a->k - k0 < WG_KR ? (int)(a->k - k0) : WG_KR;
                const float *xt = xb + (k0 - c0);
                if (cols == 2 * VL)
                    wg_tile(a, k0, rows, m0, cols, count, xt, db, r0 == 0, 0);
                else
                    wg_tile(a, k0, rows, m0, cols, count, xt, db, r0 == 0, 1);
            }
        }
    }
}

static void *wg_job(void *arg)
{
    wg_t *a = *(wg_t **)arg;
    float xb[WG_RB * WG_XS] __attribute__((aligned(64)));
    float db[WG_RB * 2 * VL] __attribute__((aligned(64)));
    for (int64_t u; (u = __atomic_fetch_add(&a->next, 1, __ATOMIC_RELAXED)) < a->units;)
        wg_unit(a, u, xb, db);
    return NULL;
}

/* out (K, M) = x' d for x (R, K), d (R, M), on `threads` threads; R may be 0 (out is
 * then zeros). Returns 0. */
int wgrad_f32(const float *x, const float *d, float *out, int64_t r, int64_t k, int64_t m,
              int64_t threads)
{
    wg_t a = {.x = x, .d = d, .out = out, .r = r, .k = k, .m = m};
    if (k <= 0 || m <= 0) return 0;
    if (r <= 0) {
        memset(out, 0, (size_t)(k * m) * sizeof(float));
        return 0;
    }
    a.tiles = (k + WG_KR - 1) / WG_KR;
    a.panels = (m + 2 * VL - 1) / (2 * VL);
    a.tile_units = (a.tiles + WG_TT - 1) / WG_TT;
    a.units = a.tile_units * ((a.panels + WG_PP - 1) / WG_PP);
    threads = threads < 1 ? 1 : threads > WG_MAX_THREADS ? WG_MAX_THREADS : threads;
    if (threads > a.units) threads = a.units;
    wg_t *jobs[WG_MAX_THREADS];
    for (int64_t t = 0; t < threads; t++) jobs[t] = &a;
    /* passes over blocks of rows whose x and d fit in L2 together, one after the other */
    int64_t block = WG_L2_FLOATS / (k + m) / WG_RB * WG_RB;
    block = block < WG_RB ? WG_RB : block;
    for (a.r_begin = 0; a.r_begin < r; a.r_begin += block) {
        a.r_end = r - a.r_begin < block ? r : a.r_begin + block;
        a.next = 0;
        pool_run(wg_job, jobs, sizeof(wg_t *), threads);
    }
    return 0;
}
