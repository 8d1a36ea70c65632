// kv_cache_write (ops/kv_cache.py): a pass's rows into a KV cache's slab, and the
// filled rows out of it. A slab is (N, capacity, C), a pass (N, T, C), contiguous.
#include "common.cuh"

namespace mg {

// slab[b, offset + r, :] = src[b, r, :] for r < t.
template <typename T>
__device__ void kv_cache_put(const T* __restrict__ src, T* __restrict__ slab, long long n,
                             long long t, long long c, long long capacity, long long offset) {
  const long long total = n * t * c, nt = global_threads();
  for (long long e = global_tid(); e < total; e += nt) {
    const long long col = e % c, row = e / c, r = row % t, b = row / t;
    slab[(b * capacity + offset + r) * c + col] = src[e];
  }
}

// dst[b, r, :] = slab[b, r, :] for r < rows.
template <typename T>
__device__ void kv_cache_take(const T* __restrict__ slab, T* __restrict__ dst, long long n,
                              long long rows, long long c, long long capacity) {
  const long long total = n * rows * c, nt = global_threads();
  for (long long e = global_tid(); e < total; e += nt) {
    const long long col = e % c, row = e / c, r = row % rows, b = row / rows;
    dst[e] = slab[(b * capacity + r) * c + col];
  }
}

}  // namespace mg

#define MG_KV_CACHE_KERNELS(T, SFX)                                                          \
  extern "C" __global__ void kv_cache_put_##SFX(const T* src, T* slab, long long n,          \
                                                long long t, long long c,                    \
                                                long long capacity, long long offset) {      \
    mg::kv_cache_put<T>(src, slab, n, t, c, capacity, offset);                               \
  }                                                                                          \
  extern "C" __global__ void kv_cache_take_##SFX(const T* slab, T* dst, long long n,         \
                                                 long long rows, long long c,                \
                                                 long long capacity) {                       \
    mg::kv_cache_take<T>(slab, dst, n, rows, c, capacity);                                   \
  }

MG_KV_CACHE_KERNELS(float, f32)
MG_KV_CACHE_KERNELS(double, f64)
