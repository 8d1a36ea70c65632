// softmax_with_cross_entropy forward and gradient, one block per row
// (grid-stride over rows), in double: z = logits - max(logits),
// lse = log(sum(exp(z))), softmax = exp(z - lse), loss = lse - z[label].
// With label smoothing eps != 0 (the target (1 - eps) onehot + eps / K):
// loss = (1 - eps) (lse - z[label]) - eps mean_k(z[k] - lse), and the gradient's
// onehot becomes that target; eps = 0 takes exactly the unsmoothed arithmetic.
// A label outside [0, K) gives loss NaN and is counted in status[0], with
// status[1] = 1 + the row (some flagged row) for the launcher to report.
#include "common.cuh"

namespace mg {

__device__ __forceinline__ bool check_label(long long label, int K, long long row,
                                            unsigned* status) {
  if (label >= 0 && label < K) return true;
  atomicAdd(status, 1u);
  atomicExch(status + 1, unsigned(row + 1));
  return false;
}

template <typename T>
__device__ void swce_forward(const T* __restrict__ logits, const long long* __restrict__ label,
                             T* __restrict__ softmax, T* __restrict__ loss, long long rows, int K,
                             unsigned* status, double eps) {
  __shared__ double row_max, row_lse;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* z = logits + row * K;
    Vals<double, 1> m = MaxOp<double>::identity();
    for (int j = threadIdx.x; j < K; j += blockDim.x) {
      Vals<double, 1> v{{double(z[j])}};
      m = MaxOp<double>::merge(m, v);
    }
    m = block_merge<MaxOp<double>>(m);
    if (threadIdx.x == 0) row_max = m.v[0];
    __syncthreads();
    const double zmax = row_max;
    Vals<double, 1> s = zero_vals<double, 1>();
    for (int j = threadIdx.x; j < K; j += blockDim.x) s.v[0] += exp(double(z[j]) - zmax);
    s = block_merge<SumOp<double, 1>>(s);
    if (threadIdx.x == 0) row_lse = log(s.v[0]);
    __syncthreads();
    const double lse = row_lse;
    Vals<double, 1> logp = zero_vals<double, 1>();      // the sum of log softmax, for eps
    if (eps != 0.0) {
      for (int j = threadIdx.x; j < K; j += blockDim.x) logp.v[0] += double(z[j]) - zmax - lse;
      logp = block_merge<SumOp<double, 1>>(logp);
    }
    if (threadIdx.x == 0) {
      const long long l = label[row];
      if (check_label(l, K, row, status)) {
        const double nll = lse - (double(z[l]) - zmax);
        loss[row] = T(eps != 0.0 ? (1.0 - eps) * nll - eps * (logp.v[0] / double(K)) : nll);
      } else {
        loss[row] = T(HUGE_VAL - HUGE_VAL);
      }
    }
    for (int j = threadIdx.x; j < K; j += blockDim.x)
      softmax[row * K + j] = T(exp(double(z[j]) - zmax - lse));
    __syncthreads();                       // row_max / row_lse are rewritten next row
  }
}

// dlogits = (softmax - target) * dloss + softmax * (dsoftmax - sum(dsoftmax * softmax)),
// target = (1 - eps) onehot(label) + eps / K; dloss and dsoftmax may be null (that
// term is left out).
template <typename T>
__device__ void swce_grad(const long long* __restrict__ label, const T* __restrict__ softmax,
                          const T* __restrict__ dloss, const T* __restrict__ dsoftmax,
                          T* __restrict__ dlogits, long long rows, int K, unsigned* status,
                          double eps) {
  const double spread = eps / double(K), kept = 1.0 - eps;
  __shared__ double row_inner;
  __shared__ long long row_label;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* sm = softmax + row * K;
    double inner = 0.0;
    if (dsoftmax != nullptr) {
      const T* ds = dsoftmax + row * K;
      Vals<double, 1> s = zero_vals<double, 1>();
      for (int j = threadIdx.x; j < K; j += blockDim.x) s.v[0] += double(ds[j]) * double(sm[j]);
      s = block_merge<SumOp<double, 1>>(s);
      if (threadIdx.x == 0) row_inner = s.v[0];
    }
    if (threadIdx.x == 0 && dloss != nullptr) {
      const long long l = label[row];
      row_label = check_label(l, K, row, status) ? l : -1;
    }
    __syncthreads();
    if (dsoftmax != nullptr) inner = row_inner;
    const long long l = dloss != nullptr ? row_label : -1;
    const double dl = dloss != nullptr ? double(dloss[row]) : 0.0;
    for (int j = threadIdx.x; j < K; j += blockDim.x) {
      const double p = double(sm[j]);
      double g = 0.0;
      if (dloss != nullptr) g = ((p - spread) - (j == l ? kept : 0.0)) * dl;
      if (dsoftmax != nullptr) g += p * (double(dsoftmax[row * K + j]) - inner);
      dlogits[row * K + j] = T(g);
    }
    __syncthreads();
  }
}

}  // namespace mg

#define MG_SWCE_KERNELS(T, SFX)                                                                \
  extern "C" __global__ void swce_forward_##SFX(const T* logits, const long long* label,       \
                                                T* softmax, T* loss, long long rows, int K,    \
                                                unsigned* status, double eps) {                \
    mg::swce_forward<T>(logits, label, softmax, loss, rows, K, status, eps);                   \
  }                                                                                            \
  extern "C" __global__ void swce_grad_##SFX(const long long* label, const T* softmax,         \
                                             const T* dloss, const T* dsoftmax, T* dlogits,    \
                                             long long rows, int K, unsigned* status,          \
                                             double eps) {                                     \
    mg::swce_grad<T>(label, softmax, dloss, dsoftmax, dlogits, rows, K, status, eps);          \
  }

MG_SWCE_KERNELS(float, f32)
MG_SWCE_KERNELS(double, f64)
