// Philox4x32-10 (Salmon et al. 2011, Random123), the counter-based generator of
// the random initialisers (fill.cu) and of dropout's masks (dropout.cu):
// philox(counter, stream, seed) maps its arguments onto the counter words
// (counter low, counter high, stream, 0) and the key (seed low, seed high).
// kernels/cpu/philox.py is the same generator in numpy, bit for bit.
#pragma once

namespace mg {

struct Philox4x32 {
  unsigned v[4];
};

__device__ __forceinline__ Philox4x32 philox(unsigned long long counter, unsigned stream,
                                             unsigned long long seed) {
  const unsigned M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
  unsigned c0 = unsigned(counter), c1 = unsigned(counter >> 32), c2 = stream, c3 = 0u;
  unsigned k0 = unsigned(seed), k1 = unsigned(seed >> 32);
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const unsigned long long p0 = (unsigned long long)M0 * c0;
    const unsigned long long p1 = (unsigned long long)M1 * c2;
    const unsigned hi0 = unsigned(p0 >> 32), lo0 = unsigned(p0);
    const unsigned hi1 = unsigned(p1 >> 32), lo1 = unsigned(p1);
    c0 = hi1 ^ c1 ^ k0;
    c1 = lo1;
    c2 = hi0 ^ c3 ^ k1;
    c3 = lo0;
    k0 += W0;
    k1 += W1;
  }
  return Philox4x32{{c0, c1, c2, c3}};
}

}  // namespace mg
