// tanh and its gradient (map-only: kernels/cuda/map.py launches them).
#include "map.cuh"

MG_UNARY_MAP(tanh, x, tanh(x))
// dx = dout * (1 - out^2).
MG_BINARY_MAP(tanh_grad, out, dout, dout * (T(1) - out * out))
