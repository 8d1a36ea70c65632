// Batch norm: statistics, normalisation, inference and backward.
//
// A tensor is seen as (pre, C, post): NCHW is (N, C, H*W), NHWC (and any
// layout with post == 1) is (N*H*W, C, 1). Two reduction shapes:
//   planar (post > 1): grid (C, splits), 1-D blocks; a block walks its slice of
//     one channel's pre*post values (W-wide packs when post % W == 0);
//   rows (post == 1): grid (channel groups, splits), 2-D blocks (TX, TY); thread
//     column tx owns W adjacent channels, so a warp reads whole rows (coalesced).
// Each block merges its threads (Welford, Chan merges through shuffles and
// shared memory) into one partial per channel; with splits > 1 the last
// block of a channel (group) merges the partials in double and finishes.
//
// Training forward = stats kernel (finishes each channel: batch mean/var,
// normalisation coefficients, candidate new estimates, non-finite flag) +
// normalize kernel (y, and the commit of the estimates and the counter unless
// this launch's epoch was flagged). Backward = reduce kernel (sums of dy and
// dy*(x - mean), dscale, dbias, dx coefficients) + dx kernel.
//
// Synchronized batch norm splits both reductions at the channel finish: the
// same reduce kernels, finished by a SumsOut / GradSumsOut, write this
// rank's float64 vector of 2C+1 numbers (n first): forward (n, mean_c, M2_c),
// which the ranks merge with Chan's formula (merge_stats on the device, or
// the host), backward (n, sums of dy and dy*(x - mean)), which they add; a
// one-thread-per-channel kernel then finishes each channel from the global
// vector exactly as the single-device path does (finish_stats /
// finish_grad), and the same normalize / dx kernels follow.
#include "batch_norm.cuh"

namespace mg {

constexpr int UNROLL = 4;   // packs in flight per thread in the reductions

template <typename T, int W, class Out>
__device__ void stats_planar(const T* __restrict__ x, long long pre, long long post_v,
                             long long chunk, int splits, T* partial, unsigned* tickets,
                             const Out& o) {
  using A = T;
  const long long c = blockIdx.x;
  const int s = blockIdx.y;
  const long long total = pre * post_v;
  const long long lo = s * chunk;
  const long long hi = lo + chunk < total ? lo + chunk : total;
  const A shift = A(x[c * post_v * W]);   // first value of the channel: keeps offset data exact
  Vals<A, 3> st = zero_vals<A, 3>();
  planar_walk<UNROLL>(lo, hi, c, o.C, post_v, [&](const auto& addr) {
    constexpr int K = sizeof(addr) / sizeof(addr[0]);
    Pack<T, W> v[K];
#pragma unroll
    for (int j = 0; j < K; ++j) v[j] = load_pack<T, W>(x, addr[j]);
    A d[K * W];
#pragma unroll
    for (int j = 0; j < K; ++j)
#pragma unroll
      for (int k = 0; k < W; ++k) d[j * W + k] = A(v[j].v[k]) - shift;
    welford_push<A, 1, K * W>(st, d);
  });
  st = block_merge<WelfordOp<A, 1>>(st);
  if (splits == 1) {
    if (threadIdx.x == 0) finish_channel(o, c, st.v[0], shift, st.v[1], st.v[2]);
    return;
  }
  if (threadIdx.x == 0) {
    T* p = partial + (c * splits + s) * 3;
    p[0] = st.v[0];
    p[1] = st.v[1];
    p[2] = st.v[2];
  }
  if (!arrive_last(tickets, c, splits)) return;
  Vals<double, 3> f = zero_vals<double, 3>();
  for (int i = threadIdx.x; i < splits; i += blockDim.x) {
    const T* p = partial + (c * splits + i) * 3;
    Vals<double, 3> b;
    b.v[0] = load_cg(p);
    b.v[1] = load_cg(p + 1);
    b.v[2] = load_cg(p + 2);
    f = WelfordOp<double, 1>::merge(f, b);
  }
  f = block_merge<WelfordOp<double, 1>>(f);
  if (threadIdx.x == 0) finish_channel(o, c, f.v[0], shift, f.v[1], f.v[2]);
}

template <typename T, int W, class Out>
__device__ void finish_rows_stats(const T* x, const T* partial, long long rows, long long chunk,
                                  int splits, const Out& o);

template <typename T, int W, class Out>
__device__ void stats_rows(const T* __restrict__ x, long long rows, long long chunk, int splits,
                           T* partial, unsigned* tickets, const Out& o) {
  using A = T;
  const long long Cv = o.C / W;
  const long long cv = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const bool active = cv < Cv;
  const int s = blockIdx.y;
  const long long lo = s * chunk;
  const long long hi = lo + chunk < rows ? lo + chunk : rows;
  A shift[W];
  Vals<A, 1 + 2 * W> st = zero_vals<A, 1 + 2 * W>();
  if (active) {
    const Pack<T, W> first = load_pack<T, W>(x, cv);
#pragma unroll
    for (int k = 0; k < W; ++k) shift[k] = A(first.v[k]);
    row_walk<UNROLL>(lo, hi, cv, Cv, [&](const auto& addr) {
      constexpr int K = sizeof(addr) / sizeof(addr[0]);
      Pack<T, W> v[K];
#pragma unroll
      for (int j = 0; j < K; ++j) v[j] = load_pack<T, W>(x, addr[j]);
      A d[K * W];
#pragma unroll
      for (int j = 0; j < K; ++j)
#pragma unroll
        for (int k = 0; k < W; ++k) d[j * W + k] = A(v[j].v[k]) - shift[k];
      welford_push<A, W, K>(st, d);
    });
  } else {
#pragma unroll
    for (int k = 0; k < W; ++k) shift[k] = A(0);
  }
  st = column_merge<WelfordOp<A, W>>(st);
  const bool owner = active && threadIdx.y == 0;
  if (splits == 1) {
    if (owner)
#pragma unroll
      for (int k = 0; k < W; ++k)
        finish_channel(o, cv * W + k, st.v[0], shift[k], st.v[1 + k], st.v[1 + W + k]);
    return;
  }
  if (owner) {
#pragma unroll
    for (int k = 0; k < W; ++k) {
      partial[s * 2 * o.C + cv * W + k] = st.v[1 + k];            // means about the shift
      partial[s * 2 * o.C + o.C + cv * W + k] = st.v[1 + W + k];  // M2
    }
  }
  if (!arrive_last(tickets, blockIdx.x, splits)) return;
  finish_rows_stats<T, W>(x, partial, rows, chunk, splits, o);
}

// The last block of a channel group finishes it from every split's (mean, M2),
// stored channel-contiguous per split: its threads take (channel, every J-th split),
// two passes in double - the mean, then M2 = sum of M2_s + n_s (mean_s - mean)^2
// (no divisions, no cancellation) - each merged over the J slices in shared memory.
template <typename T, int W, class Out>
__device__ void finish_rows_stats(const T* x, const T* partial, long long rows, long long chunk,
                                  int splits, const Out& o) {
  __shared__ double red[MERGE_SLOTS];
  __shared__ double mean_of[MERGE_SLOTS];
  const int threads = blockDim.x * blockDim.y, t = flat_tid();
  const int width = blockDim.x * W;                 // channels of the group
  const int cl = t % width, j = t / width, slices = threads / width;
  const long long c = (long long)blockIdx.x * width + cl;
  const bool active = c < o.C && j < slices;
  const long long C = o.C;
  double a = 0.0;
  if (active)
#pragma unroll 4
    for (int i = j; i < splits; i += slices) {
      const long long n_i = rows - i * chunk < chunk ? rows - i * chunk : chunk;
      a += double(n_i) * double(load_cg(partial + i * 2 * C + c));
    }
  red[t] = a;
  __syncthreads();
  if (j == 0) {
    double total = 0.0;
    for (int k = 0; k < slices; ++k) total += red[k * width + cl];
    mean_of[cl] = total / double(rows);
  }
  __syncthreads();
  const double mean = mean_of[cl];
  double b = 0.0;
  if (active)
#pragma unroll 4
    for (int i = j; i < splits; i += slices) {
      const long long n_i = rows - i * chunk < chunk ? rows - i * chunk : chunk;
      const double d = double(load_cg(partial + i * 2 * C + c)) - mean;
      b += double(load_cg(partial + i * 2 * C + C + c)) + double(n_i) * d * d;
    }
  red[t] = b;
  __syncthreads();
  if (j == 0 && c < C) {
    double m2 = 0.0;
    for (int k = 0; k < slices; ++k) m2 += red[k * width + cl];
    finish_channel(o, c, double(rows), double(x[c]), mean, m2);
  }
}

// y = (x - m) * k + b per channel over a flat (pre, C, post) tensor, then max(y, 0)
// when `relu` (batch_norm_relu); `coef` gives (m, k, b) of a channel. Threads whose
// global index is < C commit the estimates afterwards (train) unless the epoch was
// flagged.
template <typename T, int W, bool REVERSE, class Coef>
__device__ __forceinline__ void normalize_flat(const T* __restrict__ x, T* __restrict__ y,
                                               long long total, long long C, long long post,
                                               int relu, Coef coef) {
  channel_elementwise<W, REVERSE>(total, C, post,
                                  [&](long long u, const auto& ch, bool uniform) {
    constexpr int K = sizeof(ch) / sizeof(ch[0]);
    const Pack<T, K> in = load_pack<T, K>(x, u);
    Pack<T, K> out;
    T m, k, b;
    if (uniform) coef(ch[0], m, k, b);
#pragma unroll
    for (int j = 0; j < K; ++j) {
      if (!uniform) coef(ch[j], m, k, b);
      const T v = (in.v[j] - m) * k + b;
      out.v[j] = relu ? relu_of(v) : v;
    }
    store_pack<T, K>(y, u, out);
  });
}

template <typename T, int W>
__device__ void normalize_train(const T* x, T* y, long long total, long long C, long long post,
                                const T* __restrict__ coef, int commit, T* est_mean, T* est_var,
                                const T* newest, long long* counter, unsigned* status,
                                unsigned epoch, int relu) {
  if (commit)
    commit_estimates(global_tid(), C, newest, est_mean, est_var, counter, status, epoch);
  // backwards: the end of x, read last by the statistics kernel, is still in L2
  normalize_flat<T, W, true>(x, y, total, C, post, relu, [&](long long c, T& m, T& k, T& b) {
    m = coef[c];
    k = coef[C + c];
    b = coef[2 * C + c];
  });
}

template <typename T, int W>
__device__ void normalize_infer(const T* x, T* y, long long total, long long C, long long post,
                                const T* __restrict__ est_mean, const T* __restrict__ est_var,
                                const T* __restrict__ scale, const T* __restrict__ bias,
                                double eps, int relu) {
  const T eps_t = T(eps);
  normalize_flat<T, W, false>(x, y, total, C, post, relu,
                              [&](long long c, T& m, T& k, T& b) {
    m = est_mean[c];
    k = scale[c] * (T(1) / sqrt(est_var[c] + eps_t));
    b = bias[c];
  });
}

// ---- backward ----------------------------------------------------------------

// batch_norm_relu's backward: dy where the forward's output y is > 0, else 0. With
// `bits` (the single-device reduction), each pack's mask is also stored, one byte
// per pack of W values (bit k: value k), for the dx kernel to read instead of y.
template <typename T, int W>
__device__ __forceinline__ void relu_mask(const T* yr, unsigned char* bits, long long unit,
                                          Pack<T, W>& g) {
  const Pack<T, W> yv = load_pack<T, W>(yr, unit);
  unsigned mask = 0;
#pragma unroll
  for (int k = 0; k < W; ++k) {
    const bool on = yv.v[k] > T(0);
    mask |= unsigned(on) << k;
    if (!on) g.v[k] = T(0);
  }
  if (bits != nullptr) bits[unit] = (unsigned char)mask;
}

template <typename T, int W, class Out>
__device__ void grad_planar(const T* __restrict__ x, const T* __restrict__ dy, long long pre,
                            long long post_v, long long chunk, int splits, T* partial,
                            unsigned* tickets, const Out& o, const T* yr = nullptr,
                            unsigned char* bits = nullptr) {
  using A = T;
  const long long c = blockIdx.x;
  const int s = blockIdx.y;
  const long long total = pre * post_v;
  const long long lo = s * chunk;
  const long long hi = lo + chunk < total ? lo + chunk : total;
  const A m = A(o.mean[c]);
  Vals<A, 2> st = zero_vals<A, 2>();
  planar_walk<UNROLL>(lo, hi, c, o.C, post_v, [&](const auto& addr) {
    constexpr int K = sizeof(addr) / sizeof(addr[0]);
    Pack<T, W> xv[K], gv[K];
#pragma unroll
    for (int j = 0; j < K; ++j) {
      xv[j] = load_pack<T, W>(x, addr[j]);
      gv[j] = load_pack<T, W>(dy, addr[j]);
    }
    if (yr != nullptr)
#pragma unroll
      for (int j = 0; j < K; ++j) relu_mask<T, W>(yr, bits, addr[j], gv[j]);
#pragma unroll
    for (int j = 0; j < K; ++j)
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const A g = A(gv[j].v[k]);
        st.v[0] += g;
        st.v[1] += g * (A(xv[j].v[k]) - m);
      }
  });
  st = block_merge<SumOp<A, 2>>(st);
  if (splits == 1) {
    if (threadIdx.x == 0) finish_grad_channel(o, c, st.v[0], st.v[1]);
    return;
  }
  if (threadIdx.x == 0) {
    T* p = partial + (c * splits + s) * 2;
    p[0] = st.v[0];
    p[1] = st.v[1];
  }
  if (!arrive_last(tickets, c, splits)) return;
  Vals<double, 2> f = zero_vals<double, 2>();
  for (int i = threadIdx.x; i < splits; i += blockDim.x) {
    const T* p = partial + (c * splits + i) * 2;
    f.v[0] += load_cg(p);
    f.v[1] += load_cg(p + 1);
  }
  f = block_merge<SumOp<double, 2>>(f);
  if (threadIdx.x == 0) finish_grad_channel(o, c, f.v[0], f.v[1]);
}

template <typename T, int W, class Out>
__device__ void grad_rows(const T* __restrict__ x, const T* __restrict__ dy, long long rows,
                          long long chunk, int splits, T* partial, unsigned* tickets,
                          const Out& o, const T* yr = nullptr, unsigned char* bits = nullptr) {
  using A = T;
  const long long Cv = o.C / W;
  const long long cv = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const bool active = cv < Cv;
  const int s = blockIdx.y;
  const long long lo = s * chunk;
  const long long hi = lo + chunk < rows ? lo + chunk : rows;
  Vals<A, 2 * W> st = zero_vals<A, 2 * W>();   // v[k]: sum dy, v[W + k]: sum dy (x - m)
  if (active) {
    // scalar loads: the plan's pack width checked x and dy only, not mean
    A mp[W];
#pragma unroll
    for (int k = 0; k < W; ++k) mp[k] = A(o.mean[cv * W + k]);
    row_walk<UNROLL>(lo, hi, cv, Cv, [&](const auto& addr) {
      constexpr int K = sizeof(addr) / sizeof(addr[0]);
      Pack<T, W> xv[K], gv[K];
#pragma unroll
      for (int j = 0; j < K; ++j) {
        xv[j] = load_pack<T, W>(x, addr[j]);
        gv[j] = load_pack<T, W>(dy, addr[j]);
      }
      if (yr != nullptr)
#pragma unroll
        for (int j = 0; j < K; ++j) relu_mask<T, W>(yr, bits, addr[j], gv[j]);
#pragma unroll
      for (int j = 0; j < K; ++j)
#pragma unroll
        for (int k = 0; k < W; ++k) {
          const A g = A(gv[j].v[k]);
          st.v[k] += g;
          st.v[W + k] += g * (A(xv[j].v[k]) - mp[k]);
        }
    });
  }
  st = column_merge<SumOp<A, 2 * W>>(st);
  const bool owner = active && threadIdx.y == 0;
  if (splits == 1) {
    if (owner)
#pragma unroll
      for (int k = 0; k < W; ++k) finish_grad_channel(o, cv * W + k, st.v[k], st.v[W + k]);
    return;
  }
  if (owner) {
#pragma unroll
    for (int k = 0; k < W; ++k) {
      partial[s * 2 * o.C + cv * W + k] = st.v[k];               // channel-contiguous
      partial[s * 2 * o.C + o.C + cv * W + k] = st.v[W + k];
    }
  }
  if (!arrive_last(tickets, blockIdx.x, splits)) return;
  // the group's last block: (channel, every J-th split) per thread, merged in double
  __shared__ double red[2 * MERGE_SLOTS];
  const int threads = blockDim.x * blockDim.y, t = flat_tid();
  const int width = blockDim.x * W;
  const int cl = t % width, j = t / width, slices = threads / width;
  const long long c = (long long)blockIdx.x * width + cl;
  double a = 0.0, b = 0.0;
  if (c < o.C && j < slices)
#pragma unroll 4
    for (int i = j; i < splits; i += slices) {
      a += double(load_cg(partial + i * 2 * o.C + c));
      b += double(load_cg(partial + i * 2 * o.C + o.C + c));
    }
  red[t] = a;
  red[MERGE_SLOTS + t] = b;
  __syncthreads();
  if (j == 0 && c < o.C) {
    double s_dy = 0.0, s_dyx = 0.0;
    for (int k = 0; k < slices; ++k) {
      s_dy += red[k * width + cl];
      s_dyx += red[MERGE_SLOTS + k * width + cl];
    }
    finish_grad_channel(o, c, s_dy, s_dyx);
  }
}

template <typename T, int W, bool USE_X>
__device__ void grad_dx(const T* __restrict__ x, const T* dy, T* dx, long long total, long long C,
                        long long post, const T* __restrict__ coef, const T* yr,
                        const unsigned char* bits, int shift) {
  // backwards, as normalize_train: x and dy were just read by the reduce kernel
  const bool masked = yr != nullptr || bits != nullptr;
  channel_elementwise<W, true>(total, C, post, [&](long long u, const auto& ch, bool uniform) {
    constexpr int K = sizeof(ch) / sizeof(ch[0]);
    Pack<T, K> g = load_pack<T, K>(dy, u);
    if (masked)
#pragma unroll
      for (int j = 0; j < K; ++j)
        if (!mask_on(bits, shift, yr, (K == 1 ? u : u * K) + j)) g.v[j] = T(0);
    Pack<T, K> xv;
    if (USE_X) xv = load_pack<T, K>(x, u);
    Pack<T, K> out;
    T m = 0, kx = 0, kc = 0, kd = 0;
#pragma unroll
    for (int j = 0; j < K; ++j) {
      if (j == 0 || !uniform) {
        const long long c = ch[j];
        kd = coef[3 * C + c];
        if (USE_X) {
          m = coef[c];
          kx = coef[C + c];
          kc = coef[2 * C + c];
        }
      }
      out.v[j] = USE_X ? (xv.v[j] - m) * kx + kc + g.v[j] * kd : g.v[j] * kd;
    }
    store_pack<T, K>(dx, u, out);
  });
}

}  // namespace mg

// ---- entry points ------------------------------------------------------------

#define MG_BN_KERNELS(T, SFX, W)                                                                 \
  extern "C" __global__ void bn_stats_planar_##SFX##_w##W(                                       \
      const T* x, long long pre, long long C, long long post_v, long long chunk, int splits,    \
      T* partial, unsigned* tickets, MG_BN_STATS_ARGS(T)) {                                      \
    MG_BN_STATS_OUT(T);                                                                           \
    mg::stats_planar<T, W>(x, pre, post_v, chunk, splits, partial, tickets, o);                \
  }                                                                                              \
  extern "C" __global__ void bn_stats_rows_##SFX##_w##W(                                         \
      const T* x, long long rows, long long C, long long chunk, int splits, T* partial,         \
      unsigned* tickets, MG_BN_STATS_ARGS(T)) {                                                  \
    MG_BN_STATS_OUT(T);                                                                           \
    mg::stats_rows<T, W>(x, rows, chunk, splits, partial, tickets, o);                          \
  }                                                                                              \
  extern "C" __global__ void bn_normalize_##SFX##_w##W(                                          \
      const T* x, T* y, long long total, long long C, long long post, const T* coef,           \
      int commit, T* est_mean, T* est_var, const T* newest, long long* counter,                 \
      unsigned* status, unsigned epoch, int relu) {                                              \
    mg::normalize_train<T, W>(x, y, total, C, post, coef, commit, est_mean, est_var, newest,   \
                              counter, status, epoch, relu);                                     \
  }                                                                                              \
  extern "C" __global__ void bn_infer_##SFX##_w##W(                                              \
      const T* x, T* y, long long total, long long C, long long post, const T* est_mean,       \
      const T* est_var, const T* scale, const T* bias, double eps, int relu) {                  \
    mg::normalize_infer<T, W>(x, y, total, C, post, est_mean, est_var, scale, bias, eps, relu); \
  }                                                                                              \
  extern "C" __global__ void bn_grad_planar_##SFX##_w##W(                                        \
      const T* x, const T* dy, long long pre, long long C, long long post_v, long long chunk,  \
      int splits, T* partial, unsigned* tickets, const T* scale, const T* mean, const T* var,  \
      double eps, double n, int use_global, T* dscale, T* dbias, T* coef, const T* yr,          \
      unsigned char* bits) {                                                                     \
    mg::GradOut<T> o{C, n, eps, use_global, scale, mean, var, dscale, dbias, coef};             \
    mg::grad_planar<T, W>(x, dy, pre, post_v, chunk, splits, partial, tickets, o, yr, bits);   \
  }                                                                                              \
  extern "C" __global__ void bn_grad_rows_##SFX##_w##W(                                          \
      const T* x, const T* dy, long long rows, long long C, long long chunk, int splits,       \
      T* partial, unsigned* tickets, const T* scale, const T* mean, const T* var, double eps,  \
      double n, int use_global, T* dscale, T* dbias, T* coef, const T* yr,                      \
      unsigned char* bits) {                                                                     \
    mg::GradOut<T> o{C, n, eps, use_global, scale, mean, var, dscale, dbias, coef};             \
    mg::grad_rows<T, W>(x, dy, rows, chunk, splits, partial, tickets, o, yr, bits);            \
  }                                                                                              \
  extern "C" __global__ void bn_grad_dx_##SFX##_w##W(                                            \
      const T* x, const T* dy, T* dx, long long total, long long C, long long post,             \
      const T* coef, const T* yr, const unsigned char* bits, int shift) {                       \
    mg::grad_dx<T, W, true>(x, dy, dx, total, C, post, coef, yr, bits, shift);                  \
  }                                                                                              \
  extern "C" __global__ void bn_grad_dx_global_##SFX##_w##W(                                     \
      const T* dy, T* dx, long long total, long long C, long long post, const T* coef,          \
      const T* yr, const unsigned char* bits, int shift) {                                       \
    mg::grad_dx<T, W, false>(nullptr, dy, dx, total, C, post, coef, yr, bits, shift);           \
  }                                                                                               \
  extern "C" __global__ void bn_local_stats_planar_##SFX##_w##W(                                  \
      const T* x, long long pre, long long C, long long post_v, long long chunk, int splits,      \
      T* partial, unsigned* tickets, double* sums) {                                              \
    const mg::SumsOut o{C, sums};                                                                 \
    mg::stats_planar<T, W>(x, pre, post_v, chunk, splits, partial, tickets, o);                   \
  }                                                                                               \
  extern "C" __global__ void bn_local_stats_rows_##SFX##_w##W(                                    \
      const T* x, long long rows, long long C, long long chunk, int splits, T* partial,           \
      unsigned* tickets, double* sums) {                                                          \
    const mg::SumsOut o{C, sums};                                                                 \
    mg::stats_rows<T, W>(x, rows, chunk, splits, partial, tickets, o);                            \
  }                                                                                               \
  extern "C" __global__ void bn_grad_sums_planar_##SFX##_w##W(                                    \
      const T* x, const T* dy, long long pre, long long C, long long post_v, long long chunk,     \
      int splits, T* partial, unsigned* tickets, const T* mean, double n, double* sums,           \
      const T* yr) {                                                                              \
    mg::GradSumsOut<T> o{C, n, mean, sums};                                                       \
    mg::grad_planar<T, W>(x, dy, pre, post_v, chunk, splits, partial, tickets, o, yr);            \
  }                                                                                               \
  extern "C" __global__ void bn_grad_sums_rows_##SFX##_w##W(                                      \
      const T* x, const T* dy, long long rows, long long C, long long chunk, int splits,          \
      T* partial, unsigned* tickets, const T* mean, double n, double* sums, const T* yr) {        \
    mg::GradSumsOut<T> o{C, n, mean, sums};                                                       \
    mg::grad_rows<T, W>(x, dy, rows, chunk, splits, partial, tickets, o, yr);                     \
  }

// Finishing every channel from global sums: one thread per channel.
#define MG_BN_FROM_SUMS_KERNELS(T, SFX)                                                           \
  extern "C" __global__ void bn_stats_from_sums_##SFX(const double* sums, long long C,            \
                                                      MG_BN_STATS_ARGS(T)) {                      \
    MG_BN_STATS_OUT(T);                                                                           \
    mg::stats_from_sums<T>(sums, o);                                                              \
  }                                                                                               \
  extern "C" __global__ void bn_grad_from_sums_##SFX(                                             \
      const double* sums, long long C, const T* scale, const T* mean, const T* var, double eps,   \
      T* dscale, T* dbias, T* coef, double out_scale) {                                           \
    mg::GradOut<T> o{C, 0.0, eps, 0, scale, mean, var, dscale, dbias, coef, out_scale};           \
    mg::grad_from_sums<T>(sums, o);                                                               \
  }

MG_BN_KERNELS(float, f32, 1)
MG_BN_KERNELS(float, f32, 4)
MG_BN_KERNELS(double, f64, 1)
MG_BN_KERNELS(double, f64, 2)
MG_BN_FROM_SUMS_KERNELS(float, f32)
MG_BN_FROM_SUMS_KERNELS(double, f64)

extern "C" __global__ void bn_merge_stats(const double* rows, long long K, long long C,
                                          double* out) {
  mg::merge_stats(rows, K, C, out);
}
