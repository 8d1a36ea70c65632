// sigmoid_cross_entropy_with_logits and its gradients, elementwise in double:
//   out = max(x, 0) - x * label + log1p(exp(-|x|))
//   dx = dout * (sigmoid(x) - label),  dlabel = -dout * x
// out and dlabel are maps (kernels/cuda/map.py); dx reads three operands.
#include "map.cuh"

namespace mg {

__device__ __forceinline__ double bce(double x, double label) {
  return (x > 0.0 ? x : 0.0) - x * label + log1p(exp(-fabs(x)));
}

// 1 / (1 + exp(-x)) from e = exp(-|x|), so that nothing overflows.
__device__ __forceinline__ double stable_sigmoid(double x) {
  const double e = exp(-fabs(x));
  return (x >= 0.0 ? 1.0 : e) / (1.0 + e);
}

template <typename T>
__device__ void bce_grad_x(const T* __restrict__ x, const T* __restrict__ label,
                           const T* __restrict__ dout, T* __restrict__ dx, long long total) {
  for (long long e = global_tid(); e < total; e += global_threads())
    dx[e] = T(double(dout[e]) * (stable_sigmoid(double(x[e])) - double(label[e])));
}

}  // namespace mg

MG_BINARY_MAP(bce, x, label, T(mg::bce(double(x), double(label))))
MG_BINARY_MAP(bce_grad_label, x, dout, T(-double(dout) * double(x)))

#define MG_BCE_KERNELS(T, SFX)                                                                \
  extern "C" __global__ void bce_grad_x_##SFX(const T* x, const T* label, const T* dout,      \
                                              T* dx, long long total) {                       \
    mg::bce_grad_x<T>(x, label, dout, dx, total);                                             \
  }

MG_BCE_KERNELS(float, f32)
MG_BCE_KERNELS(double, f64)
