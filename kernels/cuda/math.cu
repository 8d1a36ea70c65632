// The elementwise math ops of ops/math.py and their gradients, as maps
// (kernels/cuda/map.py launches them; math.py beside this file holds scale_grad).
// NaN propagates as through numpy's maximum / minimum / sign.
#include "map.cuh"

template <typename T>
__device__ __forceinline__ T math_sign(T x) {
  return x > T(0) ? T(1) : (x < T(0) ? T(-1) : x * T(0));
}

// A float64 product never fused with the addition after it, so that scale gives
// numpy's x * scale + bias bit for bit (learning-rate multipliers); a float32 one
// may fuse (the CPU computes it in float64).
__device__ __forceinline__ float math_mul(float a, float b) { return a * b; }
__device__ __forceinline__ double math_mul(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

MG_UNARY_MAP(exp, x, exp(x))
MG_BINARY_MAP(exp_grad, out, dout, dout * out)
MG_UNARY_MAP(log, x, log(x))
MG_BINARY_MAP(log_grad, x, dout, dout * (T(1) / x))
MG_UNARY_MAP(sqrt, x, sqrt(x))
MG_BINARY_MAP(sqrt_grad, out, dout, dout * (T(0.5) / out))
MG_UNARY_MAP(square, x, x * x)
MG_BINARY_MAP(square_grad, x, dout, dout * (T(2) * x))
MG_UNARY_MAP(abs, x, fabs(x))
MG_BINARY_MAP(abs_grad, x, dout, dout * math_sign(x))
MG_UNARY_MAP_S(pow, x, factor, pow(x, factor))
MG_BINARY_MAP_S(pow_grad, x, dout, factor, dout * (factor * pow(x, factor - T(1))))
// x * scale + bias; scale_grad is this map with bias 0.
MG_UNARY_MAP_S2(scale, x, s, b, math_mul(x, s) + b)
MG_UNARY_MAP_S2(clip, x, lo, hi, x != x ? x : (x < lo ? lo : (x > hi ? hi : x)))
// The gradient passes where lo <= x <= hi (both ends included, as torch.clamp).
MG_BINARY_MAP_S2(clip_grad, x, dout, lo, hi, dout * (x >= lo && x <= hi ? T(1) : T(0)))
