// sigmoid and its gradient (map-only: kernels/cuda/map.py launches them).
#include "map.cuh"

// 1 / (1 + exp(-x)), from e = exp(-|x|) so that nothing overflows.
MG_UNARY_MAP(sigmoid, x, (x >= T(0) ? T(1) : exp(-fabs(x))) / (T(1) + exp(-fabs(x))))
// dx = dout * out * (1 - out).
MG_BINARY_MAP(sigmoid_grad, out, dout, dout * out * (T(1) - out))
