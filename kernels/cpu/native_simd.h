/* The vector width of the native kernels that use it, from the build target (native.py
 * builds with -march=native): VL floats a vector, 16 where the target has AVX-512
 * (zmm registers, 32 of them), else 8 (AVX2's ymm, or whatever the compiler makes of
 * 32-byte vectors elsewhere). `vf` is a vector of VL floats, `vfu` the same read or
 * written at any float's address, `vfi` VL ints (comparison masks).
 *
 * vf_load_part / vf_store_part read and write the first `count` (< VL) lanes only: the
 * ragged end of a row, without scalar loops (AVX-512 and AVX2 masked moves; a copy
 * through a buffer elsewhere). Lanes past `count` read as zeros. v8f and its
 * v8f_load_part / v8f_store_part: the same for vectors of 8 floats, whatever VL is.
 * copy_every_other: a row's values at stride 2 into a dense row. */
#ifndef NATIVE_SIMD_H
#define NATIVE_SIMD_H
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define VL 16
#else
#define VL 8
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef float vfu __attribute__((vector_size(VL * 4), aligned(4)));
typedef int vfi __attribute__((vector_size(VL * 4)));

/* vd: VD doubles, the widest double vector the target holds in one register (8 with
 * AVX-512, 4 otherwise; vdu: read or written at any double's address); vfh: VD floats.
 * vd_of_floats widens VD floats. A wider generic vector, such as 8 doubles with AVX2,
 * is lowered through the stack at every operation (kernels ran 2.5-10x slower). */
#define VD (VL / 2)
typedef double vd __attribute__((vector_size(VD * 8)));
typedef double vdu __attribute__((vector_size(VD * 8), aligned(8)));
typedef float vfh __attribute__((vector_size(VD * 4)));
typedef float vfhu __attribute__((vector_size(VD * 4), aligned(4)));
static inline vd vd_of_floats(const float *p) { return __builtin_convertvector(*(const vfhu *)p, vd); }

/* VL, for the launchers and tests (native.vector_floats) */
int64_t native_vector_floats(void) { return VL; }

static inline vf vf_load(const float *p) { return *(const vfu *)p; }
static inline void vf_store(float *p, vf v) { *(vfu *)p = v; }

/* relu on a vector: max(v, 0), a NaN staying NaN (comparisons with NaN are false) */
static inline vf vf_relu(vf v) { return (vf)((vfi)v & ~(v < 0)); }

/* The same for vectors of 8 floats whatever VL is (kernels whose tiles are 8 wide). */
typedef float v8f __attribute__((vector_size(32)));
typedef float v8fu __attribute__((vector_size(32), aligned(4)));

/* Lanes of a and b (0-7 a's, 8-15 b's), by the builtin this compiler has. */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define V8_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int v8fi __attribute__((vector_size(32)));
#define V8_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (v8fi){__VA_ARGS__})
#endif

/* r[0..7] transposed in place: r[j][i] = old r[i][j]. */
static inline __attribute__((always_inline)) void transpose8(v8f r[8])
{
    v8f t[8], s[8];
    for (int k = 0; k < 8; k += 2) {
        t[k] = V8_SHUFFLE(r[k], r[k + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[k + 1] = V8_SHUFFLE(r[k], r[k + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int k = 0; k < 8; k += 4)
        for (int h = 0; h < 2; h++) {
            s[k + 2 * h] = V8_SHUFFLE(t[k + h], t[k + h + 2], 0, 1, 8, 9, 4, 5, 12, 13);
            s[k + 2 * h + 1] = V8_SHUFFLE(t[k + h], t[k + h + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        }
    for (int k = 0; k < 4; k++) {
        r[k] = V8_SHUFFLE(s[k], s[k + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        r[k + 4] = V8_SHUFFLE(s[k], s[k + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    }
}

/* r[0 .. VL) transposed in place: r[j][i] = old r[i][j]. With AVX-512, 16 x 16 in four
 * rounds of shuffles: pairs of rows interleaved, then pairs of those, then 128-bit
 * lanes exchanged twice. */
static inline __attribute__((always_inline)) void vf_transpose(vf r[VL])
{
#if VL == 16
    __m512 a[16], b[16];
    for (int k = 0; k < 16; k += 2) {
        a[k] = _mm512_unpacklo_ps((__m512)r[k], (__m512)r[k + 1]);
        a[k + 1] = _mm512_unpackhi_ps((__m512)r[k], (__m512)r[k + 1]);
    }
#define PAIRS(HALF, x, y) _mm512_castpd_ps(_mm512_unpack##HALF##_pd(_mm512_castps_pd(x), \
                                                                   _mm512_castps_pd(y)))
    for (int g = 0; g < 16; g += 4) {     /* b[g + m], lane L: column 4 L + m of rows g .. g + 3 */
        b[g] = PAIRS(lo, a[g], a[g + 2]);
        b[g + 1] = PAIRS(hi, a[g], a[g + 2]);
        b[g + 2] = PAIRS(lo, a[g + 1], a[g + 3]);
        b[g + 3] = PAIRS(hi, a[g + 1], a[g + 3]);
    }
#undef PAIRS
    for (int m = 0; m < 4; m++) {
        const __m512 c0 = _mm512_shuffle_f32x4(b[m], b[4 + m], 0x44);
        const __m512 c1 = _mm512_shuffle_f32x4(b[m], b[4 + m], 0xEE);
        const __m512 c2 = _mm512_shuffle_f32x4(b[8 + m], b[12 + m], 0x44);
        const __m512 c3 = _mm512_shuffle_f32x4(b[8 + m], b[12 + m], 0xEE);
        r[m] = (vf)_mm512_shuffle_f32x4(c0, c2, 0x88);
        r[4 + m] = (vf)_mm512_shuffle_f32x4(c0, c2, 0xDD);
        r[8 + m] = (vf)_mm512_shuffle_f32x4(c1, c3, 0x88);
        r[12 + m] = (vf)_mm512_shuffle_f32x4(c1, c3, 0xDD);
    }
#else
    transpose8((v8f *)r);
#endif
}

#if defined(__AVX2__)
static inline __m256i v8f_lanes_below(int64_t count)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)count),
                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static inline v8f v8f_load_part(const float *p, int64_t count)
{
    return (v8f)_mm256_maskload_ps(p, v8f_lanes_below(count));
}

static inline void v8f_store_part(float *p, v8f v, int64_t count)
{
    _mm256_maskstore_ps(p, v8f_lanes_below(count), (__m256)v);
}
#else
static inline v8f v8f_load_part(const float *p, int64_t count)
{
    float lanes[8] = {0};
    memcpy(lanes, p, (size_t)count * sizeof(float));
    return *(const v8fu *)lanes;
}

static inline void v8f_store_part(float *p, v8f v, int64_t count)
{
    float lanes[8];
    *(v8fu *)lanes = v;
    memcpy(p, lanes, (size_t)count * sizeof(float));
}
#endif

#if defined(__AVX512F__)
static inline vf vf_load_part(const float *p, int64_t count)
{
    return (vf)_mm512_maskz_loadu_ps((__mmask16)((1u << count) - 1), p);
}

static inline void vf_store_part(float *p, vf v, int64_t count)
{
    _mm512_mask_storeu_ps(p, (__mmask16)((1u << count) - 1), (__m512)v);
}
#elif defined(__AVX2__)
static inline vf vf_load_part(const float *p, int64_t count)
{
    return (vf)v8f_load_part(p, count);
}

static inline void vf_store_part(float *p, vf v, int64_t count)
{
    v8f_store_part(p, (v8f)v, count);
}
#else
static inline vf vf_load_part(const float *p, int64_t count)
{
    float lanes[VL] = {0};
    memcpy(lanes, p, (size_t)count * sizeof(float));
    return vf_load(lanes);
}

static inline void vf_store_part(float *p, vf v, int64_t count)
{
    float lanes[VL];
    vf_store(lanes, v);
    memcpy(p, lanes, (size_t)count * sizeof(float));
}
#endif

/* dst[x] = from[2 x] for x < count, reading nothing past from[2 count - 2]. With
 * AVX-512, 16 at a time: the even lanes of two loads, masked in the last block (the
 * compiler leaves the loop scalar). */
static inline void copy_every_other(float *dst, const float *from, int64_t count)
{
    int64_t x = 0;
#if defined(__AVX512F__)
    const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                           28, 30);
    for (; x + 16 < count; x += 16)
        _mm512_storeu_ps(dst + x, _mm512_permutex2var_ps(_mm512_loadu_ps(from + 2 * x), even,
                                                         _mm512_loadu_ps(from + 2 * x + 16)));
    if (x < count) {
        int64_t rest = count - x, n = 2 * rest - 1;          /* 1..16 values, 1..31 reads */
        __m512 lo = _mm512_maskz_loadu_ps((__mmask16)(n >= 16 ? 0xFFFFu : (1u << n) - 1),
                                          from + 2 * x);
        __m512 hi = _mm512_maskz_loadu_ps((__mmask16)(n > 16 ? (1u << (n - 16)) - 1 : 0),
                                          from + 2 * x + 16);
        _mm512_mask_storeu_ps(dst + x, (__mmask16)((1u << rest) - 1),
                              _mm512_permutex2var_ps(lo, even, hi));
        return;
    }
#endif
    for (; x < count; x++) dst[x] = from[2 * x];
}
#endif
