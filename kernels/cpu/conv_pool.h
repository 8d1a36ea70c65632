/* The 2x2 max pooling of fused_conv2d's pool (included by conv_native.c, before its
 * forward job; conv_winograd.h uses it too): an image's conv outputs, in the thread's
 * own planes while they are in cache, to the pooled output, with pool2d's bits (the
 * max of the two rows, then of the two neighbours, NaN propagating: pool_native.c's
 * order and rule). */

/* numpy's maximum lane by lane, NaN when either is NaN: a where a > b or a is NaN */
static inline v8 max_nan8(v8 a, v8 b)
{
    v8i mask = (a > b) | (a != a);
    return (v8)(((v8i)a & mask) | ((v8i)b & ~mask));
}

/* Eight windows' max from the 16 columns of their top and bottom rows. */
static inline v8 pool8(v8 t0, v8 t1, v8 b0, v8 b1)
{
    v8 m0 = max_nan8(t0, b0), m1 = max_nan8(t1, b1);
    return max_nan8(__builtin_shufflevector(m0, m1, 0, 2, 4, 6, 8, 10, 12, 14),
                    __builtin_shufflevector(m0, m1, 1, 3, 5, 7, 9, 11, 13, 15));
}

/* Channels [c0, c1) of one image's outputs `y` (planes of h x w) to `out` (planes of
 * h / 2 x w / 2): the max of each 2x2 window at stride 2, pool_native.c's way (the max
 * of the two rows, then of the two neighbours, NaN propagating), eight windows at a
 * time from 16 columns of their two rows (a row's last ones through masked moves;
 * planes 8 wide: two output rows of 4 windows at a time). */
static void pool_planes(const float *y, float *out, int64_t c0, int64_t c1, int64_t h,
                        int64_t w)
{
    const int64_t ho = h / 2, wo = w / 2;
    for (int64_t c = c0; c < c1; c++) {
        int64_t r = 0;
        if (w == 8)
            for (; r + 2 <= ho; r += 2) {
                const float *top = y + (c * h + 2 * r) * w;
                *(v8u *)(out + (c * ho + r) * wo) = pool8(load(top), load(top + 2 * w),
                                                          load(top + w), load(top + 3 * w));
            }
        for (; r < ho; r++) {
            const float *top = y + (c * h + 2 * r) * w, *bottom = top + w;
            float *o = out + (c * ho + r) * wo;
            int64_t q = 0;
            for (; q + 8 <= wo; q += 8)
                *(v8u *)(o + q) = pool8(load(top + 2 * q), load(top + 2 * q + 8),
                                        load(bottom + 2 * q), load(bottom + 2 * q + 8));
            if (q < wo) {
                int64_t left = wo - q, lo = 2 * left < 8 ? 2 * left : 8, hi = 2 * left - lo;
                v8f_store_part(o + q, pool8(v8f_load_part(top + 2 * q, lo),
                                            v8f_load_part(top + 2 * q + 8, hi),
                                            v8f_load_part(bottom + 2 * q, lo),
                                            v8f_load_part(bottom + 2 * q + 8, hi)), left);
            }
        }
    }
}
