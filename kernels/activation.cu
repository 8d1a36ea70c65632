// relu and its gradient, elementwise over flat arrays (16-byte packs when aligned).
#include "common.cuh"

namespace mg {

// out = max(x, 0); NaN stays NaN (as numpy's maximum).
template <typename T, int W>
__device__ void relu(const T* __restrict__ x, T* __restrict__ out, long long total) {
  flat_walk<W>(total, [&](long long u, auto width) {
    constexpr int K = decltype(width)::value;
    Pack<T, K> v = load_pack<T, K>(x, u);
#pragma unroll
    for (int j = 0; j < K; ++j) v.v[j] = (v.v[j] > T(0) || v.v[j] != v.v[j]) ? v.v[j] : T(0);
    store_pack<T, K>(out, u, v);
  });
}

// dx = dout where out > 0, else 0.
template <typename T, int W>
__device__ void relu_grad(const T* __restrict__ out, const T* __restrict__ dout,
                          T* __restrict__ dx, long long total) {
  flat_walk<W>(total, [&](long long u, auto width) {
    constexpr int K = decltype(width)::value;
    const Pack<T, K> o = load_pack<T, K>(out, u);
    Pack<T, K> d = load_pack<T, K>(dout, u);
#pragma unroll
    for (int j = 0; j < K; ++j) d.v[j] = o.v[j] > T(0) ? d.v[j] : T(0);
    store_pack<T, K>(dx, u, d);
  });
}

}  // namespace mg

#define MG_RELU_KERNELS(T, SFX, W)                                                         \
  extern "C" __global__ void relu_##SFX##_w##W(const T* x, T* out, long long total) {     \
    mg::relu<T, W>(x, out, total);                                                       \
  }                                                                                        \
  extern "C" __global__ void relu_grad_##SFX##_w##W(const T* out, const T* dout, T* dx,   \
                                                    long long total) {                   \
    mg::relu_grad<T, W>(out, dout, dx, total);                                           \
  }

MG_RELU_KERNELS(float, f32, 1)
MG_RELU_KERNELS(float, f32, 4)
MG_RELU_KERNELS(double, f64, 1)
MG_RELU_KERNELS(double, f64, 2)
