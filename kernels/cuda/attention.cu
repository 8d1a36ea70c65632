// scaled_dot_product_attention (ops/attention.py) and its gradient, tiled with an
// online softmax: no kernel holds more than a tile of the score matrix.
//
// Layout: q, k, v, out (and their gradients) are contiguous in the op's layout:
// (N, H, T, d) when packed == 0, else (N, T, H*d); element (n, h, t, c) of a tensor
// with T rows of D values is at ((n*H + h)*T + t)*D + c, or ((n*T + t)*H + h)*D + c.
// The mask (mask_kind 0: none, 1: bool bytes, 2: T) is read at n*ms0 + h*ms1 + i*ms2
// + j*ms3 (0 along a broadcast axis). causal: the pair (i, j) takes part when
// j <= i + offset. Dropout (p > 0): pair f = ((n*H + h)*Tq + i)*Tk + j is kept when
// (word f % 4 of philox(f / 4, stream 3, seed | step << 32)) >> 8 / 2^24 >= p, the
// CPU's draw; kept weights are scaled by factor = 1 / (1 - p).
//
// forward: a block of ATT_ROWS threads, one query row each, visits the keys
// ATT_TILE at a time (staged in shared memory); per row, the running maximum m,
// the sum l of exp(s - m) and the output are rescaled when m grows. At the end
// out = acc / l and lse = m + log(l) (a row with no key: out 0, lse -inf).
// backward (FlashAttention-2, no atomics): D_i = dot(dO_i, O_i) (attention_rowdot),
// then one thread per key row sums dK and dV over the queries (attention_dkdv), and
// one thread per query row sums dQ over the keys (attention_dq), each recomputing
// P = exp(s - lse) tile by tile. ds (when not null) receives every dS, for a float
// mask's gradient. Head sizes up to ATT_DMAX.
#include "common.cuh"
#include "philox.cuh"

namespace mg {

constexpr int ATT_ROWS = 64;
constexpr int ATT_TILE = 16;
constexpr int ATT_DMAX = 128;
constexpr unsigned ATT_STREAM = 3u;

struct AttShape {
  long long n, h, tq, tk, d, dv;
  int packed;
  __device__ __forceinline__ long long at(long long nn, long long hh, long long t,
                                          long long rows, long long width) const {
    return packed ? ((nn * rows + t) * h + hh) * width : ((nn * h + hh) * rows + t) * width;
  }
};

struct AttMask {
  const void* data;
  int kind;
  long long s0, s1, s2, s3;
};

template <typename T>
__device__ __forceinline__ bool att_pass(const AttMask& m, int causal, long long offset,
                                         long long nn, long long hh, long long i, long long j,
                                         T& s) {
  if (causal && j > i + offset) return false;
  if (m.kind == 0) return true;
  const long long at = nn * m.s0 + hh * m.s1 + i * m.s2 + j * m.s3;
  if (m.kind == 1) return static_cast<const unsigned char*>(m.data)[at] != 0;
  s += static_cast<const T*>(m.data)[at];
  return s != T(-HUGE_VAL);
}

// A launch's dropout: keep() is the factor the weight of pair (i, j) of head nh takes
// (1 / (1 - p) or 0; 1 without dropout), drawn from (seed, *step).
struct AttDropout {
  double p, factor;
  unsigned long long key;
  __device__ AttDropout(double p_, unsigned seed, const long long* step)
      : p(p_), factor(p_ > 0 ? 1.0 / (1.0 - p_) : 1.0),
        key(step != nullptr ? (unsigned long long)seed | ((unsigned long long)step[0] << 32)
                            : 0ull) {}
  __device__ __forceinline__ double keep(const AttShape& sh, long long nh, long long i,
                                         long long j) const {
    if (!(p > 0)) return 1.0;
    const unsigned long long f = (unsigned long long)((nh * sh.tq + i) * sh.tk + j);
    const Philox4x32 r = philox(f >> 2, ATT_STREAM, key);
    return double(r.v[f & 3] >> 8) * (1.0 / 16777216.0) >= p ? factor : 0.0;
  }
};

// The scaled score of a query row and a key row: scale * dot(a, b) over d values.
template <typename T>
__device__ __forceinline__ T att_score(const T* a, const T* b, long long d, double scale) {
  T s = T(0);
  for (long long c = 0; c < d; ++c) s += a[c] * b[c];
  return s * T(scale);
}

// Keys [0, seen) that some query row of this block (ATT_ROWS rows) may see.
__device__ __forceinline__ long long att_keys_seen(const AttShape& sh, int causal,
                                                   long long offset) {
  long long last_row = (long long)blockIdx.x * ATT_ROWS + ATT_ROWS - 1;
  if (last_row >= sh.tq) last_row = sh.tq - 1;
  const long long seen = causal ? last_row + offset + 1 : sh.tk;
  return seen > sh.tk ? sh.tk : seen;
}

// Rows [0, rows) x width of one head of a tensor into shared memory (tile[r][c]).
template <typename T>
__device__ __forceinline__ void att_stage(T (*tile)[ATT_DMAX], const T* src, const AttShape& sh,
                                          long long nn, long long hh, long long first,
                                          long long rows, long long count, long long width) {
  for (long long e = threadIdx.x; e < count * width; e += blockDim.x) {
    const long long r = e / width, c = e - r * width;
    tile[r][c] = src[sh.at(nn, hh, first + r, rows, width) + c];
  }
}

template <typename T>
__device__ void attention_forward(const T* __restrict__ q, const T* __restrict__ k,
                                  const T* __restrict__ v, AttMask mask, T* __restrict__ out,
                                  T* __restrict__ lse, const long long* step, AttShape sh,
                                  int causal, long long offset, double scale, double p,
                                  unsigned seed) {
  __shared__ T ks[ATT_TILE][ATT_DMAX], vs[ATT_TILE][ATT_DMAX];
  const long long nh = blockIdx.y, nn = nh / sh.h, hh = nh - nn * sh.h;
  const long long i = (long long)blockIdx.x * ATT_ROWS + threadIdx.x;
  const bool active = i < sh.tq;
  const AttDropout drop(p, seed, step);
  T qr[ATT_DMAX], acc[ATT_DMAX];
  for (long long c = 0; c < sh.dv; ++c) acc[c] = T(0);
  if (active)
    for (long long c = 0; c < sh.d; ++c) qr[c] = q[sh.at(nn, hh, i, sh.tq, sh.d) + c];
  T m = T(-HUGE_VAL), l = T(0);
  const long long seen = att_keys_seen(sh, causal, offset);
  for (long long j0 = 0; j0 < seen; j0 += ATT_TILE) {
    const long long count = sh.tk - j0 < ATT_TILE ? sh.tk - j0 : ATT_TILE;
    att_stage(ks, k, sh, nn, hh, j0, sh.tk, count, sh.d);
    att_stage(vs, v, sh, nn, hh, j0, sh.tk, count, sh.dv);
    __syncthreads();
    if (active) {
      for (long long jj = 0; jj < count; ++jj) {
        const long long j = j0 + jj;
        T s = att_score(qr, ks[jj], sh.d, scale);
        if (!att_pass(mask, causal, offset, nn, hh, i, j, s)) continue;
        if (s > m) {
          const T alpha = m == T(-HUGE_VAL) ? T(0) : T(exp(m - s));
          l *= alpha;
          for (long long c = 0; c < sh.dv; ++c) acc[c] *= alpha;
          m = s;
        }
        const T e = T(exp(s - m));
        l += e;
        const T w = T(e * drop.keep(sh, nh, i, j));
        for (long long c = 0; c < sh.dv; ++c) acc[c] += w * vs[jj][c];
      }
    }
    __syncthreads();
  }
  if (!active) return;
  T* o = out + sh.at(nn, hh, i, sh.tq, sh.dv);
  if (l > T(0)) {
    for (long long c = 0; c < sh.dv; ++c) o[c] = acc[c] / l;
    if (lse != nullptr) lse[nh * sh.tq + i] = m + T(log(l));
  } else {
    for (long long c = 0; c < sh.dv; ++c) o[c] = T(0);
    if (lse != nullptr) lse[nh * sh.tq + i] = T(-HUGE_VAL);
  }
}

// saved = step; step += 1 (after the forward read it: the same stream).
__device__ void attention_advance(long long* step, long long* saved) {
  if (global_tid() == 0) {
    saved[0] = step[0];
    step[0] = step[0] + 1;
  }
}

// big_d[nh * tq + i] = dot(dout_i, out_i).
template <typename T>
__device__ void attention_rowdot(const T* __restrict__ out, const T* __restrict__ dout,
                                 T* __restrict__ big_d, AttShape sh) {
  const long long rows = sh.n * sh.h * sh.tq, nt = global_threads();
  for (long long r = global_tid(); r < rows; r += nt) {
    const long long nh = r / sh.tq, i = r - nh * sh.tq, nn = nh / sh.h, hh = nh - nn * sh.h;
    const long long at = sh.at(nn, hh, i, sh.tq, sh.dv);
    T sum = T(0);
    for (long long c = 0; c < sh.dv; ++c) sum += dout[at + c] * out[at + c];
    big_d[r] = sum;
  }
}

// One thread per key row j: dK_j and dV_j over every query that sees it.
template <typename T>
__device__ void attention_dkdv(const T* __restrict__ q, const T* __restrict__ k,
                               const T* __restrict__ v, AttMask mask,
                               const T* __restrict__ lse, const T* __restrict__ dout,
                               const T* __restrict__ big_d, const long long* dstep,
                               T* __restrict__ dk, T* __restrict__ dv, T* __restrict__ ds,
                               AttShape sh, int causal, long long offset, double scale,
                               double p, unsigned seed) {
  __shared__ T qs[ATT_TILE][ATT_DMAX], dos[ATT_TILE][ATT_DMAX];
  __shared__ T ls[ATT_TILE], dd[ATT_TILE];
  const long long nh = blockIdx.y, nn = nh / sh.h, hh = nh - nn * sh.h;
  const long long j = (long long)blockIdx.x * ATT_ROWS + threadIdx.x;
  const bool active = j < sh.tk;
  const AttDropout drop(p, seed, dstep);
  T kr[ATT_DMAX], vr[ATT_DMAX], dkr[ATT_DMAX], dvr[ATT_DMAX];
  for (long long c = 0; c < sh.d; ++c) dkr[c] = T(0);
  for (long long c = 0; c < sh.dv; ++c) dvr[c] = T(0);
  if (active) {
    for (long long c = 0; c < sh.d; ++c) kr[c] = k[sh.at(nn, hh, j, sh.tk, sh.d) + c];
    for (long long c = 0; c < sh.dv; ++c) vr[c] = v[sh.at(nn, hh, j, sh.tk, sh.dv) + c];
  }
  long long first = 0;
  if (causal) {
    first = (long long)blockIdx.x * ATT_ROWS - offset;
    if (first < 0) first = 0;
    first = first / ATT_TILE * ATT_TILE;
  }
  for (long long i0 = first; i0 < sh.tq; i0 += ATT_TILE) {
    const long long count = sh.tq - i0 < ATT_TILE ? sh.tq - i0 : ATT_TILE;
    att_stage(qs, q, sh, nn, hh, i0, sh.tq, count, sh.d);
    att_stage(dos, dout, sh, nn, hh, i0, sh.tq, count, sh.dv);
    for (long long e = threadIdx.x; e < count; e += blockDim.x) {
      ls[e] = lse[nh * sh.tq + i0 + e];
      dd[e] = big_d[nh * sh.tq + i0 + e];
    }
    __syncthreads();
    if (active) {
      for (long long ii = 0; ii < count; ++ii) {
        const long long i = i0 + ii;
        T s = att_score(qs[ii], kr, sh.d, scale);
        T dsv = T(0);
        if (ls[ii] != T(-HUGE_VAL) && att_pass(mask, causal, offset, nn, hh, i, j, s)) {
          const T pr = T(exp(s - ls[ii]));
          const T z = T(drop.keep(sh, nh, i, j));
          T dp = T(0);
          for (long long c = 0; c < sh.dv; ++c) {
            dvr[c] += pr * z * dos[ii][c];
            dp += dos[ii][c] * vr[c];
          }
          dsv = pr * (dp * z - dd[ii]);
          for (long long c = 0; c < sh.d; ++c) dkr[c] += dsv * qs[ii][c];
        }
        if (ds != nullptr) ds[(nh * sh.tq + i) * sh.tk + j] = dsv;
      }
    }
    __syncthreads();
  }
  if (!active) return;
  if (dk != nullptr)
    for (long long c = 0; c < sh.d; ++c)
      dk[sh.at(nn, hh, j, sh.tk, sh.d) + c] = dkr[c] * T(scale);
  if (dv != nullptr)
    for (long long c = 0; c < sh.dv; ++c) dv[sh.at(nn, hh, j, sh.tk, sh.dv) + c] = dvr[c];
}

// One thread per query row i: dQ_i over every key it sees.
template <typename T>
__device__ void attention_dq(const T* __restrict__ q, const T* __restrict__ k,
                             const T* __restrict__ v, AttMask mask, const T* __restrict__ lse,
                             const T* __restrict__ dout, const T* __restrict__ big_d,
                             const long long* dstep, T* __restrict__ dq, AttShape sh,
                             int causal, long long offset, double scale, double p,
                             unsigned seed) {
  __shared__ T ks[ATT_TILE][ATT_DMAX], vs[ATT_TILE][ATT_DMAX];
  const long long nh = blockIdx.y, nn = nh / sh.h, hh = nh - nn * sh.h;
  const long long i = (long long)blockIdx.x * ATT_ROWS + threadIdx.x;
  const bool active = i < sh.tq;
  const AttDropout drop(p, seed, dstep);
  T qr[ATT_DMAX], dor[ATT_DMAX], dqr[ATT_DMAX];
  T l = T(-HUGE_VAL), di = T(0);
  for (long long c = 0; c < sh.d; ++c) dqr[c] = T(0);
  if (active) {
    for (long long c = 0; c < sh.d; ++c) qr[c] = q[sh.at(nn, hh, i, sh.tq, sh.d) + c];
    for (long long c = 0; c < sh.dv; ++c) dor[c] = dout[sh.at(nn, hh, i, sh.tq, sh.dv) + c];
    l = lse[nh * sh.tq + i];
    di = big_d[nh * sh.tq + i];
  }
  const long long seen = att_keys_seen(sh, causal, offset);
  for (long long j0 = 0; j0 < seen; j0 += ATT_TILE) {
    const long long count = sh.tk - j0 < ATT_TILE ? sh.tk - j0 : ATT_TILE;
    att_stage(ks, k, sh, nn, hh, j0, sh.tk, count, sh.d);
    att_stage(vs, v, sh, nn, hh, j0, sh.tk, count, sh.dv);
    __syncthreads();
    if (active && l != T(-HUGE_VAL)) {
      for (long long jj = 0; jj < count; ++jj) {
        const long long j = j0 + jj;
        T s = att_score(qr, ks[jj], sh.d, scale);
        if (!att_pass(mask, causal, offset, nn, hh, i, j, s)) continue;
        const T pr = T(exp(s - l));
        const T z = T(drop.keep(sh, nh, i, j));
        T dp = T(0);
        for (long long c = 0; c < sh.dv; ++c) dp += dor[c] * vs[jj][c];
        const T dsv = pr * (dp * z - di);
        for (long long c = 0; c < sh.d; ++c) dqr[c] += dsv * ks[jj][c];
      }
    }
    __syncthreads();
  }
  if (!active) return;
  for (long long c = 0; c < sh.d; ++c) dq[sh.at(nn, hh, i, sh.tq, sh.d) + c] = dqr[c] * T(scale);
}

}  // namespace mg

#define MG_ATT_SHAPE mg::AttShape{n, h, tq, tk, d, dv, packed}
#define MG_ATT_MASK mg::AttMask{mask, mask_kind, ms0, ms1, ms2, ms3}
#define MG_ATT_DIMS                                                                          \
  long long n, long long h, long long tq, long long tk, long long d, long long dv, int packed, \
      int mask_kind, long long ms0, long long ms1, long long ms2, long long ms3, int causal,  \
      long long offset, double scale, double p, unsigned seed

#define MG_ATTENTION_KERNELS(T, SFX)                                                          \
  extern "C" __global__ void attention_forward_##SFX(const T* q, const T* k, const T* v,      \
                                                     const void* mask, T* out, T* lse,        \
                                                     const long long* step, MG_ATT_DIMS) {    \
    mg::attention_forward<T>(q, k, v, MG_ATT_MASK, out, lse, step, MG_ATT_SHAPE, causal,      \
                             offset, scale, p, seed);                                         \
  }                                                                                           \
  extern "C" __global__ void attention_rowdot_##SFX(const T* out, const T* dout, T* big_d,    \
                                                    long long n, long long h, long long tq,   \
                                                    long long dv, int packed) {               \
    mg::attention_rowdot<T>(out, dout, big_d, mg::AttShape{n, h, tq, 0, 0, dv, packed});       \
  }                                                                                           \
  extern "C" __global__ void attention_dkdv_##SFX(                                            \
      const T* q, const T* k, const T* v, const void* mask, const T* lse, const T* dout,      \
      const T* big_d, const long long* dstep, T* dk, T* dv_out, T* ds, MG_ATT_DIMS) {         \
    mg::attention_dkdv<T>(q, k, v, MG_ATT_MASK, lse, dout, big_d, dstep, dk, dv_out, ds,      \
                          MG_ATT_SHAPE, causal, offset, scale, p, seed);                      \
  }                                                                                           \
  extern "C" __global__ void attention_dq_##SFX(                                              \
      const T* q, const T* k, const T* v, const void* mask, const T* lse, const T* dout,      \
      const T* big_d, const long long* dstep, T* dq, MG_ATT_DIMS) {                           \
    mg::attention_dq<T>(q, k, v, MG_ATT_MASK, lse, dout, big_d, dstep, dq, MG_ATT_SHAPE,      \
                        causal, offset, scale, p, seed);                                      \
  }

MG_ATTENTION_KERNELS(float, f32)
MG_ATTENTION_KERNELS(double, f64)

extern "C" __global__ void attention_advance(long long* step, long long* saved) {
  mg::attention_advance(step, saved);
}
