/* Philox4x32-10 words for attention_native.c's dropout (included by it): the draw of
 * dropout_native.c and the GPU's, PHX_LANES calls at a time. */
#include <stdint.h>
#include <string.h>

#define PHX_LANES 8              /* Philox calls computed side by side */

typedef uint64_t vu64 __attribute__((vector_size(32)));

/* The 64-bit products of lanes holding 32-bit words: one unsigned 32 x 32 multiply a
 * lane where the target has AVX2 (a vector `*` of 64-bit lanes is a full 64 x 64
 * multiply, several times slower: the compiler cannot know the high halves are 0). */
/* Lanes of a and b (0-3 a's, 4-7 b's), by the builtin this compiler has. */
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define PHX_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
typedef int64_t vi64x4 __attribute__((vector_size(32)));
#define PHX_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vi64x4){__VA_ARGS__})
#endif

#if defined(__AVX2__)
#include <immintrin.h>
#define PHX_MUL(a, b) ((vu64)_mm256_mul_epu32((__m256i)(a), (__m256i)(b)))
#else
#define PHX_MUL(a, b) ((a) * (b))
#endif

/* The words of Philox4x32-10 calls call0 .. call0 + PHX_LANES - 1 (counter (call low,
 * call high, stream, 0), key (k0, k1)), in order: w[4 l + k] is word k of call0 + l. The
 * calls run side by side in 64-bit lanes holding 32-bit words, so each round's products
 * are vector multiplies. */
static void philox_lanes(uint64_t call0, uint32_t stream, uint32_t k0, uint32_t k1,
                         uint32_t *w)
{
    const vu64 zero = {0};
    const vu64 low = zero + 0xFFFFFFFFu, m0 = zero + 0xD2511F53u, m1 = zero + 0xCD9E8D57u;
    vu64 c0[2], c1[2], c2[2], c3[2];
    for (int h = 0; h < 2; h++) {
        for (int l = 0; l < 4; l++) {
            const uint64_t call = call0 + (uint64_t)(4 * h + l);
            c0[h][l] = call & 0xFFFFFFFFu;
            c1[h][l] = call >> 32;
        }
        c2[h] = zero + stream;
        c3[h] = zero;
    }
    vu64 key0 = zero + k0, key1 = zero + k1;
    for (int r = 0; r < 10; r++) {
        for (int h = 0; h < 2; h++) {
            const vu64 p0 = PHX_MUL(c0[h], m0), p1 = PHX_MUL(c2[h], m1);
            const vu64 n0 = (p1 >> 32) ^ c1[h] ^ key0, n2 = (p0 >> 32) ^ c3[h] ^ key1;
            c1[h] = p1 & low;
            c3[h] = p0 & low;
            c0[h] = n0;
            c2[h] = n2;
        }
        key0 = (key0 + 0x9E3779B9u) & low;
        key1 = (key1 + 0xBB67AE85u) & low;
    }
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    for (int h = 0; h < 2; h++) {       /* words 0, 1 and 2, 3 of a call as one 64-bit lane */
        const vu64 a = c0[h] | (c1[h] << 32), b = c2[h] | (c3[h] << 32);
        const vu64 first = PHX_SHUFFLE(a, b, 0, 4, 1, 5), last = PHX_SHUFFLE(a, b, 2, 6, 3, 7);
        memcpy(w + 16 * h, &first, sizeof first);
        memcpy(w + 16 * h + 8, &last, sizeof last);
    }
#else
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 4; l++) {
            uint32_t *out = w + 4 * (4 * h + l);
            out[0] = (uint32_t)c0[h][l];
            out[1] = (uint32_t)c1[h][l];
            out[2] = (uint32_t)c2[h][l];
            out[3] = (uint32_t)c3[h][l];
        }
#endif
}
