// softmax along one axis and its gradient, the tensor seen as (pre, K, post)
// with the axis in the middle; everything in double.
//
// out = exp(x - max) / sum(exp(x - max)) (a NaN in the slice makes it all NaN,
// as numpy's max does); dx = out * (dout - sum(dout * out)).
// rows (post == 1): one block per slice of K contiguous values, grid-stride
// over the pre slices. columns (post > 1): one thread per (pre, post)
// position walking its K values post apart (neighbouring threads read
// neighbouring values).
#include "common.cuh"

namespace mg {

struct MaxNanOp {
  using State = Vals<double, 1>;
  static __device__ __forceinline__ State identity() { return State{{-HUGE_VAL}}; }
  static __device__ __forceinline__ State merge(const State& a, const State& b) {
    return (b.v[0] > a.v[0] || b.v[0] != b.v[0]) ? b : a;
  }
};

template <typename T>
__device__ void softmax_rows(const T* __restrict__ x, T* __restrict__ out, long long rows, int K) {
  __shared__ double row_max, row_sum;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* z = x + row * K;
    Vals<double, 1> m = MaxNanOp::identity();
    for (int j = threadIdx.x; j < K; j += blockDim.x)
      m = MaxNanOp::merge(m, Vals<double, 1>{{double(z[j])}});
    m = block_merge<MaxNanOp>(m);
    if (threadIdx.x == 0) row_max = m.v[0];
    __syncthreads();
    const double zmax = row_max;
    Vals<double, 1> s = zero_vals<double, 1>();
    for (int j = threadIdx.x; j < K; j += blockDim.x) s.v[0] += exp(double(z[j]) - zmax);
    s = block_merge<SumOp<double, 1>>(s);
    if (threadIdx.x == 0) row_sum = s.v[0];
    __syncthreads();
    const double sum = row_sum;
    for (int j = threadIdx.x; j < K; j += blockDim.x)
      out[row * K + j] = T(exp(double(z[j]) - zmax) / sum);
    __syncthreads();                       // row_max / row_sum are rewritten next row
  }
}

template <typename T>
__device__ void softmax_columns(const T* __restrict__ x, T* __restrict__ out, long long pre,
                                long long K, long long post) {
  const long long total = pre * post, nt = global_threads();
  for (long long i = global_tid(); i < total; i += nt) {
    const long long p = i / post, q = i - p * post;
    const long long base = p * K * post + q;
    double zmax = -HUGE_VAL;
    for (long long k = 0; k < K; ++k) {
      const double v = double(x[base + k * post]);
      if (v > zmax || v != v) zmax = v;
    }
    double sum = 0.0;
    for (long long k = 0; k < K; ++k) sum += exp(double(x[base + k * post]) - zmax);
    for (long long k = 0; k < K; ++k)
      out[base + k * post] = T(exp(double(x[base + k * post]) - zmax) / sum);
  }
}

template <typename T>
__device__ void softmax_grad_rows(const T* __restrict__ out, const T* __restrict__ dout,
                                  T* __restrict__ dx, long long rows, int K) {
  __shared__ double row_inner;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    const T* o = out + row * K;
    const T* d = dout + row * K;
    Vals<double, 1> s = zero_vals<double, 1>();
    for (int j = threadIdx.x; j < K; j += blockDim.x) s.v[0] += double(d[j]) * double(o[j]);
    s = block_merge<SumOp<double, 1>>(s);
    if (threadIdx.x == 0) row_inner = s.v[0];
    __syncthreads();
    const double inner = row_inner;
    for (int j = threadIdx.x; j < K; j += blockDim.x)
      dx[row * K + j] = T(double(o[j]) * (double(d[j]) - inner));
    __syncthreads();
  }
}

template <typename T>
__device__ void softmax_grad_columns(const T* __restrict__ out, const T* __restrict__ dout,
                                     T* __restrict__ dx, long long pre, long long K,
                                     long long post) {
  const long long total = pre * post, nt = global_threads();
  for (long long i = global_tid(); i < total; i += nt) {
    const long long p = i / post, q = i - p * post;
    const long long base = p * K * post + q;
    double inner = 0.0;
    for (long long k = 0; k < K; ++k)
      inner += double(dout[base + k * post]) * double(out[base + k * post]);
    for (long long k = 0; k < K; ++k) {
      const long long e = base + k * post;
      dx[e] = T(double(out[e]) * (double(dout[e]) - inner));
    }
  }
}

}  // namespace mg

#define MG_SOFTMAX_KERNELS(T, SFX)                                                            \
  extern "C" __global__ void softmax_rows_##SFX(const T* x, T* out, long long rows, int K) {  \
    mg::softmax_rows<T>(x, out, rows, K);                                                     \
  }                                                                                           \
  extern "C" __global__ void softmax_columns_##SFX(const T* x, T* out, long long pre,         \
                                                   long long K, long long post) {             \
    mg::softmax_columns<T>(x, out, pre, K, post);                                             \
  }                                                                                           \
  extern "C" __global__ void softmax_grad_rows_##SFX(const T* out, const T* dout, T* dx,      \
                                                     long long rows, int K) {                 \
    mg::softmax_grad_rows<T>(out, dout, dx, rows, K);                                         \
  }                                                                                           \
  extern "C" __global__ void softmax_grad_columns_##SFX(const T* out, const T* dout, T* dx,   \
                                                        long long pre, long long K,           \
                                                        long long post) {                     \
    mg::softmax_grad_columns<T>(out, dout, dx, pre, K, post);                                 \
  }

MG_SOFTMAX_KERNELS(float, f32)
MG_SOFTMAX_KERNELS(double, f64)
