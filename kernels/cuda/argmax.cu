// argmax along one axis (int64 out) and accuracy (the fraction of rows whose
// argmax equals the label). The first maximum wins; a NaN counts as the
// maximum (its first one wins), as numpy's argmax.
//
// argmax sees the tensor as (pre, K, post): rows (post == 1) use one block per
// row, merging (value, index) pairs; columns (post > 1) one thread per
// (pre, post) position. accuracy: one block per row of logits (N, K); a label
// outside [0, K) counts as wrong and is flagged in status (count, 1 + row),
// as softmax_with_cross_entropy does; each block writes its count of correct
// rows, and the last block to finish writes out[0] = correct / N (float).
#include "common.cuh"

namespace mg {

// (value, index) with the first-maximum rule; identity: an index past every real one.
struct ArgmaxOp {
  using State = Vals<double, 2>;
  static __device__ __forceinline__ State identity() { return State{{-HUGE_VAL, HUGE_VAL}}; }
  static __device__ __forceinline__ State merge(const State& a, const State& b) {
    const bool an = a.v[0] != a.v[0], bn = b.v[0] != b.v[0];
    if (an != bn) return an ? a : b;
    if (!an) {
      if (b.v[0] > a.v[0]) return b;
      if (a.v[0] > b.v[0]) return a;
    }
    return a.v[1] <= b.v[1] ? a : b;
  }
};

template <typename T>
__device__ __forceinline__ long long row_argmax(const T* z, int K) {
  ArgmaxOp::State s = ArgmaxOp::identity();
  for (int j = threadIdx.x; j < K; j += blockDim.x)
    s = ArgmaxOp::merge(s, ArgmaxOp::State{{double(z[j]), double(j)}});
  s = block_merge<ArgmaxOp>(s);
  return (long long)s.v[1];                // valid in thread 0
}

template <typename T>
__device__ void argmax_rows(const T* __restrict__ x, long long* __restrict__ out, long long rows,
                            int K) {
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const long long best = row_argmax(x + row * K, K);
    if (threadIdx.x == 0) out[row] = best;
  }
}

template <typename T>
__device__ void argmax_columns(const T* __restrict__ x, long long* __restrict__ out,
                               long long pre, long long K, long long post) {
  const long long total = pre * post, nt = global_threads();
  for (long long i = global_tid(); i < total; i += nt) {
    const long long p = i / post, q = i - p * post;
    const T* z = x + p * K * post + q;
    T best = z[0];
    long long where = 0;
    for (long long k = 1; k < K && best == best; ++k) {
      const T v = z[k * post];
      if (v > best || v != v) {
        best = v;
        where = k;
      }
    }
    out[i] = where;
  }
}

template <typename T>
__device__ void accuracy(const T* __restrict__ logits, const long long* __restrict__ label,
                         long long rows, int K, double* partial, unsigned* tickets, float* out,
                         unsigned* status) {
  double correct = 0.0;                    // meaningful in thread 0
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const long long best = row_argmax(logits + row * K, K);
    if (threadIdx.x == 0) {
      const long long l = label[row];
      if (l < 0 || l >= K) {
        atomicAdd(status, 1u);
        atomicExch(status + 1, unsigned(row + 1));
      } else if (l == best) {
        correct += 1.0;
      }
    }
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = correct;
  if (!arrive_last(tickets, 0, gridDim.x)) return;
  Vals<double, 1> f = zero_vals<double, 1>();
  for (int i = threadIdx.x; i < (int)gridDim.x; i += blockDim.x) f.v[0] += load_cg(partial + i);
  f = block_merge<SumOp<double, 1>>(f);
  if (threadIdx.x == 0) out[0] = float(f.v[0] / double(rows));
}

}  // namespace mg

#define MG_ARGMAX_KERNELS(T, SFX)                                                             \
  extern "C" __global__ void argmax_rows_##SFX(const T* x, long long* out, long long rows,     \
                                               int K) {                                       \
    mg::argmax_rows<T>(x, out, rows, K);                                                      \
  }                                                                                           \
  extern "C" __global__ void argmax_columns_##SFX(const T* x, long long* out, long long pre,   \
                                                  long long K, long long post) {              \
    mg::argmax_columns<T>(x, out, pre, K, post);                                              \
  }                                                                                           \
  extern "C" __global__ void accuracy_##SFX(const T* logits, const long long* label,          \
                                            long long rows, int K, double* partial,           \
                                            unsigned* tickets, float* out, unsigned* status) {\
    mg::accuracy<T>(logits, label, rows, K, partial, tickets, out, status);                   \
  }

MG_ARGMAX_KERNELS(float, f32)
MG_ARGMAX_KERNELS(double, f64)
