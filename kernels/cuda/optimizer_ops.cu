// sgd and momentum updates, in place, with the learning rate read on the
// device from a one-element array (float or double, whatever the param's dtype).
//
// With d = grad + weight_decay * param (L2; d = grad when weight_decay is 0):
// sgd:      param -= lr * d
// momentum: velocity = mu * velocity + d; param -= lr * (velocity, or
//           d + mu * velocity with nesterov). Arithmetic in the param's dtype. mu is
//           read on the device from mu_ptr when it is given (a cycled momentum).
// adam:     Adam / AdamW (ops/adam.py): the float64 beta powers are multiplied
//           by the betas in double; every thread reads the old powers, and the
//           last block to finish (a ticket) writes the new ones back. Scalars in
//           double, rounded to the param's dtype once; per element, in that dtype:
//           decoupled: param *= 1 - lr * wd, else g = grad + wd * param;
//           m += (1 - beta1) * (g - m); v = v * beta2 + (1 - beta2) * g * g;
//           param -= lr / (1 - beta1_pow) * m / (sqrt(v) / sqrt(1 - beta2_pow) + eps).
//           With beta1_ptr and step_ptr given (a cycled beta1), beta1 is read there
//           and the new beta1_pow is beta1 ^ step (torch's bias correction).
#include "common.cuh"

namespace mg {

template <typename T>
__device__ __forceinline__ T decayed(T g, T p, T decay, bool use_decay) {
  return use_decay ? g + decay * p : g;
}

template <typename T, typename L, int W>
__device__ void sgd(T* param, const T* __restrict__ grad, const L* lr, long long total,
                    double wd) {
  const T rate = T(lr[0]), decay = T(wd);
  const bool use_decay = wd != 0.0;
  flat_walk<W>(total, [&](long long u, auto width) {
    constexpr int K = decltype(width)::value;
    Pack<T, K> p = load_pack<T, K>(param, u);
    const Pack<T, K> g = load_pack<T, K>(grad, u);
#pragma unroll
    for (int j = 0; j < K; ++j) p.v[j] -= decayed(g.v[j], p.v[j], decay, use_decay) * rate;
    store_pack<T, K>(param, u, p);
  });
}

template <typename T, typename L, int W>
__device__ void momentum(T* param, const T* __restrict__ grad, T* velocity, const L* lr,
                         long long total, double mu_d, int nesterov, double wd,
                         const double* mu_ptr) {
  const T rate = T(lr[0]), mu = T(mu_ptr != nullptr ? mu_ptr[0] : mu_d), decay = T(wd);
  const bool use_decay = wd != 0.0;
  flat_walk<W>(total, [&](long long u, auto width) {
    constexpr int K = decltype(width)::value;
    Pack<T, K> p = load_pack<T, K>(param, u);
    Pack<T, K> v = load_pack<T, K>(velocity, u);
    const Pack<T, K> g = load_pack<T, K>(grad, u);
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const T d = decayed(g.v[j], p.v[j], decay, use_decay);
      v.v[j] = mu * v.v[j] + d;
      const T step = nesterov ? d + mu * v.v[j] : v.v[j];
      p.v[j] -= rate * step;
    }
    store_pack<T, K>(velocity, u, v);
    store_pack<T, K>(param, u, p);
  });
}

template <typename T, typename L, int W>
__device__ void adam(T* param, const T* __restrict__ grad, T* m1, T* m2, double* beta1_pow,
                     double* beta2_pow, const L* lr, unsigned* tickets, long long total,
                     double beta1_d, double beta2, double eps, double wd, int decoupled,
                     const double* beta1_ptr, const long long* step_ptr) {
  const double beta1 = beta1_ptr != nullptr ? beta1_ptr[0] : beta1_d;
  const double new1 = beta1_ptr != nullptr ? pow(beta1, double(step_ptr[0]))
                                           : beta1_pow[0] * beta1;
  const double new2 = beta2_pow[0] * beta2;
  const double rate = double(lr[0]);
  const T keep = T(1.0 - rate * wd), decay = T(wd), c1 = T(1.0 - beta1), b2 = T(beta2);
  const T c2 = T(1.0 - beta2), bias2 = T(sqrt(1.0 - new2)), epsilon = T(eps);
  const T step = T(rate / (1.0 - new1));
  const bool l2 = !decoupled && wd != 0.0;
  flat_walk<W>(total, [&](long long u, auto width) {
    constexpr int K = decltype(width)::value;
    Pack<T, K> p = load_pack<T, K>(param, u);
    Pack<T, K> m = load_pack<T, K>(m1, u);
    Pack<T, K> v = load_pack<T, K>(m2, u);
    const Pack<T, K> g = load_pack<T, K>(grad, u);
#pragma unroll
    for (int j = 0; j < K; ++j) {
      T gj = g.v[j];
      if (decoupled) p.v[j] = p.v[j] * keep;
      else if (l2) gj = gj + decay * p.v[j];
      m.v[j] = m.v[j] + c1 * (gj - m.v[j]);
      v.v[j] = v.v[j] * b2 + c2 * gj * gj;
      const T denom = sqrt(v.v[j]) / bias2 + epsilon;
      p.v[j] = p.v[j] - step * m.v[j] / denom;
    }
    store_pack<T, K>(m1, u, m);
    store_pack<T, K>(m2, u, v);
    store_pack<T, K>(param, u, p);
  });
  if (arrive_last(tickets, 0, gridDim.x) && flat_tid() == 0) {
    beta1_pow[0] = new1;
    beta2_pow[0] = new2;
  }
}

}  // namespace mg

#define MG_UPDATE_KERNELS(T, SFX, L, LSFX, W)                                                  \
  extern "C" __global__ void sgd_##SFX##_lr##LSFX##_w##W(T* param, const T* grad, const L* lr, \
                                                         long long total, double wd) {         \
    mg::sgd<T, L, W>(param, grad, lr, total, wd);                                               \
  }                                                                                            \
  extern "C" __global__ void momentum_##SFX##_lr##LSFX##_w##W(                                 \
      T* param, const T* grad, T* velocity, const L* lr, long long total, double mu,          \
      int nesterov, double wd, const double* mu_ptr) {                                         \
    mg::momentum<T, L, W>(param, grad, velocity, lr, total, mu, nesterov, wd, mu_ptr);         \
  }                                                                                            \
  extern "C" __global__ void adam_##SFX##_lr##LSFX##_w##W(                                     \
      T* param, const T* grad, T* m1, T* m2, double* beta1_pow, double* beta2_pow,            \
      const L* lr, unsigned* tickets, long long total, double beta1, double beta2,           \
      double eps, double wd, int decoupled, const double* beta1_ptr,                         \
      const long long* step_ptr) {                                                            \
    mg::adam<T, L, W>(param, grad, m1, m2, beta1_pow, beta2_pow, lr, tickets, total, beta1,   \
                      beta2, eps, wd, decoupled, beta1_ptr, step_ptr);                         \
  }

MG_UPDATE_KERNELS(float, f32, float, f32, 1)
MG_UPDATE_KERNELS(float, f32, float, f32, 4)
MG_UPDATE_KERNELS(float, f32, double, f64, 1)
MG_UPDATE_KERNELS(float, f32, double, f64, 4)
MG_UPDATE_KERNELS(double, f64, float, f32, 1)
MG_UPDATE_KERNELS(double, f64, float, f32, 2)
MG_UPDATE_KERNELS(double, f64, double, f64, 1)
MG_UPDATE_KERNELS(double, f64, double, f64, 2)
