// Channels-last group_norm / instance_norm (x (N, S, C)) and instance norm's running
// estimates; launched by norm_nhwc.py. The backward's dx coefficients come from norm.cu's
// norm_grad_finish, whose (sample, channel) planes n C + c the sums here are.
#include "batch_norm.cuh"

namespace mg {

// ---- channels last (NHWC) ---------------------------------------------------------
//
// x (N, S, C): sample n is an (S, C) matrix whose columns are its channels. The
// statistics and gradient sums are column reductions per (sample, channel)
// "plane" p = n C + c: grid (ceil(C / TX), min(N, 65535)), 2-D blocks (TX, TY),
// thread column tx owns channel blockIdx.x TX + tx (a warp reads TX adjacent
// channels of a row), rows s strided by TY, merged over the block's rows
// (column_merge); samples strided by gridDim.y. A finish kernel (one thread per
// statistics row n G + g) merges a group's cg channel planes (Chan) into the
// row's mean, variance and coefficients (norm_stats's); the gradient goes on
// with norm_grad_finish, whose planes n C + c these are. apply and dx are
// elementwise with the row and channel of each element.

// cstats[2 p] = mean, cstats[2 p + 1] = M2 of plane p over its S values (Welford,
// double).
template <typename T>
__device__ void norm_cl_stats(const T* __restrict__ x, long long N, long long S, long long C,
                              double* __restrict__ cstats) {
  using Op = WelfordOp<double, 1>;
  const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (long long n = blockIdx.y; n < N; n += gridDim.y) {
    typename Op::State st = Op::identity();
    if (c < C)
      for (long long s = threadIdx.y; s < S; s += blockDim.y) {
        const double d[1] = {double(x[(n * S + s) * C + c])};
        welford_push<double, 1, 1>(st, d);
      }
    st = column_merge<Op>(st);
    if (c < C && threadIdx.y == 0) {
      cstats[2 * (n * C + c)] = st.v[1];
      cstats[2 * (n * C + c) + 1] = st.v[2];
    }
  }
}

// One thread per statistics row r = n G + g: merge its cg planes (S values each)
// into mean[r], var[r] and coef (m, k, c) as norm_stats writes them.
template <typename T>
__device__ void norm_cl_finish(const double* __restrict__ cstats, long long rows, long long cg,
                               long long S, double eps, T* __restrict__ mean,
                               T* __restrict__ var, T* __restrict__ coef) {
  const long long r = global_tid();
  if (r >= rows) return;
  const double* p = cstats + 2 * r * cg;   // planes n C + g cg + j = r cg + j
  double mu = 0.0;
  for (long long j = 0; j < cg; ++j) mu += p[2 * j];
  mu /= double(cg);
  double m2 = 0.0;
  for (long long j = 0; j < cg; ++j) {
    const double d = p[2 * j] - mu;
    m2 += p[2 * j + 1] + double(S) * d * d;
  }
  const double variance = m2 / (double(S) * double(cg));
  const double k = 1.0 / sqrt(variance + eps);
  const T m = T(mu);
  mean[r] = m;
  var[r] = T(variance);
  coef[r] = m;
  coef[rows + r] = T(k);
  coef[2 * rows + r] = T((double(m) - mu) * k);
}

// Element e of x (N, S, C): its channel e % C and statistics row (e / (S C)) G + c / cg.
struct ClIndex {
  long long S, C, cg, G;
  __device__ __forceinline__ long long channel(long long e) const { return e % C; }
  __device__ __forceinline__ long long row(long long e, long long c) const {
    return (e / (S * C)) * G + c / cg;
  }
};

// y = xhat * scale[c] + bias[c] (scale, bias may be null).
template <typename T>
__device__ void norm_cl_apply(const T* __restrict__ x, T* __restrict__ y, long long total,
                              ClIndex ix, long long rows, const T* __restrict__ coef,
                              const T* __restrict__ scale, const T* __restrict__ bias) {
  for (long long e = global_tid(); e < total; e += global_threads()) {
    const long long c = ix.channel(e), r = ix.row(e, c);
    T v = (x[e] - coef[r]) * coef[rows + r] + coef[2 * rows + r];
    if (scale != nullptr) v *= scale[c];
    if (bias != nullptr) v += bias[c];
    y[e] = v;
  }
}

// sums[2 p] = sum of dy, sums[2 p + 1] = sum of dy (x - mean[row]) over plane p =
// n C + c, in double (norm_cl_stats's geometry).
template <typename T>
__device__ void norm_cl_grad_sums(const T* __restrict__ x, const T* __restrict__ dy,
                                  const T* __restrict__ mean, long long N, long long S,
                                  long long C, long long cg, double* __restrict__ sums) {
  using Op = SumOp<double, 2>;
  const long long c = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long G = C / cg;
  for (long long n = blockIdx.y; n < N; n += gridDim.y) {
    typename Op::State st = Op::identity();
    if (c < C) {
      const double m = double(mean[n * G + c / cg]);
      for (long long s = threadIdx.y; s < S; s += blockDim.y) {
        const long long e = (n * S + s) * C + c;
        const double g = double(dy[e]);
        st.v[0] += g;
        st.v[1] += g * (double(x[e]) - m);
      }
    }
    st = column_merge<Op>(st);
    if (c < C && threadIdx.y == 0) {
      sums[2 * (n * C + c)] = st.v[0];
      sums[2 * (n * C + c) + 1] = st.v[1];
    }
  }
}

// dx = dy scale[c] invstd + (x - mean) kx + kc with norm_grad_finish's coefficients
// per statistics row (scale may be null).
template <typename T>
__device__ void norm_cl_grad_dx(const T* __restrict__ x, const T* __restrict__ dy,
                                T* __restrict__ dx, long long total, ClIndex ix, long long rows,
                                const T* __restrict__ mean, const T* __restrict__ coef,
                                const T* __restrict__ scale) {
  for (long long e = global_tid(); e < total; e += global_threads()) {
    const long long c = ix.channel(e), r = ix.row(e, c);
    T g = dy[e];
    if (scale != nullptr) g *= scale[c];
    dx[e] = g * coef[r] + (x[e] - mean[r]) * coef[rows + r] + coef[2 * rows + r];
  }
}

// ---- running estimates of instance norm (tracked_instance_norm) -------------------

// One thread per channel c: the batch's mean (of the N instances' means) and variance
// (of their unbiased variances, S values each), blended into the estimates by `rule`
// (batch_norm.cu's: bit 0 the cumulative average, bit 1 no first-batch rule) into
// newest[2 C]; any non-finite value flags `epoch` in status[0].
template <typename T>
__device__ void norm_estimates(const T* __restrict__ mean, const T* __restrict__ var,
                               long long N, long long C, long long S, const T* est_mean,
                               const T* est_var, const long long* counter, double momentum,
                               int rule, T* __restrict__ newest, unsigned* status,
                               unsigned epoch) {
  const long long c = global_tid();
  if (c >= C) return;
  double bm = 0.0, bv = 0.0;
  for (long long n = 0; n < N; ++n) {
    bm += double(mean[n * C + c]);
    bv += double(var[n * C + c]) * (double(S) / double(S - 1));
  }
  bm /= double(N);
  bv /= double(N);
  const double em = double(est_mean[c]), ev = double(est_var[c]);
  double nm, nv;
  if (counter != nullptr && counter[0] == 0 && !(rule & 2)) {
    nm = bm;
    nv = bv;
  } else if (rule & 1) {
    const double w = 1.0 / double(counter[0] + 1);
    nm = em + (bm - em) * w;
    nv = ev + (bv - ev) * w;
  } else {
    nm = momentum * em + (1.0 - momentum) * bm;
    nv = momentum * ev + (1.0 - momentum) * bv;
  }
  const T nm_t = T(nm), nv_t = T(nv);
  newest[c] = nm_t;
  newest[C + c] = nv_t;
  if (!(isfinite(bm) && isfinite(bv) && isfinite(double(nm_t)) && isfinite(double(nv_t))))
    status[0] = epoch;
}

}  // namespace mg

// ---- entry points ------------------------------------------------------------------

#define MG_NORM_CL_KERNELS(T, SFX)                                                              \
  extern "C" __global__ void norm_cl_stats_##SFX(const T* x, long long N, long long S,          \
                                                 long long C, double* cstats) {                 \
    mg::norm_cl_stats<T>(x, N, S, C, cstats);                                                   \
  }                                                                                             \
  extern "C" __global__ void norm_cl_finish_##SFX(const double* cstats, long long rows,         \
                                                  long long cg, long long S, double eps,        \
                                                  T* mean, T* var, T* coef) {                   \
    mg::norm_cl_finish<T>(cstats, rows, cg, S, eps, mean, var, coef);                           \
  }                                                                                             \
  extern "C" __global__ void norm_cl_apply_##SFX(const T* x, T* y, long long total, long long S, \
                                                 long long C, long long cg, long long rows,     \
                                                 const T* coef, const T* scale,                 \
                                                 const T* bias) {                               \
    mg::norm_cl_apply<T>(x, y, total, mg::ClIndex{S, C, cg, C / cg}, rows, coef, scale, bias); \
  }                                                                                             \
  extern "C" __global__ void norm_cl_grad_sums_##SFX(const T* x, const T* dy, const T* mean,    \
                                                     long long N, long long S, long long C,     \
                                                     long long cg, double* sums) {              \
    mg::norm_cl_grad_sums<T>(x, dy, mean, N, S, C, cg, sums);                                   \
  }                                                                                             \
  extern "C" __global__ void norm_cl_grad_dx_##SFX(                                             \
      const T* x, const T* dy, T* dx, long long total, long long S, long long C, long long cg,  \
      long long rows, const T* mean, const T* coef, const T* scale) {                           \
    mg::norm_cl_grad_dx<T>(x, dy, dx, total, mg::ClIndex{S, C, cg, C / cg}, rows, mean, coef,  \
                           scale);                                                              \
  }                                                                                             \
  extern "C" __global__ void norm_estimates_##SFX(                                              \
      const T* mean, const T* var, long long N, long long C, long long S, const T* est_mean,    \
      const T* est_var, const long long* counter, double momentum, int rule, T* newest,         \
      unsigned* status, unsigned epoch) {                                                       \
    mg::norm_estimates<T>(mean, var, N, C, S, est_mean, est_var, counter, momentum, rule,       \
                          newest, status, epoch);                                               \
  }                                                                                             \
  extern "C" __global__ void norm_estimates_commit_##SFX(long long C, const T* newest,          \
                                                         T* est_mean, T* est_var,               \
                                                         long long* counter, unsigned* status,  \
                                                         unsigned epoch) {                      \
    mg::commit_estimates<T>(mg::global_tid(), C, newest, est_mean, est_var, counter, status,    \
                            epoch);                                                             \
  }

MG_NORM_CL_KERNELS(float, f32)
MG_NORM_CL_KERNELS(double, f64)
