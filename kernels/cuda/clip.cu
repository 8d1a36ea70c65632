// clip_by_global_norm: scale a list of tensors in place so that their joint L2
// norm is at most max_norm (torch.nn.utils.clip_grad_norm_), with no host sync.
//
// sumsq: up to CLIP_ARITY tensors per launch, blockIdx.y picks one; each block
// writes the sum of squares (double) of its grid-stride share to
// partial[(first + y) * gridDim.x + x]. clip_coef (one block): total = sqrt of
// the sum of every partial, in a fixed order; coef = min(max_norm /
// (total + 1e-6), 1), NaN when total is NaN (Python's min). scale: x *= T(coef).
#include "common.cuh"

namespace mg {

constexpr int CLIP_ARITY = 8;

template <typename T>
__device__ void sumsq(const T* const (&p)[CLIP_ARITY], const long long (&n)[CLIP_ARITY],
                      int first, double* partial) {
  const int y = blockIdx.y;
  const T* x = p[y];
  const long long size = n[y], nt = global_threads();
  Vals<double, 1> st = zero_vals<double, 1>();
  for (long long i = global_tid(); i < size; i += nt) {
    const double v = double(x[i]);
    st.v[0] += v * v;
  }
  st = block_merge<SumOp<double, 1>>(st);
  if (threadIdx.x == 0) partial[(long long)(first + y) * gridDim.x + blockIdx.x] = st.v[0];
}

__device__ void clip_coef(const double* partial, long long count, double max_norm,
                          double* coef) {
  Vals<double, 1> st = zero_vals<double, 1>();
  for (long long i = threadIdx.x; i < count; i += blockDim.x) st.v[0] += partial[i];
  st = block_merge<SumOp<double, 1>>(st);
  if (threadIdx.x == 0) {
    const double c = max_norm / (sqrt(st.v[0]) + 1e-6);
    coef[0] = 1.0 < c ? 1.0 : c;
  }
}

template <typename T>
__device__ void scale(T* const (&p)[CLIP_ARITY], const long long (&n)[CLIP_ARITY],
                      const double* coef) {
  const int y = blockIdx.y;
  T* x = p[y];
  const long long size = n[y], nt = global_threads();
  const T c = T(coef[0]);
  for (long long i = global_tid(); i < size; i += nt) x[i] = x[i] * c;
}

}  // namespace mg

#define MG_CLIP_PARAMS(Q)                                                                     \
  Q* p0, Q* p1, Q* p2, Q* p3, Q* p4, Q* p5, Q* p6, Q* p7, long long n0, long long n1,         \
      long long n2, long long n3, long long n4, long long n5, long long n6, long long n7
#define MG_CLIP_ARRAYS(Q)                                                                     \
  Q* const p[mg::CLIP_ARITY] = {p0, p1, p2, p3, p4, p5, p6, p7};                              \
  const long long n[mg::CLIP_ARITY] = {n0, n1, n2, n3, n4, n5, n6, n7}

#define MG_CLIP_KERNELS(T, SFX)                                                               \
  extern "C" __global__ void sumsq_##SFX(MG_CLIP_PARAMS(const T), int first,                  \
                                         double* partial) {                                   \
    MG_CLIP_ARRAYS(const T);                                                                  \
    mg::sumsq<T>(p, n, first, partial);                                                       \
  }                                                                                           \
  extern "C" __global__ void scale_##SFX(MG_CLIP_PARAMS(T), const double* coef) {             \
    MG_CLIP_ARRAYS(T);                                                                        \
    mg::scale<T>(p, n, coef);                                                                 \
  }

MG_CLIP_KERNELS(float, f32)
MG_CLIP_KERNELS(double, f64)

extern "C" __global__ void clip_coef(const double* partial, long long count, double max_norm,
                                     double* coef) {
  mg::clip_coef(partial, count, max_norm, coef);
}
