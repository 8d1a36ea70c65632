/* The backward pass of attention_native.c's kernels (included by it; its DEFINE_KERNELS
 * defines the routines used here, and its DEFINE_BACKWARD_KERNELS expands this after it).
 *
 * Backward (FlashAttention-2's): a unit is one head and a range of key blocks; for
 * each key block its dK and dV are summed over the query blocks, with the
 * probabilities recomputed from the saved lse: P = exp(S - lse), dV += P'^T dO,
 * dP = (dO v^T) Z, dS = P (dP - D) with D = rowsum(dO * O), dQ += scale dS k,
 * dK += scale dS^T q (P' = P Z, Z the dropout's factors). With fewer heads than
 * threads a unit is one key block and each thread sums its dQ in a buffer of its
 * own, added up at the end; otherwise a unit is a whole head. */

#define DEFINE_WRITE_DQ(T, S)                                                             \
static void write_dq_##S(const att_t *a, int64_t hh, const T *acc)                        \
{                                                                                         \
    const int64_t *st = a->st, n = hh / a->h, h = hh % a->h;                              \
    T *dq = (T *)a->dq + n * st[S_DQ] + h * st[S_DQ + 1];                                 \
    for (int64_t i = 0; i < a->tq; i++)                                                   \
        memcpy(dq + i * st[S_DQ + 2], acc + i * a->dp, sizeof(T) * a->hd);                 \
}

#define DEFINE_BACKWARD_KERNELS(T, S, V, VU, VW, VI)                                       \
/* Head hh's q and dO rows packed (qp, dop) and D = rowsum(dO * O) (big_d). */            \
static void pack_rows_##S(const att_t *a, T **buf, int64_t hh)                            \
{                                                                                         \
    const int64_t *st = a->st;                                                            \
    const int64_t n = hh / a->h, h = hh % a->h, dp = a->dp, dvp = a->dvp;                 \
    T *qp = buf[7], *dop = buf[8], *big_d = buf[9];                                       \
    const T *q = (const T *)a->q + n * st[S_Q] + h * st[S_Q + 1];                         \
    const T *o = (const T *)a->o + n * st[S_O] + h * st[S_O + 1];                         \
    const T *dout = (const T *)a->dout + n * st[S_DO] + h * st[S_DO + 1];                 \
    for (int64_t i = 0; i < a->tq; i++) {                                                 \
        const T *qr = q + i * st[S_Q + 2], *orow = o + i * st[S_O + 2];                   \
        const T *dr = dout + i * st[S_DO + 2];                                            \
        memcpy(qp + i * dp, qr, sizeof(T) * a->hd);                                       \
        memset(qp + i * dp + a->hd, 0, sizeof(T) * (dp - a->hd));                         \
        memcpy(dop + i * dvp, dr, sizeof(T) * a->vd);                                     \
        memset(dop + i * dvp + a->vd, 0, sizeof(T) * (dvp - a->vd));                      \
        T sum = 0;                                                                        \
        for (int64_t c = 0; c < a->vd; c++) sum += dr[c] * orow[c];                       \
        big_d[i] = sum;                                                                   \
    }                                                                                     \
}                                                                                         \
                                                                                          \
/* Backward of head hh over key blocks kb0 .. kb1 (its rows packed by pack_rows);       \
 * dq_acc (tq x dp) gets scale dS k. */                                                   \
static void backward_unit_##S(att_t *a, T **buf, T *z, int64_t hh, int64_t kb0,           \
                              int64_t kb1, T *dq_acc)                                     \
{                                                                                         \
    const int64_t *st = a->st;                                                            \
    const int64_t n = hh / a->h, h = hh % a->h, dp = a->dp, dvp = a->dvp;                 \
    T *kt = buf[0], *kp = buf[1], *vt = buf[2], *s = buf[3], *dpm = buf[4];               \
    T *dk_acc = buf[5], *dv_acc = buf[6], *qp = buf[7], *dop = buf[8], *big_d = buf[9];   \
    const T *lse = (const T *)a->lse_in + hh * a->tq;                                     \
    const T scale = (T)a->scale;                                                          \
    for (int64_t kb = kb0; kb < kb1; kb++) {                                              \
        const int64_t j0 = kb * ATT_BC, kc = a->tk - j0 < ATT_BC ? a->tk - j0 : ATT_BC;   \
        pack_keys_##S(a, n, h, j0, kc, kt, kp, vt, NULL);                                 \
        memset(dk_acc, 0, sizeof(T) * ATT_BC * dp);                                       \
        memset(dv_acc, 0, sizeof(T) * ATT_BC * dvp);                                      \
        int64_t i_start = 0;                                                              \
        if (a->causal) {                                                                  \
            i_start = j0 - a->offset;                                                     \
            i_start = i_start < 0 ? 0 : i_start / ATT_BR * ATT_BR;                        \
        }                                                                                 \
        for (int64_t i0 = i_start; i0 < a->tq; i0 += ATT_BR) {                            \
            const int64_t rows = a->tq - i0 < ATT_BR ? a->tq - i0 : ATT_BR;               \
            mm_##S(rows, a->hd, ATT_BC, qp + i0 * dp, dp, 1, kt, ATT_BC, s, ATT_BC, 0);    \
            finish_scores_##S(a, n, h, i0, rows, j0, kc, s);                              \
            mm_##S(rows, a->vd, ATT_BC, dop + i0 * dvp, dvp, 1, vt, ATT_BC, dpm, ATT_BC, 0); \
            for (int64_t r = 0; r < rows; r++) {                                          \
                T *prow = s + r * ATT_BC, *drow = dpm + r * ATT_BC;                       \
                const T l = lse[i0 + r], dd = big_d[i0 + r];                              \
                if (l == (T)-INFINITY) {                                                  \
                    memset(prow, 0, sizeof(T) * ATT_BC);                                  \
                    memset(drow, 0, sizeof(T) * ATT_BC);                                  \
                    continue;                                                             \
                }                                                                         \
                exp_row_##S(prow, l);                                                     \
                if (a->p > 0) {                    /* past `last`, P is 0 already */     \
                    const int64_t last = row_keys(a, i0 + r, j0, kc);                     \
                    keep_factors_##S(a, (uint64_t)((hh * a->tq + i0 + r) * a->tk + j0), last, \
                                     z);                                                  \
                    for (int64_t c = 0; c < last; c++) {                                  \
                        const T zz = z[c], pp = prow[c];                                  \
                        drow[c] = pp * (drow[c] * zz - dd);          /* dS */             \
                        prow[c] = pp * zz;                           /* P' */             \
                    }                                                                     \
                    for (int64_t c = last; c < ATT_BC; c++) drow[c] = 0;                  \
                } else {                                                                  \
                    for (int64_t c = 0; c < ATT_BC; c++)                                  \
                        drow[c] = prow[c] * (drow[c] - dd);                               \
                }                                                                         \
                for (int64_t c = kc; c < ATT_BC; c++) drow[c] = 0;                        \
                if (a->ds) {                                                              \
                    T *dst = (T *)a->ds + (hh * a->tq + i0 + r) * a->tk + j0;             \
                    memcpy(dst, drow, sizeof(T) * kc);                                    \
                }                                                                         \
            }                                                                             \
            if (a->dv) /* dV += P'^T dO */                                                \
                mm_##S(kc, rows, dvp, s, 1, ATT_BC, dop + i0 * dvp, dvp, dv_acc, dvp, 1); \
            if (a->dk) /* dK += dS^T q (scaled at the end) */                             \
                mm_##S(kc, rows, dp, dpm, 1, ATT_BC, qp + i0 * dp, dp, dk_acc, dp, 1);    \
            if (dq_acc) { /* dQ += scale dS k */                                          \
                for (int64_t r = 0; r < rows; r++)                                        \
                    for (int64_t c = 0; c < kc; c++) dpm[r * ATT_BC + c] *= scale;        \
                mm_##S(rows, kc, dp, dpm, ATT_BC, 1, kp, dp, dq_acc + i0 * dp, dp, 1);    \
            }                                                                             \
        }                                                                                 \
        if (a->dk) {                                                                      \
            T *dk = (T *)a->dk + n * st[S_DK] + h * st[S_DK + 1] + j0 * st[S_DK + 2];     \
            for (int64_t j = 0; j < kc; j++)                                              \
                for (int64_t c = 0; c < a->hd; c++)                                        \
                    dk[j * st[S_DK + 2] + c] = dk_acc[j * dp + c] * scale;                \
        }                                                                                 \
        if (a->dv) {                                                                      \
            T *dv = (T *)a->dv + n * st[S_DV] + h * st[S_DV + 1] + j0 * st[S_DV + 2];     \
            for (int64_t j = 0; j < kc; j++)                                              \
                memcpy(dv + j * st[S_DV + 2], dv_acc + j * dvp, sizeof(T) * a->vd);       \
        }                                                                                 \
    }                                                                                     \
}                                                                                         \
                                                                                          \
static void *backward_job_##S(void *arg)                                                  \
{                                                                                         \
    att_job_t *job = arg;                                                                 \
    att_t *a = job->a;                                                                    \
    const int64_t dp = a->dp, dvp = a->dvp;                                               \
    const size_t sizes[10] = {dp * ATT_BC, dp * ATT_BC, dvp * ATT_BC, ATT_BR * ATT_BC,    \
                              ATT_BR * ATT_BC, ATT_BC * dp, ATT_BC * dvp, a->tq * dp,     \
                              a->tq * dvp, a->tq};                                        \
    T *buf[10];                                                                           \
    int ok = 1;                                                                           \
    for (int b = 0; b < 10; b++) ok &= (buf[b] = aligned_zeros(sizeof(T) * sizes[b])) != NULL; \
    T *z = aligned_zeros(sizeof(T) * ATT_BC);                                             \
    T *dq_local = NULL;                                                                   \
    if (a->dq && !a->split) ok &= (dq_local = aligned_zeros(sizeof(T) * a->tq * dp)) != NULL; \
    if (!ok || !z) {                                                                      \
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);                                \
    } else {                                                                              \
        int64_t packed = -1;                                                              \
        for (;;) {                                                                        \
            const int64_t unit = __atomic_fetch_add(&a->next, 1, __ATOMIC_RELAXED);       \
            if (unit >= a->units) break;                                                  \
            const int64_t hh = a->split ? unit / a->kblocks : unit;                       \
            if (hh != packed) {                                                           \
                pack_rows_##S(a, buf, hh);                                                \
                packed = hh;                                                              \
            }                                                                             \
            if (a->split) {                                                               \
                const int64_t kb = unit % a->kblocks;                                     \
                T *acc = a->dq ? (T *)job->dq_sum + hh * a->tq * dp : NULL;               \
                backward_unit_##S(a, buf, z, hh, kb, kb + 1, acc);                        \
            } else {                                                                      \
                if (dq_local) memset(dq_local, 0, sizeof(T) * a->tq * dp);                \
                backward_unit_##S(a, buf, z, unit, 0, a->kblocks, dq_local);              \
                if (dq_local) write_dq_##S(a, unit, dq_local);                            \
            }                                                                             \
        }                                                                                 \
    }                                                                                     \
    for (int b = 0; b < 10; b++) free(buf[b]);                                            \
    free(z);                                                                              \
    free(dq_local);                                                                       \
    return NULL;                                                                          \
}
