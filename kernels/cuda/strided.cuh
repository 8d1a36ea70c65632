// Walks over tensors seen through up to MAX_DIMS collapsed dims with per-operand
// strides (in elements; 0 for a broadcast dim): the shared machinery of
// broadcasting, reductions to a shape and transposes. Launchers collapse the
// shapes first (kernels/cuda/strided.py), pad them on the left with dims of size 1
// and pass every dim and stride as a kernel argument.
#pragma once
#include "common.cuh"

namespace mg {

constexpr int MAX_DIMS = 6;

struct Dims {
  long long n[MAX_DIMS];
};

__device__ __forceinline__ Dims dims(long long a0, long long a1, long long a2, long long a3,
                                     long long a4, long long a5) {
  return Dims{{a0, a1, a2, a3, a4, a5}};
}

// The multi-index of a flat position (the last dim fastest), kept up to date
// while the position advances by a fixed stride: digits added with carries,
// no division per step. Positions past the end are never visited, so a carry
// out of dim 0 is dropped.
struct Cursor {
  long long idx[MAX_DIMS];
  long long step[MAX_DIMS];

  __device__ __forceinline__ void init(long long e, long long stride, const Dims& n) {
#pragma unroll
    for (int d = MAX_DIMS - 1; d >= 0; --d) {
      const long long q = e / n.n[d], s = stride / n.n[d];
      idx[d] = e - q * n.n[d];
      step[d] = stride - s * n.n[d];
      e = q;
      stride = s;
    }
  }

  __device__ __forceinline__ void advance(const Dims& n) {
    long long carry = 0;
#pragma unroll
    for (int d = MAX_DIMS - 1; d >= 0; --d) {
      const long long v = idx[d] + step[d] + carry;
      carry = v >= n.n[d];
      idx[d] = carry ? v - n.n[d] : v;
    }
  }

  __device__ __forceinline__ long long offset(const Dims& stride) const {
    long long o = 0;
#pragma unroll
    for (int d = 0; d < MAX_DIMS; ++d) o += idx[d] * stride.n[d];
    return o;
  }
};

// The offset, under `stride`, of flat position e of a tensor of dims n.
__device__ __forceinline__ long long offset_of(long long e, const Dims& n, const Dims& stride) {
  long long o = 0;
#pragma unroll
  for (int d = MAX_DIMS - 1; d >= 0; --d) {
    const long long q = e / n.n[d];
    o += (e - q * n.n[d]) * stride.n[d];
    e = q;
  }
  return o;
}

}  // namespace mg

// Kernel parameter lists: a dims argument list and its unpacking.
#define MG_DIMS_PARAMS(P)                                                                     \
  long long P##0, long long P##1, long long P##2, long long P##3, long long P##4, long long P##5
#define MG_DIMS(P) mg::dims(P##0, P##1, P##2, P##3, P##4, P##5)
