// mean of every element (a scalar) and its gradient.
//
// mean: each block sums its grid-stride share in double and writes a
// partial; the last block to finish adds the partials in a fixed order and
// writes out[0] = sum / total. mean_grad: dx = dout[0] / total everywhere,
// read on the device (no host round trip).
#include "common.cuh"

namespace mg {

template <typename T>
__device__ void mean_all(const T* __restrict__ x, long long total, double* partial,
                         unsigned* tickets, T* out) {
  Vals<double, 1> st = zero_vals<double, 1>();
  const long long nt = global_threads();
  for (long long i = global_tid(); i < total; i += nt) st.v[0] += double(x[i]);
  st = block_merge<SumOp<double, 1>>(st);
  if (threadIdx.x == 0) partial[blockIdx.x] = st.v[0];
  if (!arrive_last(tickets, 0, gridDim.x)) return;
  Vals<double, 1> f = zero_vals<double, 1>();
  for (int i = threadIdx.x; i < (int)gridDim.x; i += blockDim.x) f.v[0] += load_cg(partial + i);
  f = block_merge<SumOp<double, 1>>(f);
  if (threadIdx.x == 0) out[0] = T(f.v[0] / double(total));
}

template <typename T, int W>
__device__ void mean_grad(const T* __restrict__ dout, T* __restrict__ dx, long long total) {
  const T value = T(double(dout[0]) / double(total));
  flat_walk<W>(total, [&](long long u, auto width) {
    constexpr int K = decltype(width)::value;
    Pack<T, K> v;
#pragma unroll
    for (int j = 0; j < K; ++j) v.v[j] = value;
    store_pack<T, K>(dx, u, v);
  });
}

}  // namespace mg

#define MG_MEAN_KERNELS(T, SFX, VW)                                                            \
  extern "C" __global__ void mean_##SFX(const T* x, long long total, double* partial,          \
                                        unsigned* tickets, T* out) {                           \
    mg::mean_all<T>(x, total, partial, tickets, out);                                          \
  }                                                                                            \
  extern "C" __global__ void mean_grad_##SFX##_w1(const T* dout, T* dx, long long total) {     \
    mg::mean_grad<T, 1>(dout, dx, total);                                                      \
  }                                                                                            \
  extern "C" __global__ void mean_grad_##SFX##_w##VW(const T* dout, T* dx, long long total) {  \
    mg::mean_grad<T, VW>(dout, dx, total);                                                     \
  }

MG_MEAN_KERNELS(float, f32, 4)
MG_MEAN_KERNELS(double, f64, 2)
