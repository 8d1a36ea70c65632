// Packing arrays into one flat buffer and back, for bucketed collectives.
//
// pack: flat[e] = the e-th value of the concatenation of up to 8 arrays.
// unpack_scaled: the reverse, every value times `factor` (the data-parallel
// gradient average: one allreduce of the packed buffer, then / world size on
// the way out; with one array it is a scaled copy). Array i covers flat
// elements [ends[i-1], ends[i]). One thread per element, grid-stride.
#include "common.cuh"

namespace mg {

constexpr int PACK_ARITY = 8;

__device__ __forceinline__ int which(long long e, int count, const long long* ends) {
  int i = 0;
  while (i + 1 < count && e >= ends[i]) ++i;
  return i;
}

template <typename T>
__device__ void pack(T* __restrict__ flat, long long total, int count,
                     const T* const* src, const long long* ends) {
  const long long nt = global_threads();
  for (long long e = global_tid(); e < total; e += nt) {
    const int i = which(e, count, ends);
    flat[e] = src[i][e - (i ? ends[i - 1] : 0)];
  }
}

template <typename T>
__device__ void unpack_scaled(const T* __restrict__ flat, long long total, int count,
                              double factor, T* const* dst, const long long* ends) {
  const long long nt = global_threads();
  for (long long e = global_tid(); e < total; e += nt) {
    const int i = which(e, count, ends);
    dst[i][e - (i ? ends[i - 1] : 0)] = T(double(flat[e]) * factor);
  }
}

}  // namespace mg

#define MG_PACK_ARGS(Q)                                                                        \
  Q p0, Q p1, Q p2, Q p3, Q p4, Q p5, Q p6, Q p7, long long e0, long long e1, long long e2,    \
      long long e3, long long e4, long long e5, long long e6, long long e7
#define MG_PACK_TABLE(Q)                                                                       \
  Q const p[mg::PACK_ARITY] = {p0, p1, p2, p3, p4, p5, p6, p7};                                \
  const long long ends[mg::PACK_ARITY] = {e0, e1, e2, e3, e4, e5, e6, e7}

#define MG_COLLECTIVE_KERNELS(T, SFX)                                                          \
  extern "C" __global__ void pack_##SFX(T* flat, long long total, int count,                  \
                                        MG_PACK_ARGS(const T*)) {                              \
    MG_PACK_TABLE(const T*);                                                                   \
    mg::pack<T>(flat, total, count, p, ends);                                                  \
  }                                                                                            \
  extern "C" __global__ void unpack_scaled_##SFX(const T* flat, long long total, int count,   \
                                                 double factor, MG_PACK_ARGS(T*)) {            \
    MG_PACK_TABLE(T*);                                                                         \
    mg::unpack_scaled<T>(flat, total, count, factor, p, ends);                                 \
  }

MG_COLLECTIVE_KERNELS(float, f32)
MG_COLLECTIVE_KERNELS(double, f64)
