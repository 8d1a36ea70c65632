// leaky_relu and its gradient, alpha a launch scalar (map-only: kernels/cuda/map.py
// launches them). NaN x: out = alpha * NaN = NaN, dx = alpha * dout (as numpy's where).
#include "map.cuh"

MG_UNARY_MAP_S(leaky_relu, x, alpha, x > T(0) ? x : alpha * x)
MG_BINARY_MAP_S(leaky_relu_grad, x, dout, alpha, x > T(0) ? dout : alpha * dout)
