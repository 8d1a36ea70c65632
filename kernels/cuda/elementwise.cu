// elementwise_add with Paddle broadcasting, its dy reduction, sum of n
// tensors, and a copy.
//
// x is seen as (pre, n, post) where y (n values) covers x's dims from
// `axis`: out[e] = x[e] + y[(e / post) % n]. dy = dout summed over pre and
// post, per y element: the same two reduction shapes as batch norm (planar
// when post > 1, rows when post == 1), accumulated in double, with a
// last-block merge of per-split partials.
#include "common.cuh"

namespace mg {

// out may be x (in place: the fused conv's bias): no __restrict__ on either.
template <typename T, int W>
__device__ void add_broadcast(const T* x, const T* __restrict__ y, T* out, long long total,
                              long long n, long long post) {
  channel_elementwise<W>(total, n, post, [&](long long u, const auto& ch, bool uniform) {
    constexpr int K = sizeof(ch) / sizeof(ch[0]);
    Pack<T, K> v = load_pack<T, K>(x, u);
    const T first = y[ch[0]];
#pragma unroll
    for (int j = 0; j < K; ++j) v.v[j] += uniform ? first : y[ch[j]];
    store_pack<T, K>(out, u, v);
  });
}

template <typename T, int W>
__device__ void copy(const T* __restrict__ src, T* __restrict__ dst, long long total) {
  flat_walk<W>(total, [&](long long u, auto width) {
    constexpr int K = decltype(width)::value;
    store_pack<T, K>(dst, u, load_pack<T, K>(src, u));
  });
}

constexpr int SUM_ARITY = 8;

// out = (accumulate ? out : 0) + p[0] + ... + p[count - 1], count <= SUM_ARITY.
template <typename T, int W>
__device__ void sum_n(T* out, long long total, int count, int accumulate,
                      const T* const (&p)[SUM_ARITY]) {
  flat_walk<W>(total, [&](long long u, auto width) {
    constexpr int K = decltype(width)::value;
    Pack<T, K> acc;
    if (accumulate) {
      acc = load_pack<T, K>(out, u);
    } else {
#pragma unroll
      for (int j = 0; j < K; ++j) acc.v[j] = T(0);
    }
#pragma unroll
    for (int i = 0; i < SUM_ARITY; ++i) {   // unrolled: p stays in registers
      if (i >= count) break;
      const Pack<T, K> v = load_pack<T, K>(p[i], u);
#pragma unroll
      for (int j = 0; j < K; ++j) acc.v[j] += v.v[j];
    }
    store_pack<T, K>(out, u, acc);
  });
}

constexpr int UNROLL = 4;

// out[c] = sum of d over pre and post for channel c (planar: post_v units per row).
template <typename T, int W>
__device__ void channel_sum_planar(const T* __restrict__ d, long long pre, long long C,
                                   long long post_v, long long chunk, int splits,
                                   double* partial, unsigned* tickets, T* out) {
  const long long c = blockIdx.x;
  const int s = blockIdx.y;
  const long long total = pre * post_v;
  const long long lo = s * chunk;
  const long long hi = lo + chunk < total ? lo + chunk : total;
  Vals<double, 1> st = zero_vals<double, 1>();
  planar_walk<UNROLL>(lo, hi, c, C, post_v, [&](const auto& addr) {
    constexpr int K = sizeof(addr) / sizeof(addr[0]);
    Pack<T, W> v[K];
#pragma unroll
    for (int j = 0; j < K; ++j) v[j] = load_pack<T, W>(d, addr[j]);
#pragma unroll
    for (int j = 0; j < K; ++j)
#pragma unroll
      for (int k = 0; k < W; ++k) st.v[0] += double(v[j].v[k]);
  });
  st = block_merge<SumOp<double, 1>>(st);
  if (splits == 1) {
    if (threadIdx.x == 0) out[c] = T(st.v[0]);
    return;
  }
  if (threadIdx.x == 0) partial[c * splits + s] = st.v[0];
  if (!arrive_last(tickets, c, splits)) return;
  Vals<double, 1> f = zero_vals<double, 1>();
  for (int i = threadIdx.x; i < splits; i += blockDim.x) f.v[0] += load_cg(partial + c * splits + i);
  f = block_merge<SumOp<double, 1>>(f);
  if (threadIdx.x == 0) out[c] = T(f.v[0]);
}

template <typename T, int W>
__device__ void channel_sum_rows(const T* __restrict__ d, long long rows, long long C,
                                 long long chunk, int splits, double* partial,
                                 unsigned* tickets, T* out) {
  const long long Cv = C / W;
  const long long cv = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const bool active = cv < Cv;
  const int s = blockIdx.y;
  const long long lo = s * chunk;
  const long long hi = lo + chunk < rows ? lo + chunk : rows;
  Vals<double, W> st = zero_vals<double, W>();
  if (active) {
    row_walk<UNROLL>(lo, hi, cv, Cv, [&](const auto& addr) {
      constexpr int K = sizeof(addr) / sizeof(addr[0]);
      Pack<T, W> v[K];
#pragma unroll
      for (int j = 0; j < K; ++j) v[j] = load_pack<T, W>(d, addr[j]);
#pragma unroll
      for (int j = 0; j < K; ++j)
#pragma unroll
        for (int k = 0; k < W; ++k) st.v[k] += double(v[j].v[k]);
    });
  }
  st = column_merge<SumOp<double, W>>(st);
  const bool owner = active && threadIdx.y == 0;
  if (splits == 1) {
    if (owner)
#pragma unroll
      for (int k = 0; k < W; ++k) out[cv * W + k] = T(st.v[k]);
    return;
  }
  if (owner)
#pragma unroll
    for (int k = 0; k < W; ++k) partial[(cv * W + k) * splits + s] = st.v[k];
  if (!arrive_last(tickets, blockIdx.x, splits)) return;
  Vals<double, W> f = zero_vals<double, W>();
  if (active)
    for (int i = threadIdx.y; i < splits; i += blockDim.y)
#pragma unroll
      for (int k = 0; k < W; ++k) f.v[k] += load_cg(partial + (cv * W + k) * splits + i);
  f = column_merge<SumOp<double, W>>(f);
  if (owner)
#pragma unroll
    for (int k = 0; k < W; ++k) out[cv * W + k] = T(f.v[k]);
}

}  // namespace mg

#define MG_ELEMENTWISE_KERNELS(T, SFX, W)                                                     \
  extern "C" __global__ void add_##SFX##_w##W(const T* x, const T* y, T* out, long long total, \
                                              long long n, long long post) {                  \
    mg::add_broadcast<T, W>(x, y, out, total, n, post);                                       \
  }                                                                                           \
  extern "C" __global__ void copy_##SFX##_w##W(const T* src, T* dst, long long total) {       \
    mg::copy<T, W>(src, dst, total);                                                          \
  }                                                                                           \
  extern "C" __global__ void sum_##SFX##_w##W(T* out, long long total, int count,             \
                                              int accumulate, const T* p0, const T* p1,       \
                                              const T* p2, const T* p3, const T* p4,          \
                                              const T* p5, const T* p6, const T* p7) {        \
    const T* const p[mg::SUM_ARITY] = {p0, p1, p2, p3, p4, p5, p6, p7};                       \
    mg::sum_n<T, W>(out, total, count, accumulate, p);                                        \
  }                                                                                           \
  extern "C" __global__ void channel_sum_planar_##SFX##_w##W(                                 \
      const T* d, long long pre, long long C, long long post_v, long long chunk, int splits,  \
      double* partial, unsigned* tickets, T* out) {                                           \
    mg::channel_sum_planar<T, W>(d, pre, C, post_v, chunk, splits, partial, tickets, out);   \
  }                                                                                           \
  extern "C" __global__ void channel_sum_rows_##SFX##_w##W(                                   \
      const T* d, long long rows, long long C, long long chunk, int splits, double* partial,  \
      unsigned* tickets, T* out) {                                                            \
    mg::channel_sum_rows<T, W>(d, rows, C, chunk, splits, partial, tickets, out);            \
  }

MG_ELEMENTWISE_KERNELS(float, f32, 1)
MG_ELEMENTWISE_KERNELS(float, f32, 4)
MG_ELEMENTWISE_KERNELS(double, f64, 1)
MG_ELEMENTWISE_KERNELS(double, f64, 2)
