// relu and its gradient, elementwise (kernels/cuda/map.cuh).
#include "map.cuh"

// out = max(x, 0); NaN stays NaN (as numpy's maximum).
MG_UNARY_MAP(relu, x, (x > T(0) || x != x) ? x : T(0))
// dx = dout where out > 0, else 0.
MG_BINARY_MAP(relu_grad, out, dout, out > T(0) ? dout : T(0))
