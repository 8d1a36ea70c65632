// embedding: out[i, :] = w[ids[i], :] for the n ids (any shape, flattened) and a
// (rows, dim) table; embedding_grad: acc[ids[i], :] += dout[i, :] in double
// (atomics: the order of the additions is not fixed), the padding row skipped.
// An id outside [0, rows) is counted in status[0], with status[1] = 1 + its flat
// position (some flagged one) and status[2] = rows, for the launcher to report;
// its row of out is NaN and it adds nothing to the gradient.
#include "common.cuh"

namespace mg {

__device__ __forceinline__ bool check_id(long long id, long long rows, long long i,
                                         unsigned* status) {
  if (id >= 0 && id < rows) return true;
  atomicAdd(status, 1u);
  atomicExch(status + 1, unsigned(i + 1));
  atomicExch(status + 2, unsigned(rows));
  return false;
}

template <typename T>
__device__ void embedding(const long long* __restrict__ ids, const T* __restrict__ w,
                          T* __restrict__ out, long long n, long long rows, long long dim,
                          unsigned* status) {
  const long long total = n * dim;
  for (long long e = global_tid(); e < total; e += global_threads()) {
    const long long i = e / dim, j = e - i * dim;
    const long long id = ids[i];
    const bool ok = j == 0 ? check_id(id, rows, i, status) : id >= 0 && id < rows;
    out[e] = ok ? w[id * dim + j] : T(HUGE_VAL - HUGE_VAL);
  }
}

template <typename T>
__device__ void embedding_grad(const long long* __restrict__ ids, const T* __restrict__ dout,
                               double* __restrict__ acc, long long n, long long rows,
                               long long dim, long long padding, unsigned* status) {
  const long long total = n * dim;
  for (long long e = global_tid(); e < total; e += global_threads()) {
    const long long i = e / dim, j = e - i * dim;
    const long long id = ids[i];
    const bool ok = j == 0 ? check_id(id, rows, i, status) : id >= 0 && id < rows;
    if (ok && id != padding) atomicAdd(acc + id * dim + j, double(dout[e]));
  }
}

}  // namespace mg

#define MG_EMBEDDING_KERNELS(T, SFX)                                                          \
  extern "C" __global__ void embedding_##SFX(const long long* ids, const T* w, T* out,        \
                                             long long n, long long rows, long long dim,      \
                                             unsigned* status) {                              \
    mg::embedding<T>(ids, w, out, n, rows, dim, status);                                      \
  }                                                                                           \
  extern "C" __global__ void embedding_grad_##SFX(const long long* ids, const T* dout,        \
                                                  double* acc, long long n, long long rows,   \
                                                  long long dim, long long padding,           \
                                                  unsigned* status) {                         \
    mg::embedding_grad<T>(ids, dout, acc, n, rows, dim, padding, status);                     \
  }

MG_EMBEDDING_KERNELS(float, f32)
MG_EMBEDDING_KERNELS(double, f64)

extern "C" __global__ void embedding_zero(double* acc, long long total) {
  for (long long e = mg::global_tid(); e < total; e += mg::global_threads()) acc[e] = 0.0;
}

extern "C" __global__ void embedding_to_f32(const double* acc, float* dw, long long total) {
  for (long long e = mg::global_tid(); e < total; e += mg::global_threads())
    dw[e] = float(acc[e]);
}
