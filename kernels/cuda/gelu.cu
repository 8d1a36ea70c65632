// gelu, the exact form x * Phi(x), and its gradient (map-only: kernels/cuda/map.py
// launches them). Phi(x) = erfc(-x / sqrt 2) / 2 keeps the left tail's relative
// accuracy (1 + erf would cancel); phi(x) = exp(-x^2 / 2) / sqrt(2 pi), and
// x * phi(x) is taken as 0 for |x| >= 40 (x * x would overflow to inf * 0).
#include "map.cuh"

MG_UNARY_MAP(gelu, x, x * (T(0.5) * erfc(-x * T(0.70710678118654752440))))
// dx = dout * (Phi(x) + x * phi(x)).
MG_BINARY_MAP(gelu_grad, x, dout,
              dout * (T(0.5) * erfc(-x * T(0.70710678118654752440)) +
                      (fabs(x) < T(40) ? x * exp(T(-0.5) * x * x) * T(0.39894228040143267794)
                                       : T(0))))
