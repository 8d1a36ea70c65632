// Batch norm with a group of channels resident in shared memory (NCHW, small planes):
// one launch per pass, x (and dy) read from global memory once.
//
// x is (N, C, HW), HW > 1. A group is G consecutive channels c0 .. c0 + G - 1; in
// sample n its values are one contiguous run of L = G HW values starting at
// s_n = (n C + c0) HW. A CTA copies a group's N runs into dynamic shared memory with
// asynchronous copies (16-byte packs; a run's unaligned head and tail value by
// value), row n at buf[n R + p_n + e] (e < L, p_n = s_n mod W), so a 16-byte pack
// of global memory is a 16-byte pack of shared memory. CTAs are persistent: CTA b
// takes groups b, b + gridDim.x, ...; with nbuf == 2 the next group's copies are
// issued into the other buffer before the current one is worked on.
//
//   train     exact two-pass statistics from shared memory (each thread sums its
//             columns in T, the sums are merged in double), each channel's finish
//             (batch_norm.cuh: statistics, coefficients, candidate estimates, the
//             non-finite flag), then y (ReLU optional) from shared memory with
//             16-byte stores; the last CTA commits the estimates and the counter
//             unless the launch's epoch was flagged.
//   backward  x and dy resident (and y, whose sign masks dy, for batch_norm_relu):
//             the sums of dy and dy (x - mean), dscale, dbias, then dx.
//
// Threads and columns: a thread owns one column e of the group's runs (when
// L <= threads: e = t % L, rows t / L, t / L + threads / L, ...) or, with one
// channel per group and HW > threads, the columns t, t + threads, ... of every row.
// Either way its values belong to one channel.
//
// Shared memory, in bytes and in this order (the launcher computes the same):
//   part   2 * threads doubles   per-thread partial sums
//   coef   G * 4 T               per channel: m, k, b (train) or m, kx, kc, kd
//   chan   L' unsigned short     the channel of each column (L' = L when L <= threads,
//                                else 0), rounded up to 16 bytes
//   bufs   nbuf * planes * N * R T   planes: 1 (train), 2 (x, dy) or 3 (x, dy, y)
#include "batch_norm.cuh"

namespace mg {

template <typename T>
struct ResidentLayout {
  double* part;
  T* coef;
  unsigned short* chan;
  T* bufs;
  long long plane;   // values of one plane of one buffer: N R
};

template <typename T>
__device__ ResidentLayout<T> resident_layout(long long N, int G, int HW, int R) {
  const int threads = blockDim.x;
  const int L = G * HW;
  unsigned char* base = dynamic_shared<unsigned char>();
  ResidentLayout<T> s;
  s.part = reinterpret_cast<double*>(base);
  base += 2 * threads * sizeof(double);
  s.coef = reinterpret_cast<T*>(base);
  base += 4 * G * sizeof(T);
  s.chan = reinterpret_cast<unsigned short*>(base);
  const int chan_bytes = L <= threads ? L * int(sizeof(unsigned short)) : 0;
  base += (chan_bytes + 15) / 16 * 16;
  s.bufs = reinterpret_cast<T*>(base);
  s.plane = N * R;
  return s;
}

// One group: its first channel, its channels and values per run.
struct GroupShape {
  long long c0;
  int G, L;
};

__device__ __forceinline__ GroupShape group_shape(long long g, long long C, int G, int HW) {
  GroupShape s;
  s.c0 = g * G;
  s.G = int(C - s.c0 < G ? C - s.c0 : G);
  s.L = s.G * HW;
  return s;
}

// Visit the packs of a group's runs, thread-strided: f(n, p, at, lo, full) for pack
// [lo, lo + W) of row n's span in shared memory (values from p are the run's), `at`
// the global index of its first value, `full` when the whole pack is the run's.
template <int W, class F>
__device__ __forceinline__ void group_packs(long long N, long long C, long long HW,
                                            const GroupShape& g, int R, F&& f) {
  const unsigned packs = unsigned(R / W);
  const unsigned items = unsigned(N) * packs;
  for (unsigned i = threadIdx.x; i < items; i += blockDim.x) {
    const unsigned n = i / packs, k = i - n * packs;
    const long long s = (n * C + g.c0) * HW;
    const int p = int(s & (W - 1));
    const int lo = int(k) * W;
    if (lo + W <= p || lo >= p + g.L) continue;
    f(n, p, s - p + lo, lo, lo >= p && lo + W <= p + g.L);
  }
}

// Issue the copies of a group's runs of `src` into `buf` (a plane of N R values).
template <typename T, int W>
__device__ __forceinline__ void issue_group(T* buf, const T* src, long long N, long long C,
                                            long long HW, const GroupShape& g, int R) {
  group_packs<W>(N, C, HW, g, R, [&](unsigned n, int p, long long at, int lo, bool full) {
    T* row = buf + (long long)n * R;
    if (full) {
      async_copy<W * sizeof(T)>(row + lo, src + at);
      return;
    }
    const int a = lo > p ? lo : p, b = lo + W < p + g.L ? lo + W : p + g.L;
    for (int j = a; j < b; ++j) async_copy<sizeof(T)>(row + j, src + at + (j - lo));
  });
}

// Where a thread's values are: columns col0, col0 + cstep, ... < L of rows
// r0, r0 + rstep, ... < N (inactive when r0 >= rstep).
struct Columns {
  int col0, cstep, r0, rstep;
};

__device__ __forceinline__ Columns thread_columns(int L) {
  const int t = threadIdx.x, threads = blockDim.x;
  if (L <= threads) return Columns{t % L, L, t / L, threads / L};
  return Columns{t, threads, 0, 1};
}

// The channel (within the group) of the thread's columns.
__device__ __forceinline__ int thread_channel(const Columns& cols, int L, int HW) {
  return L <= int(blockDim.x) ? cols.col0 / HW : 0;
}

// For each column of the thread (rows of its row set): f(value index in a plane).
// p_n = s_n mod W changes by (rstep C HW) mod W from one of the thread's rows to the next.
template <int W, class F>
__device__ __forceinline__ void thread_values(long long N, long long C, long long HW,
                                              const GroupShape& g, int R, const Columns& cols,
                                              F&& f) {
  if (cols.r0 >= cols.rstep) return;
  const int dp = int((cols.rstep * C * HW) & (W - 1));
  const int p0 = int(((cols.r0 * C + g.c0) * HW) & (W - 1));
  for (int col = cols.col0; col < g.L; col += cols.cstep) {
    int p = p0;
    for (long long n = cols.r0; n < N; n += cols.rstep) {
      f(n * R + p + col);
      p = (p + dp) & (W - 1);
    }
  }
}

// Per channel of the group, the totals of the threads' partials part[t] and
// part[threads + t] (in double); warp w finishes channels w, w + warps, ... and calls
// f(channel, total0, total1) in its lane 0. Threads of channel gc: (L <= threads)
// t = gc HW + q + k L for q < HW, k < rstep; (L > threads, one channel) all.
template <class F>
__device__ __forceinline__ void channel_totals(const double* part, const GroupShape& g, int HW,
                                               F&& f) {
  const int threads = blockDim.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int warps = threads >> 5;
  const bool columns = g.L <= threads;
  const int rstep = columns ? threads / g.L : 1;
  const int span = columns ? HW * rstep : threads;
  for (int gc = warp; gc < g.G; gc += warps) {
    double a = 0.0, b = 0.0;
    for (int j = lane; j < span; j += 32) {
      const int t = columns ? gc * HW + j % HW + (j / HW) * g.L : j;
      a += part[t];
      b += part[threads + t];
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      a += __shfl_xor_sync(FULL_MASK, a, off);
      b += __shfl_xor_sync(FULL_MASK, b, off);
    }
    if (lane == 0) f(gc, a, b);
  }
}

// The channel of value e of a run (shared table, or 0 with one channel per group).
__device__ __forceinline__ int value_channel(const unsigned short* chan, int e, int L) {
  return L <= int(blockDim.x) ? chan[e] : 0;
}

template <typename T>
__device__ void fill_channels(unsigned short* chan, int L, int HW) {
  if (L > int(blockDim.x)) return;
  for (int e = threadIdx.x; e < L; e += blockDim.x) chan[e] = (unsigned short)(e / HW);
}

// ---- training forward -------------------------------------------------------------

template <typename T, int W>
__device__ void resident_train(const T* x, T* y, long long N, long long C, int HW, int G,
                               long long groups, int R, int nbuf, int relu,
                               unsigned* tickets, const StatsOut<T>& o) {
  const ResidentLayout<T> s = resident_layout<T>(N, G, HW, R);
  const int threads = blockDim.x, t = threadIdx.x;
  const double n_values = double(N) * double(HW);
  fill_channels<T>(s.chan, G * HW, HW);
  long long g_at = blockIdx.x;
  int cur = 0;
  if (g_at < groups) issue_group<T, W>(s.bufs, x, N, C, HW, group_shape(g_at, C, G, HW), R);
  async_commit();
  for (; g_at < groups; g_at += gridDim.x) {
    const GroupShape g = group_shape(g_at, C, G, HW);
    const long long next = g_at + gridDim.x;
    if (nbuf == 2 && next < groups)
      issue_group<T, W>(s.bufs + (cur ^ 1) * s.plane, x, N, C, HW,
                        group_shape(next, C, G, HW), R);
    async_commit();
    async_wait_prior<1>();          // every group but the newest: this one is in
    __syncthreads();
    const T* buf = s.bufs + cur * s.plane;
    const Columns cols = thread_columns(g.L);
    const int mine = thread_channel(cols, g.L, HW);
    // pass 1: the mean
    T sum = T(0);
    thread_values<W>(N, C, HW, g, R, cols, [&](long long i) { sum += buf[i]; });
    s.part[t] = double(sum);
    s.part[threads + t] = 0.0;
    __syncthreads();
    channel_totals(s.part, g, HW, [&](int gc, double total, double) {
      s.coef[4 * gc] = T(total / n_values);
    });
    __syncthreads();
    // pass 2: sums of d = x - mean (rounded to T) and d^2; M2 = sum d^2 - (sum d)^2 / n
    const T m = s.coef[4 * mine];
    T sd = T(0), sd2 = T(0);
    thread_values<W>(N, C, HW, g, R, cols, [&](long long i) {
      const T d = buf[i] - m;
      sd += d;
      sd2 += d * d;
    });
    __syncthreads();                // every thread has read its mean
    s.part[t] = double(sd2);
    s.part[threads + t] = double(sd);
    __syncthreads();
    channel_totals(s.part, g, HW, [&](int gc, double s2, double s1) {
      const double shift = double(s.coef[4 * gc]);
      const NormCoef<T> k = finish_stats<T>(g.c0 + gc, n_values, shift, s1 / n_values,
                                            s2 - s1 * (s1 / n_values), o);
      s.coef[4 * gc] = k.m;
      s.coef[4 * gc + 1] = k.k;
      s.coef[4 * gc + 2] = k.b;
    });
    __syncthreads();
    // y from shared memory
    group_packs<W>(N, C, HW, g, R, [&](unsigned n, int p, long long at, int lo, bool full) {
      const T* row = buf + (long long)n * R;
      if (full) {
        const Pack<T, W> in = *reinterpret_cast<const Pack<T, W>*>(row + lo);
        Pack<T, W> out;
#pragma unroll
        for (int j = 0; j < W; ++j) {
          const T* k = s.coef + 4 * value_channel(s.chan, lo + j - p, g.L);
          const T v = (in.v[j] - k[0]) * k[1] + k[2];
          out.v[j] = relu ? relu_of(v) : v;
        }
        *reinterpret_cast<Pack<T, W>*>(y + at) = out;
        return;
      }
      const int a = lo > p ? lo : p, b = lo + W < p + g.L ? lo + W : p + g.L;
      for (int j = a; j < b; ++j) {
        const T* k = s.coef + 4 * value_channel(s.chan, j - p, g.L);
        const T v = (row[j] - k[0]) * k[1] + k[2];
        y[at + (j - lo)] = relu ? relu_of(v) : v;
      }
    });
    if (nbuf == 1 && next < groups) {
      __syncthreads();              // the buffer is read: refill it
      issue_group<T, W>(s.bufs, x, N, C, HW, group_shape(next, C, G, HW), R);
      async_commit();
    }
    __syncthreads();                // before the other buffer (or this one) is refilled
    if (nbuf == 2) cur ^= 1;
  }
  // the last CTA commits the estimates and the counter, unless a channel was flagged
  if (!arrive_last(tickets, 0, gridDim.x)) return;
  const bool rejected = load_cg(o.status) == o.epoch;
  T* est_mean = const_cast<T*>(o.est_mean);
  T* est_var = const_cast<T*>(o.est_var);
  if (!rejected)
    for (long long c = t; c < C; c += threads) {
      est_mean[c] = load_cg(o.newest + c);
      est_var[c] = load_cg(o.newest + C + c);
    }
  if (t == 0) {
    if (rejected) o.status[1] += 1;
    else if (o.counter != nullptr) const_cast<long long*>(o.counter)[0] += 1;
  }
}

// ---- backward ---------------------------------------------------------------------

template <typename T, int W>
__device__ void resident_grad(const T* x, const T* dy, const T* yr, T* dx, long long N,
                              long long C, int HW, int G, long long groups, int R, int nbuf,
                              GradOut<T> o) {
  const int planes = yr != nullptr ? 3 : 2;
  const ResidentLayout<T> s = resident_layout<T>(N, G, HW, R);
  const int threads = blockDim.x, t = threadIdx.x;
  const long long stride = planes * s.plane;        // one buffer: x, dy (, y)
  fill_channels<T>(s.chan, G * HW, HW);
  auto issue = [&](T* buf, const GroupShape& g) {
    issue_group<T, W>(buf, x, N, C, HW, g, R);
    issue_group<T, W>(buf + s.plane, dy, N, C, HW, g, R);
    if (yr != nullptr) issue_group<T, W>(buf + 2 * s.plane, yr, N, C, HW, g, R);
  };
  long long g_at = blockIdx.x;
  int cur = 0;
  if (g_at < groups) issue(s.bufs, group_shape(g_at, C, G, HW));
  async_commit();
  for (; g_at < groups; g_at += gridDim.x) {
    const GroupShape g = group_shape(g_at, C, G, HW);
    const long long next = g_at + gridDim.x;
    if (nbuf == 2 && next < groups) issue(s.bufs + (cur ^ 1) * stride, group_shape(next, C, G, HW));
    async_commit();
    async_wait_prior<1>();
    __syncthreads();
    const T* bx = s.bufs + cur * stride;
    const T* bg = bx + s.plane;
    const T* by = bx + 2 * s.plane;
    const Columns cols = thread_columns(g.L);
    const int mine = thread_channel(cols, g.L, HW);
    const T m = cols.r0 < cols.rstep ? o.mean[g.c0 + mine] : T(0);
    T s1 = T(0), s2 = T(0);
    thread_values<W>(N, C, HW, g, R, cols, [&](long long i) {
      const T gv = yr != nullptr && !(by[i] > T(0)) ? T(0) : bg[i];
      s1 += gv;
      s2 += gv * (bx[i] - m);
    });
    s.part[t] = double(s1);
    s.part[threads + t] = double(s2);
    __syncthreads();
    channel_totals(s.part, g, HW, [&](int gc, double s_dy, double s_dyx) {
      const GradCoef<T> k = finish_grad<T>(g.c0 + gc, s_dy, s_dyx, o);
      s.coef[4 * gc] = k.m;
      s.coef[4 * gc + 1] = k.kx;
      s.coef[4 * gc + 2] = k.kc;
      s.coef[4 * gc + 3] = k.kd;
    });
    __syncthreads();
    if (dx != nullptr)
      group_packs<W>(N, C, HW, g, R, [&](unsigned n, int p, long long at, int lo, bool full) {
        const long long row = (long long)n * R;
        auto dx_of = [&](int e) {
          const T* k = s.coef + 4 * value_channel(s.chan, e - p, g.L);
          const T gv = yr != nullptr && !(by[row + e] > T(0)) ? T(0) : bg[row + e];
          return (bx[row + e] - k[0]) * k[1] + k[2] + gv * k[3];
        };
        if (full) {
          Pack<T, W> out;
#pragma unroll
          for (int j = 0; j < W; ++j) out.v[j] = dx_of(lo + j);
          *reinterpret_cast<Pack<T, W>*>(dx + at) = out;
          return;
        }
        const int a = lo > p ? lo : p, b = lo + W < p + g.L ? lo + W : p + g.L;
        for (int e = a; e < b; ++e) dx[at + (e - lo)] = dx_of(e);
      });
    if (nbuf == 1 && next < groups) {
      __syncthreads();
      issue(s.bufs, group_shape(next, C, G, HW));
      async_commit();
    }
    __syncthreads();
    if (nbuf == 2) cur ^= 1;
  }
}

}  // namespace mg

// ---- entry points ------------------------------------------------------------------

#define MG_BN_RESIDENT_KERNELS(T, SFX, W)                                                     \
  extern "C" __global__ void __launch_bounds__(1024, 1) bn_resident_train_##SFX##_w##W(     \
      const T* x, T* y, long long N, long long C, int HW, int G, long long groups, int R,     \
      int nbuf, int relu, unsigned* tickets, MG_BN_STATS_ARGS(T)) {                           \
    MG_BN_STATS_OUT(T);                                                                        \
    mg::resident_train<T, W>(x, y, N, C, HW, G, groups, R, nbuf, relu, tickets, o);           \
  }                                                                                            \
  extern "C" __global__ void __launch_bounds__(1024, 1) bn_resident_grad_##SFX##_w##W(      \
      const T* x, const T* dy, const T* yr, T* dx, long long N, long long C, int HW, int G,   \
      long long groups, int R, int nbuf, const T* scale, const T* mean, const T* var,         \
      double eps, int use_global, T* dscale, T* dbias) {                                       \
    mg::GradOut<T> o{C, double(N) * double(HW), eps, use_global, scale, mean, var, dscale,   \
                     dbias, nullptr};                                                          \
    mg::resident_grad<T, W>(x, dy, yr, dx, N, C, HW, G, groups, R, nbuf, o);                 \
  }

MG_BN_RESIDENT_KERNELS(float, f32, 1)
MG_BN_RESIDENT_KERNELS(float, f32, 4)
MG_BN_RESIDENT_KERNELS(double, f64, 1)
MG_BN_RESIDENT_KERNELS(double, f64, 2)
