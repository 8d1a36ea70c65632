// Batch norm's per-channel finish steps, shared by every batch-norm kernel module
// (batch_norm.cu: the split reductions; bn_resident.cu: a channel group resident in
// shared memory). A reduction ends each channel with its count, mean and M2 (or, in
// backward, the sums of dy and dy (x - mean)) and hands them to one of these:
//   StatsOut / finish_stats   batch statistics, normalisation coefficients, the
//                             candidate estimates and the non-finite flag;
//   SumsOut                   this rank's (n, mean, M2) for synchronized batch norm;
//   GradOut / finish_grad     dscale, dbias and the dx coefficients;
//   GradSumsOut               this rank's (n, sum dy, sum dy (x - mean)).
#pragma once

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
  T* coef;                   // [3C]: mean rounded to T, scale*invstd, shifted bias; or null
  T* newest;                 // [2C]: candidate estimates, committed by the normalize kernel
  unsigned* status;          // [0]: last flagged epoch, [1]: rejected batches
};

// n values of channel c had mean `shift + mean_s` and M2 `m2`.
// relu, as the relu op computes it: NaN passes, -0 gives +0 (batch_norm_relu).
template <typename T>
__device__ __forceinline__ T relu_of(T v) {
  return (v > T(0) || v != v) ? v : T(0);
}

// Whether value e passes batch_norm_relu's mask: bit (e mod 2^shift) of byte
// e >> shift of `bits` (the reduction's packs of 2^shift values), else y[e] > 0.
template <typename T>
__device__ __forceinline__ bool mask_on(const unsigned char* bits, int shift, const T* yr,
                                        long long e) {
  if (bits != nullptr) return (bits[e >> shift] >> (e & ((1 << shift) - 1))) & 1;
  return yr[e] > T(0);
}

// Normalisation y = (x - m) k + b for one channel.
template <typename T>
struct NormCoef {
  T m, k, b;
};

template <typename T>
__device__ NormCoef<T> finish_stats(long long c, double n, double shift, double mean_s,
                                    double m2, const StatsOut<T>& o) {
  const double mean = shift + mean_s;
  const double var = m2 / n;
  o.batch_mean[c] = T(mean);
  o.batch_var[c] = T(var);
  const double invstd = 1.0 / sqrt(var + o.eps);
  const double k = double(o.scale[c]) * invstd;
  const T mean_t = T(mean);
  const long long C = o.C;
  // x is centred on mean_t: fold the rounding of the mean into the bias
  const NormCoef<T> coef{mean_t, T(k), T(double(o.bias[c]) - (mean - double(mean_t)) * k)};
  if (o.coef != nullptr) {
    o.coef[c] = coef.m;
    o.coef[C + c] = coef.k;
    o.coef[2 * C + c] = coef.b;
  }
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
  return coef;
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
  T* coef;     // [4C]: mean, kx, kc, kd with dx = (x - mean) kx + kc + dy kd; may be null
  double out_scale = 1.0;   // dscale and dbias are multiplied by it (sync: 1 / ranks)
};

// dx = (x - m) kx + kc + dy kd for one channel.
template <typename T>
struct GradCoef {
  T m, kx, kc, kd;
};

template <typename T>
__device__ GradCoef<T> finish_grad(long long c, double s_dy, double s_dyx, const GradOut<T>& o) {
  const double invstd = 1.0 / sqrt(double(o.var[c]) + o.eps);
  const double scale = double(o.scale[c]);
  if (o.dbias != nullptr) o.dbias[c] = T(s_dy * o.out_scale);
  if (o.dscale != nullptr) o.dscale[c] = T(s_dyx * invstd * o.out_scale);
  double kx = 0.0, kc = 0.0;
  if (!o.use_global) {
    kx = -scale * invstd * invstd * invstd * s_dyx / o.n;
    kc = -scale * invstd * s_dy / o.n;
  }
  const GradCoef<T> k{o.mean[c], T(kx), T(kc), T(scale * invstd)};
  if (o.coef != nullptr) {
    const long long C = o.C;
    o.coef[c] = k.m;
    o.coef[C + c] = k.kx;
    o.coef[2 * C + c] = k.kc;
    o.coef[3 * C + c] = k.kd;
  }
  return k;
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
// n is the global count sums[0]; o.out_scale (1 / ranks under data parallelism)
// scales dscale and dbias.
template <typename T>
__device__ void grad_from_sums(const double* __restrict__ sums, GradOut<T> o) {
  const long long c = global_tid();
  if (c >= o.C) return;
  o.n = sums[0];
  finish_grad<T>(c, sums[1 + c], sums[1 + o.C + c], o);
}

// Thread g of a normalize (or commit) launch: commit the candidate estimates `newest`
// ([2C]: means, then variances) and count the batch, unless this launch's epoch was
// flagged non-finite: then count it as rejected (status[1]) and write nothing.
template <typename T>
__device__ __forceinline__ void commit_estimates(long long g, long long C,
                                                 const T* __restrict__ newest, T* est_mean,
                                                 T* est_var, long long* counter,
                                                 unsigned* status, unsigned epoch) {
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

}  // namespace mg

// The StatsOut arguments every statistics entry point ends with, and the StatsOut `o`
// made of them (the launchers' _Training.stats_args).
#define MG_BN_STATS_OUT(T)                                                                  \
  mg::StatsOut<T> o{C, scale, bias, est_mean, est_var, counter, eps, momentum, rule,       \
                    epoch, batch_mean, batch_var, coef, newest, status}

#define MG_BN_STATS_ARGS(T)                                                                   \
  const T *scale, const T *bias, const T *est_mean, const T *est_var,                         \
      const long long *counter, double eps, double momentum, int rule, unsigned epoch,       \
      T *batch_mean, T *batch_var, T *coef, T *newest, unsigned *status
