// silu and its gradient (map-only: kernels/cuda/map.py launches them; see ops/silu.py).
#include "map.cuh"

// sigmoid from exp(-|x|), so that nothing overflows.
template <typename T>
__device__ __forceinline__ T silu_sigmoid(T x) {
  const T e = exp(-fabs(x));
  return (x >= T(0) ? T(1) : e) / (T(1) + e);
}

MG_UNARY_MAP(silu, x, x * silu_sigmoid(x))
// dx = dout * s * (1 + x * (1 - s)), s = sigmoid(x).
MG_BINARY_MAP(silu_grad, x, dout, dout * silu_sigmoid(x) * (T(1) + x * (T(1) - silu_sigmoid(x))))
