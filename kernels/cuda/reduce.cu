// reduce_sum / reduce_mean / reduce_max over any set of axes, and their gradients.
//
// Shapes arrive collapsed (kernels/cuda/strided.cuh): x is seen through its kept
// dims (kn, x strides ks) and its reduced dims (rn, strides rs); out is
// contiguous in kept order. Two layouts of the same reduction:
//   rows: one 1-D block per output, its threads strided over the reduced
//         positions (the innermost dim is reduced: consecutive threads read
//         consecutive values);
//   cols: 2-D blocks (32 x TY): threadIdx.x picks one of 32 consecutive outputs,
//         threadIdx.y strides over the reduced positions (the innermost dim is
//         kept: a warp reads 32 consecutive values).
// op SUM adds in double and writes sum / divisor (1 for a sum, the count for
// a mean); op MAX takes the maximum, NaN winning as in numpy.
// reduce_max_grad: dx = dout / ties where x equals out, else 0, ties the number of
// such values of the output (the share in double). broadcast_back: dx[e] =
// dout at e's output / divisor, in double (reduce_sum's and reduce_mean's grads).
#include "map.cuh"
#include "strided.cuh"

MG_UNARY_MAP_S(divide_by, x, n, x / n)

namespace mg {

enum ReduceKind { SUM = 0, MAX = 1 };

// The maximum with NaN winning (numpy's max), on doubles.
struct NanMaxOp {
  using State = Vals<double, 1>;
  static __device__ __forceinline__ State identity() { return State{{-HUGE_VAL}}; }
  static __device__ __forceinline__ State merge(const State& a, const State& b) {
    if (a.v[0] != a.v[0]) return a;
    if (b.v[0] != b.v[0]) return b;
    return b.v[0] > a.v[0] ? b : a;
  }
};

using DSum = SumOp<double, 1>;

template <typename T>
__device__ __forceinline__ Vals<double, 1> fold(int op, Vals<double, 1> s, T v) {
  const Vals<double, 1> e{{double(v)}};
  return op == SUM ? DSum::merge(s, e) : NanMaxOp::merge(s, e);
}

template <typename T>
__device__ __forceinline__ T finish(int op, const Vals<double, 1>& s, double divisor) {
  return op == SUM ? T(s.v[0] / divisor) : T(s.v[0]);
}

// The state of the reduced positions r = first, first + step, ... of one output
// (x offset `base`).
template <typename T>
__device__ __forceinline__ Vals<double, 1> fold_strided(int op, const T* __restrict__ x,
                                                        long long base, long long first,
                                                        long long step, long long reduced,
                                                        const Dims& rn, const Dims& rs) {
  Vals<double, 1> s = op == SUM ? DSum::identity() : NanMaxOp::identity();
  if (first >= reduced) return s;
  Cursor c;
  c.init(first, step, rn);
  for (long long r = first; r < reduced; r += step) {
    s = fold(op, s, x[base + c.offset(rs)]);
    c.advance(rn);
  }
  return s;
}

template <typename T>
__device__ void reduce_rows(const T* __restrict__ x, T* __restrict__ out, long long kept,
                            long long reduced, int op, double divisor, const Dims kn,
                            const Dims ks, const Dims rn, const Dims rs) {
  for (long long k = blockIdx.x; k < kept; k += gridDim.x) {
    Vals<double, 1> s = fold_strided(op, x, offset_of(k, kn, ks), threadIdx.x, blockDim.x,
                                     reduced, rn, rs);
    s = op == SUM ? block_merge<DSum>(s) : block_merge<NanMaxOp>(s);
    if (threadIdx.x == 0) out[k] = finish<T>(op, s, divisor);
  }
}

template <typename T>
__device__ void reduce_cols(const T* __restrict__ x, T* __restrict__ out, long long kept,
                            long long reduced, int op, double divisor, const Dims kn,
                            const Dims ks, const Dims rn, const Dims rs) {
  const long long TX = blockDim.x;
  for (long long k0 = blockIdx.x * TX; k0 < kept; k0 += gridDim.x * TX) {
    const long long k = k0 + threadIdx.x;
    Vals<double, 1> s = op == SUM ? DSum::identity() : NanMaxOp::identity();
    if (k < kept)
      s = fold_strided(op, x, offset_of(k, kn, ks), threadIdx.y, blockDim.y, reduced, rn, rs);
    s = op == SUM ? column_merge<DSum>(s) : column_merge<NanMaxOp>(s);
    if (threadIdx.y == 0 && k < kept) out[k] = finish<T>(op, s, divisor);
  }
}

// Ties of output k among the reduced positions first, first + step, ...
template <typename T>
__device__ __forceinline__ double count_ties(const T* __restrict__ x, T best, long long base,
                                             long long first, long long step,
                                             long long reduced, const Dims& rn,
                                             const Dims& rs) {
  double n = 0.0;
  if (first >= reduced) return n;
  Cursor c;
  c.init(first, step, rn);
  for (long long r = first; r < reduced; r += step) {
    n += x[base + c.offset(rs)] == best ? 1.0 : 0.0;
    c.advance(rn);
  }
  return n;
}

template <typename T>
__device__ __forceinline__ void write_shares(const T* __restrict__ x, T* __restrict__ dx,
                                             T best, double share, long long base,
                                             long long first, long long step,
                                             long long reduced, const Dims& rn,
                                             const Dims& rs) {
  if (first >= reduced) return;
  Cursor c;
  c.init(first, step, rn);
  for (long long r = first; r < reduced; r += step) {
    const long long o = base + c.offset(rs);
    dx[o] = T((x[o] == best ? 1.0 : 0.0) * share);
    c.advance(rn);
  }
}

template <typename T>
__device__ void max_grad_rows(const T* __restrict__ x, const T* __restrict__ out,
                              const T* __restrict__ dout, T* __restrict__ dx, long long kept,
                              long long reduced, const Dims kn, const Dims ks, const Dims rn,
                              const Dims rs) {
  __shared__ double row_share;
  for (long long k = blockIdx.x; k < kept; k += gridDim.x) {
    const long long base = offset_of(k, kn, ks);
    const T best = out[k];
    Vals<double, 1> n{{count_ties(x, best, base, threadIdx.x, blockDim.x, reduced, rn, rs)}};
    n = block_merge<DSum>(n);
    if (threadIdx.x == 0) row_share = double(dout[k]) / (n.v[0] > 1.0 ? n.v[0] : 1.0);
    __syncthreads();
    write_shares(x, dx, best, row_share, base, threadIdx.x, blockDim.x, reduced, rn, rs);
    __syncthreads();                       // row_share is rewritten for the next output
  }
}

template <typename T>
__device__ void max_grad_cols(const T* __restrict__ x, const T* __restrict__ out,
                              const T* __restrict__ dout, T* __restrict__ dx, long long kept,
                              long long reduced, const Dims kn, const Dims ks, const Dims rn,
                              const Dims rs) {
  __shared__ double shares[32];
  const long long TX = blockDim.x;
  for (long long k0 = blockIdx.x * TX; k0 < kept; k0 += gridDim.x * TX) {
    const long long k = k0 + threadIdx.x;
    const long long base = k < kept ? offset_of(k, kn, ks) : 0;
    const T best = k < kept ? out[k] : T(0);
    Vals<double, 1> n{{k < kept ? count_ties(x, best, base, threadIdx.y, blockDim.y, reduced,
                                             rn, rs)
                                : 0.0}};
    n = column_merge<DSum>(n);
    if (threadIdx.y == 0 && k < kept)
      shares[threadIdx.x] = double(dout[k]) / (n.v[0] > 1.0 ? n.v[0] : 1.0);
    __syncthreads();
    if (k < kept)
      write_shares(x, dx, best, shares[threadIdx.x], base, threadIdx.y, blockDim.y, reduced,
                   rn, rs);
    __syncthreads();                       // shares are rewritten for the next outputs
  }
}

template <typename T>
__device__ void broadcast_back(const T* __restrict__ d, T* __restrict__ dx, long long total,
                               double divisor, const Dims n, const Dims ds) {
  const long long gt = global_tid(), nt = global_threads();
  if (gt >= total) return;
  Cursor c;
  c.init(gt, nt, n);
  for (long long e = gt; e < total; e += nt) {
    dx[e] = T(double(d[c.offset(ds)]) / divisor);
    c.advance(n);
  }
}

}  // namespace mg

#define MG_REDUCE_KERNELS(T, SFX)                                                             \
  extern "C" __global__ void reduce_rows_##SFX(const T* x, T* out, long long kept,            \
                                               long long reduced, int op, double divisor,     \
                                               MG_DIMS_PARAMS(kn), MG_DIMS_PARAMS(ks),        \
                                               MG_DIMS_PARAMS(rn), MG_DIMS_PARAMS(rs)) {      \
    mg::reduce_rows<T>(x, out, kept, reduced, op, divisor, MG_DIMS(kn), MG_DIMS(ks),          \
                       MG_DIMS(rn), MG_DIMS(rs));                                             \
  }                                                                                           \
  extern "C" __global__ void reduce_cols_##SFX(const T* x, T* out, long long kept,            \
                                               long long reduced, int op, double divisor,     \
                                               MG_DIMS_PARAMS(kn), MG_DIMS_PARAMS(ks),        \
                                               MG_DIMS_PARAMS(rn), MG_DIMS_PARAMS(rs)) {      \
    mg::reduce_cols<T>(x, out, kept, reduced, op, divisor, MG_DIMS(kn), MG_DIMS(ks),          \
                       MG_DIMS(rn), MG_DIMS(rs));                                             \
  }                                                                                           \
  extern "C" __global__ void reduce_max_grad_rows_##SFX(                                      \
      const T* x, const T* out, const T* dout, T* dx, long long kept, long long reduced,      \
      MG_DIMS_PARAMS(kn), MG_DIMS_PARAMS(ks), MG_DIMS_PARAMS(rn), MG_DIMS_PARAMS(rs)) {       \
    mg::max_grad_rows<T>(x, out, dout, dx, kept, reduced, MG_DIMS(kn), MG_DIMS(ks),           \
                         MG_DIMS(rn), MG_DIMS(rs));                                           \
  }                                                                                           \
  extern "C" __global__ void reduce_max_grad_cols_##SFX(                                      \
      const T* x, const T* out, const T* dout, T* dx, long long kept, long long reduced,      \
      MG_DIMS_PARAMS(kn), MG_DIMS_PARAMS(ks), MG_DIMS_PARAMS(rn), MG_DIMS_PARAMS(rs)) {       \
    mg::max_grad_cols<T>(x, out, dout, dx, kept, reduced, MG_DIMS(kn), MG_DIMS(ks),           \
                         MG_DIMS(rn), MG_DIMS(rs));                                           \
  }                                                                                           \
  extern "C" __global__ void broadcast_back_##SFX(const T* d, T* dx, long long total,         \
                                                  double divisor, MG_DIMS_PARAMS(n),          \
                                                  MG_DIMS_PARAMS(ds)) {                       \
    mg::broadcast_back<T>(d, dx, total, divisor, MG_DIMS(n), MG_DIMS(ds));                    \
  }

MG_REDUCE_KERNELS(float, f32)
MG_REDUCE_KERNELS(double, f64)
