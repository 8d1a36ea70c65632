// sgd and momentum updates, in place, with the learning rate read on the
// device from a one-element array (float or double, whatever the param's dtype).
//
// sgd:      param -= lr * grad
// momentum: velocity = mu * velocity + grad; param -= lr * (velocity, or
//           grad + mu * velocity with nesterov). Arithmetic in the param's dtype.
#include "common.cuh"

namespace mg {

template <typename T, typename L, int W>
__device__ void sgd(T* param, const T* __restrict__ grad, const L* lr, long long total) {
  const T rate = T(lr[0]);
  flat_walk<W>(total, [&](long long u, auto width) {
    constexpr int K = decltype(width)::value;
    Pack<T, K> p = load_pack<T, K>(param, u);
    const Pack<T, K> g = load_pack<T, K>(grad, u);
#pragma unroll
    for (int j = 0; j < K; ++j) p.v[j] -= g.v[j] * rate;
    store_pack<T, K>(param, u, p);
  });
}

template <typename T, typename L, int W>
__device__ void momentum(T* param, const T* __restrict__ grad, T* velocity, const L* lr,
                         long long total, double mu_d, int nesterov) {
  const T rate = T(lr[0]), mu = T(mu_d);
  flat_walk<W>(total, [&](long long u, auto width) {
    constexpr int K = decltype(width)::value;
    Pack<T, K> p = load_pack<T, K>(param, u);
    Pack<T, K> v = load_pack<T, K>(velocity, u);
    const Pack<T, K> g = load_pack<T, K>(grad, u);
#pragma unroll
    for (int j = 0; j < K; ++j) {
      v.v[j] = mu * v.v[j] + g.v[j];
      const T step = nesterov ? g.v[j] + mu * v.v[j] : v.v[j];
      p.v[j] -= rate * step;
    }
    store_pack<T, K>(velocity, u, v);
    store_pack<T, K>(param, u, p);
  });
}

}  // namespace mg

#define MG_UPDATE_KERNELS(T, SFX, L, LSFX, W)                                                  \
  extern "C" __global__ void sgd_##SFX##_lr##LSFX##_w##W(T* param, const T* grad, const L* lr, \
                                                         long long total) {                    \
    mg::sgd<T, L, W>(param, grad, lr, total);                                                  \
  }                                                                                            \
  extern "C" __global__ void momentum_##SFX##_lr##LSFX##_w##W(                                 \
      T* param, const T* grad, T* velocity, const L* lr, long long total, double mu,          \
      int nesterov) {                                                                          \
    mg::momentum<T, L, W>(param, grad, velocity, lr, total, mu, nesterov);                     \
  }

MG_UPDATE_KERNELS(float, f32, float, f32, 1)
MG_UPDATE_KERNELS(float, f32, float, f32, 4)
MG_UPDATE_KERNELS(float, f32, double, f64, 1)
MG_UPDATE_KERNELS(float, f32, double, f64, 4)
MG_UPDATE_KERNELS(double, f64, float, f32, 1)
MG_UPDATE_KERNELS(double, f64, float, f32, 2)
MG_UPDATE_KERNELS(double, f64, double, f64, 1)
MG_UPDATE_KERNELS(double, f64, double, f64, 2)
