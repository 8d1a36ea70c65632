// position_embedding (ops/position_embedding.py): out = x + w[offset + t] per position,
// and the table's gradient summed over the batch. x and out (N, T, D), w (P, D).
#include "common.cuh"

namespace mg {

template <typename T>
__device__ void position_embedding(const T* __restrict__ x, const T* __restrict__ w,
                                   T* __restrict__ out, long long n, long long t, long long d,
                                   long long offset) {
  const long long total = n * t * d, nt = global_threads();
  for (long long e = global_tid(); e < total; e += nt) {
    const long long col = e % d, r = (e / d) % t;
    out[e] = x[e] + w[(offset + r) * d + col];
  }
}

// dw[r, :] = sum over the batch of dout[b, r, :] for r < t (rows past t: the launcher's).
template <typename T>
__device__ void position_embedding_grad(const T* __restrict__ dout, T* __restrict__ dw,
                                        long long n, long long t, long long d) {
  const long long total = t * d, nt = global_threads();
  for (long long e = global_tid(); e < total; e += nt) {
    double sum = 0.0;
    for (long long b = 0; b < n; ++b) sum += double(dout[b * total + e]);
    dw[e] = T(sum);
  }
}

}  // namespace mg

#define MG_POSITION_KERNELS(T, SFX)                                                          \
  extern "C" __global__ void position_embedding_##SFX(const T* x, const T* w, T* out,        \
                                                      long long n, long long t, long long d, \
                                                      long long offset) {                    \
    mg::position_embedding<T>(x, w, out, n, t, d, offset);                                   \
  }                                                                                          \
  extern "C" __global__ void position_embedding_grad_##SFX(const T* dout, T* dw, long long n, \
                                                           long long t, long long d) {       \
    mg::position_embedding_grad<T>(dout, dw, n, t, d);                                       \
  }

MG_POSITION_KERNELS(float, f32)
MG_POSITION_KERNELS(double, f64)
