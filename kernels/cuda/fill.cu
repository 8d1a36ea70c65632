// fill_constant and the random initialisers.
//
// fill_u{8,16,32,64}: every word of `out` = a bit pattern (the launcher turns
// the value into the dtype's bytes, so one kernel per word size serves every
// dtype). uniform / gaussian: a counter-based generator (Philox4x32-10,
// Salmon et al. 2011) keyed by the 64-bit seed; call i of the generator makes
// elements [i * P, i * P + P) (P = 4 for float, 2 for double), so the values
// depend on the seed and the index only, never on the launch configuration.
#include "common.cuh"
#include "philox.cuh"

namespace mg {

template <typename U>
__device__ void fill_words(U* out, long long n, U value) {
  const long long nt = global_threads();
  for (long long i = global_tid(); i < n; i += nt) out[i] = value;
}

// Uniforms in [0, 1): 24 random bits per float, 53 per double.
template <typename T>
struct Uniforms;
template <>
struct Uniforms<float> {
  static constexpr int per_call = 4;
  static __device__ __forceinline__ void make(const Philox4x32& r, double (&u)[4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j) u[j] = double(r.v[j] >> 8) * (1.0 / 16777216.0);
  }
};
template <>
struct Uniforms<double> {
  static constexpr int per_call = 2;
  static __device__ __forceinline__ void make(const Philox4x32& r, double (&u)[2]) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const unsigned long long bits =
          ((unsigned long long)(r.v[2 * j] >> 5) << 26) | (r.v[2 * j + 1] >> 6);
      u[j] = double(bits) * (1.0 / 9007199254740992.0);
    }
  }
};

template <typename T, bool GAUSSIAN>
__device__ void random_fill(T* out, long long n, unsigned long long seed, double a, double b) {
  constexpr int P = Uniforms<T>::per_call;
  const long long calls = (n + P - 1) / P, nt = global_threads();
  for (long long i = global_tid(); i < calls; i += nt) {
    double u[P];
    Uniforms<T>::make(philox((unsigned long long)i, GAUSSIAN ? 1u : 0u, seed), u);
    double v[P];
    if (GAUSSIAN) {       // Box-Muller on pairs; a = mean, b = std
#pragma unroll
      for (int j = 0; j < P; j += 2) {
        const double radius = sqrt(-2.0 * log(1.0 - u[j]));   // 1 - u in (0, 1]
        const double angle = 6.283185307179586 * u[j + 1];
        v[j] = a + b * radius * cos(angle);
        v[j + 1] = a + b * radius * sin(angle);
      }
    } else {              // a = low, b = high
#pragma unroll
      for (int j = 0; j < P; ++j) v[j] = a + (b - a) * u[j];
    }
#pragma unroll
    for (int j = 0; j < P; ++j)
      if (i * P + j < n) out[i * P + j] = T(v[j]);
  }
}

}  // namespace mg

extern "C" __global__ void fill_u8(unsigned char* out, long long n, unsigned value) {
  mg::fill_words<unsigned char>(out, n, (unsigned char)value);
}
extern "C" __global__ void fill_u16(unsigned short* out, long long n, unsigned value) {
  mg::fill_words<unsigned short>(out, n, (unsigned short)value);
}
extern "C" __global__ void fill_u32(unsigned* out, long long n, unsigned value) {
  mg::fill_words<unsigned>(out, n, value);
}
extern "C" __global__ void fill_u64(unsigned long long* out, long long n,
                                    unsigned long long value) {
  mg::fill_words<unsigned long long>(out, n, value);
}

#define MG_RANDOM_KERNELS(T, SFX)                                                            \
  extern "C" __global__ void uniform_##SFX(T* out, long long n, unsigned long long seed,    \
                                           double low, double high) {                       \
    mg::random_fill<T, false>(out, n, seed, low, high);                                     \
  }                                                                                          \
  extern "C" __global__ void gaussian_##SFX(T* out, long long n, unsigned long long seed,   \
                                            double mean, double std) {                      \
    mg::random_fill<T, true>(out, n, seed, mean, std);                                      \
  }

MG_RANDOM_KERNELS(float, f32)
MG_RANDOM_KERNELS(double, f64)
