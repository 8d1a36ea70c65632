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
#include "common.cuh"

namespace mg {

// Everything a channel's finish step reads and writes (forward statistics).
template <typename T>
struct StatsOut {
  long long C;
  const T* scale;
  const T* bias;
  const T* est_mean;
  const T* est_var;
  const long long* counter;  // may be null
  double eps, momentum;
  int rule;                  // bit 0: momentum=None, est += (batch - est) / k;
                             // bit 1: no first-batch rule (PyTorch's _NormBase)
  unsigned epoch;
  T* batch_mean;
  T* batch_var;
  T* coef;                   // [3C]: mean rounded to T, scale*invstd, shifted bias
  T* newest;                 // [2C]: candidate estimates, committed by the normalize kernel
  unsigned* status;          // [0]: last flagged epoch, [1]: rejected batches
};

// n values of channel c had mean `shift + mean_s` and M2 `m2`.
template <typename T>
__device__ void finish_stats(long long c, double n, double shift, double mean_s, double m2,
                             const StatsOut<T>& o) {
  const double mean = shift + mean_s;
  const double var = m2 / n;
  o.batch_mean[c] = T(mean);
  o.batch_var[c] = T(var);
  const double invstd = 1.0 / sqrt(var + o.eps);
  const double k = double(o.scale[c]) * invstd;
  const T mean_t = T(mean);
  const long long C = o.C;
  o.coef[c] = mean_t;
  o.coef[C + c] = T(k);
  // x is centred on mean_t: fold the rounding of the mean into the bias
  o.coef[2 * C + c] = T(double(o.bias[c]) - (mean - double(mean_t)) * k);
  const double unbiased = var * (n / (n - 1.0));
  const double em = double(o.est_mean[c]), ev = double(o.est_var[c]);
  double new_mean, new_var;
  if (o.counter != nullptr && o.counter[0] == 0 && !(o.rule & 2)) {
    new_mean = mean;
    new_var = unbiased;
  } else if (o.rule & 1) {
    const double w = 1.0 / double(o.counter[0] + 1);
    new_mean = em + (mean - em) * w;
    new_var = ev + (unbiased - ev) * w;
  } else {
    new_mean = o.momentum * em + (1.0 - o.momentum) * mean;
    new_var = o.momentum * ev + (1.0 - o.momentum) * unbiased;
  }
  const T new_mean_t = T(new_mean), new_var_t = T(new_var);
  o.newest[c] = new_mean_t;
  o.newest[C + c] = new_var_t;
  // as the CPU kernel: statistics (double) and new estimates (T) must be finite
  if (!(isfinite(mean) && isfinite(var) && isfinite(double(new_mean_t)) &&
        isfinite(double(new_var_t))))
    o.status[0] = o.epoch;
}

template <typename T>
__device__ __forceinline__ void finish_channel(const StatsOut<T>& o, long long c, double n,
                                               double shift, double mean_s, double m2) {
  finish_stats<T>(c, n, shift, mean_s, m2, o);
}

// This rank's contribution to synchronized statistics, float64 [2C+1]:
// (n, mean_c..., M2_c...), merged over ranks (Chan) by the caller.
struct SumsOut {
  long long C;
  double* sums;
};

__device__ __forceinline__ void finish_channel(const SumsOut& o, long long c, double n,
                                               double shift, double mean_s, double m2) {
  if (c == 0) o.sums[0] = n;
  o.sums[1 + c] = shift + mean_s;
  o.sums[1 + o.C + c] = m2;
}

// Channel c of the whole batch's (N, mean, M2) (SumsOut's layout, merged over
// ranks by merge_stats or the host): the usual finish.
template <typename T>
__device__ void stats_from_sums(const double* __restrict__ sums, const StatsOut<T>& o) {
  const long long c = global_tid();
  if (c >= o.C) return;
  finish_stats<T>(c, sums[0], 0.0, sums[1 + c], sums[1 + o.C + c], o);
}

// Channel c of K ranks' (n, mean, M2) vectors (rows of 2C+1 doubles, SumsOut's
// layout) merged in rank order with Chan's formula - exact for offset data,
// unlike sums of squares; ranks with n == 0 add nothing. Same layout out.
__device__ void merge_stats(const double* __restrict__ rows, long long K, long long C,
                            double* __restrict__ out) {
  const long long c = global_tid();
  if (c >= C) return;
  double n = 0.0, mean = 0.0, m2 = 0.0;
  for (long long k = 0; k < K; ++k) {
    const double* r = rows + k * (2 * C + 1);
    const double nb = r[0];
    if (nb == 0.0) continue;
    if (n == 0.0) {
      n = nb;
      mean = r[1 + c];
      m2 = r[1 + C + c];
      continue;
    }
    const double total = n + nb, delta = r[1 + c] - mean;
    mean += delta * (nb / total);
    m2 += r[1 + C + c] + delta * delta * (n * nb / total);
    n = total;
  }
  if (c == 0) out[0] = n;
  out[1 + c] = mean;
  out[1 + C + c] = m2;
}

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
      T* p = partial + ((cv * W + k) * splits + s) * 3;
      p[0] = st.v[0];
      p[1] = st.v[1 + k];
      p[2] = st.v[1 + W + k];
    }
  }
  if (!arrive_last(tickets, blockIdx.x, splits)) return;
  Vals<double, 1 + 2 * W> f = zero_vals<double, 1 + 2 * W>();
  if (active) {
    for (int i = threadIdx.y; i < splits; i += blockDim.y) {
      Vals<double, 1 + 2 * W> b;
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const T* p = partial + ((cv * W + k) * splits + i) * 3;
        if (k == 0) b.v[0] = load_cg(p);
        b.v[1 + k] = load_cg(p + 1);
        b.v[1 + W + k] = load_cg(p + 2);
      }
      f = WelfordOp<double, W>::merge(f, b);
    }
  }
  f = column_merge<WelfordOp<double, W>>(f);
  if (owner)
#pragma unroll
    for (int k = 0; k < W; ++k)
      finish_channel(o, cv * W + k, f.v[0], shift[k], f.v[1 + k], f.v[1 + W + k]);
}

// y = (x - m) * k + b per channel over a flat (pre, C, post) tensor; `coef`
// gives (m, k, b) of a channel. Threads whose global index is < C commit the
// estimates afterwards (train) unless the epoch was flagged.
template <typename T, int W, bool REVERSE, class Coef>
__device__ __forceinline__ void normalize_flat(const T* __restrict__ x, T* __restrict__ y,
                                               long long total, long long C, long long post,
                                               Coef coef) {
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
      out.v[j] = (in.v[j] - m) * k + b;
    }
    store_pack<T, K>(y, u, out);
  });
}

template <typename T, int W>
__device__ void normalize_train(const T* x, T* y, long long total, long long C, long long post,
                                const T* __restrict__ coef, int commit, T* est_mean, T* est_var,
                                const T* newest, long long* counter, unsigned* status,
                                unsigned epoch) {
  if (commit) {
    const long long g = global_tid();
    const bool rejected = status[0] == epoch;
    if (g < C && !rejected) {
      est_mean[g] = newest[g];
      est_var[g] = newest[C + g];
    }
    if (g == 0) {
      if (rejected) status[1] += 1;
      else if (counter != nullptr) counter[0] += 1;
    }
  }
  // backwards: the end of x, read last by the statistics kernel, is still in L2
  normalize_flat<T, W, true>(x, y, total, C, post, [&](long long c, T& m, T& k, T& b) {
    m = coef[c];
    k = coef[C + c];
    b = coef[2 * C + c];
  });
}

template <typename T, int W>
__device__ void normalize_infer(const T* x, T* y, long long total, long long C, long long post,
                                const T* __restrict__ est_mean, const T* __restrict__ est_var,
                                const T* __restrict__ scale, const T* __restrict__ bias,
                                double eps) {
  const T eps_t = T(eps);
  normalize_flat<T, W, false>(x, y, total, C, post, [&](long long c, T& m, T& k, T& b) {
    m = est_mean[c];
    k = scale[c] * (T(1) / sqrt(est_var[c] + eps_t));
    b = bias[c];
  });
}

// ---- backward ----------------------------------------------------------------

template <typename T>
struct GradOut {
  long long C;
  double n, eps;
  int use_global;
  const T* scale;
  const T* mean;
  const T* var;
  T* dscale;   // may be null
  T* dbias;    // may be null
  T* coef;     // [4C]: mean, kx, kc, kd with dx = (x - mean) kx + kc + dy kd
};

template <typename T>
__device__ void finish_grad(long long c, double s_dy, double s_dyx, const GradOut<T>& o) {
  const double invstd = 1.0 / sqrt(double(o.var[c]) + o.eps);
  const double scale = double(o.scale[c]);
  if (o.dbias != nullptr) o.dbias[c] = T(s_dy);
  if (o.dscale != nullptr) o.dscale[c] = T(s_dyx * invstd);
  double kx = 0.0, kc = 0.0;
  if (!o.use_global) {
    kx = -scale * invstd * invstd * invstd * s_dyx / o.n;
    kc = -scale * invstd * s_dy / o.n;
  }
  const long long C = o.C;
  o.coef[c] = o.mean[c];
  o.coef[C + c] = T(kx);
  o.coef[2 * C + c] = T(kc);
  o.coef[3 * C + c] = T(scale * invstd);
}

template <typename T>
__device__ __forceinline__ void finish_grad_channel(const GradOut<T>& o, long long c, double s_dy,
                                                    double s_dyx) {
  finish_grad<T>(c, s_dy, s_dyx, o);
}

// This rank's contribution to synchronized gradients, float64 [2C+1]:
// (n, sum dy per channel..., sum dy (x - mean) per channel...).
template <typename T>
struct GradSumsOut {
  long long C;
  double n;
  const T* mean;
  double* sums;
};

template <typename T>
__device__ __forceinline__ void finish_grad_channel(const GradSumsOut<T>& o, long long c,
                                                    double s_dy, double s_dyx) {
  if (c == 0) o.sums[0] = o.n;
  o.sums[1 + c] = s_dy;
  o.sums[1 + o.C + c] = s_dyx;
}

// Channel c of the gradient from global sums (GradSumsOut's, summed over ranks);
// n is the global count sums[0].
template <typename T>
__device__ void grad_from_sums(const double* __restrict__ sums, GradOut<T> o) {
  const long long c = global_tid();
  if (c >= o.C) return;
  o.n = sums[0];
  finish_grad<T>(c, sums[1 + c], sums[1 + o.C + c], o);
}

template <typename T, int W, class Out>
__device__ void grad_planar(const T* __restrict__ x, const T* __restrict__ dy, long long pre,
                            long long post_v, long long chunk, int splits, T* partial,
                            unsigned* tickets, const Out& o) {
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
                          const Out& o) {
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
      T* p = partial + ((cv * W + k) * splits + s) * 2;
      p[0] = st.v[k];
      p[1] = st.v[W + k];
    }
  }
  if (!arrive_last(tickets, blockIdx.x, splits)) return;
  Vals<double, 2 * W> f = zero_vals<double, 2 * W>();
  if (active) {
    for (int i = threadIdx.y; i < splits; i += blockDim.y) {
#pragma unroll
      for (int k = 0; k < W; ++k) {
        const T* p = partial + ((cv * W + k) * splits + i) * 2;
        f.v[k] += load_cg(p);
        f.v[W + k] += load_cg(p + 1);
      }
    }
  }
  f = column_merge<SumOp<double, 2 * W>>(f);
  if (owner)
#pragma unroll
    for (int k = 0; k < W; ++k) finish_grad_channel(o, cv * W + k, f.v[k], f.v[W + k]);
}

template <typename T, int W, bool USE_X>
__device__ void grad_dx(const T* __restrict__ x, const T* __restrict__ dy, T* __restrict__ dx,
                        long long total, long long C, long long post, const T* __restrict__ coef) {
  // backwards, as normalize_train: x and dy were just read by the reduce kernel
  channel_elementwise<W, true>(total, C, post, [&](long long u, const auto& ch, bool uniform) {
    constexpr int K = sizeof(ch) / sizeof(ch[0]);
    const Pack<T, K> g = load_pack<T, K>(dy, u);
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

#define MG_BN_STATS_OUT(T)                                                                  \
  mg::StatsOut<T> o{C, scale, bias, est_mean, est_var, counter, eps, momentum, rule,       \
                    epoch, batch_mean, batch_var, coef, newest, status}

#define MG_BN_STATS_ARGS(T)                                                                   \
  const T *scale, const T *bias, const T *est_mean, const T *est_var,                         \
      const long long *counter, double eps, double momentum, int rule, unsigned epoch,       \
      T *batch_mean, T *batch_var, T *coef, T *newest, unsigned *status

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
      unsigned* status, unsigned epoch) {                                                        \
    mg::normalize_train<T, W>(x, y, total, C, post, coef, commit, est_mean, est_var, newest,   \
                              counter, status, epoch);                                           \
  }                                                                                              \
  extern "C" __global__ void bn_infer_##SFX##_w##W(                                              \
      const T* x, T* y, long long total, long long C, long long post, const T* est_mean,       \
      const T* est_var, const T* scale, const T* bias, double eps) {                            \
    mg::normalize_infer<T, W>(x, y, total, C, post, est_mean, est_var, scale, bias, eps);      \
  }                                                                                              \
  extern "C" __global__ void bn_grad_planar_##SFX##_w##W(                                        \
      const T* x, const T* dy, long long pre, long long C, long long post_v, long long chunk,  \
      int splits, T* partial, unsigned* tickets, const T* scale, const T* mean, const T* var,  \
      double eps, double n, int use_global, T* dscale, T* dbias, T* coef) {                     \
    mg::GradOut<T> o{C, n, eps, use_global, scale, mean, var, dscale, dbias, coef};             \
    mg::grad_planar<T, W>(x, dy, pre, post_v, chunk, splits, partial, tickets, o);             \
  }                                                                                              \
  extern "C" __global__ void bn_grad_rows_##SFX##_w##W(                                          \
      const T* x, const T* dy, long long rows, long long C, long long chunk, int splits,       \
      T* partial, unsigned* tickets, const T* scale, const T* mean, const T* var, double eps,  \
      double n, int use_global, T* dscale, T* dbias, T* coef) {                                 \
    mg::GradOut<T> o{C, n, eps, use_global, scale, mean, var, dscale, dbias, coef};             \
    mg::grad_rows<T, W>(x, dy, rows, chunk, splits, partial, tickets, o);                      \
  }                                                                                              \
  extern "C" __global__ void bn_grad_dx_##SFX##_w##W(const T* x, const T* dy, T* dx,             \
                                                     long long total, long long C,              \
                                                     long long post, const T* coef) {          \
    mg::grad_dx<T, W, true>(x, dy, dx, total, C, post, coef);                                   \
  }                                                                                              \
  extern "C" __global__ void bn_grad_dx_global_##SFX##_w##W(                                     \
      const T* dy, T* dx, long long total, long long C, long long post, const T* coef) {       \
    mg::grad_dx<T, W, false>(nullptr, dy, dx, total, C, post, coef);                            \
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
      int splits, T* partial, unsigned* tickets, const T* mean, double n, double* sums) {         \
    mg::GradSumsOut<T> o{C, n, mean, sums};                                                       \
    mg::grad_planar<T, W>(x, dy, pre, post_v, chunk, splits, partial, tickets, o);                \
  }                                                                                               \
  extern "C" __global__ void bn_grad_sums_rows_##SFX##_w##W(                                      \
      const T* x, const T* dy, long long rows, long long C, long long chunk, int splits,          \
      T* partial, unsigned* tickets, const T* mean, double n, double* sums) {                     \
    mg::GradSumsOut<T> o{C, n, mean, sums};                                                       \
    mg::grad_rows<T, W>(x, dy, rows, chunk, splits, partial, tickets, o);                         \
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
      T* dscale, T* dbias, T* coef) {                                                             \
    mg::GradOut<T> o{C, 0.0, eps, 0, scale, mean, var, dscale, dbias, coef};                      \
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
