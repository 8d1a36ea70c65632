// Row normalisations: layer_norm, group_norm and instance_norm, and their gradients.
//
// x is seen as `rows` contiguous rows of L values: layer_norm's rows are the
// positions of the axes before begin_norm_axis; group_norm's are the (sample,
// group) blocks of C/G * S values (S the spatial size). The affine parameters
// (scale, bias) of element e are indexed (e / post) % A: post 1 and A = L for
// layer_norm (the position in the row), post S and A = C for group_norm (the
// channel).
//
// Forward: norm_stats (grid (row blocks, splits), 1-D blocks: per-thread Welford
// in double, Chan merges across the warp and the block; a long row split over
// several blocks is merged by its last block, in split order) writes mean and
// variance and per-row coefficients (mean rounded to T, invstd, the rounding of
// the mean folded into a correction); norm_apply is elementwise over the tensor.
// Backward: norm_grad_sums (the same row reduction: sums of g and g (x - mean),
// in double, per row or per (sample, channel) plane), norm_grad_finish (one
// thread per row: the dx coefficients; per channel: group_norm's dscale and
// dbias, summed over samples in order), norm_grad_dx (elementwise), and for
// layer_norm norm_column_sums (dscale, dbias: per column over the rows, 2-D
// blocks, split partials merged by the last block). No float atomics: every
// sum is taken in a fixed order.
#include "common.cuh"

namespace mg {

constexpr int NORM_UNROLL = 4;   // packs in flight per thread in the row reductions

// Units [lo, hi) of one row, strided over a 1-D block, U units per call of f where
// possible: f(const long long (&at)[K]) with K = U, then K = 1 for the rest.
template <int U, class F>
__device__ __forceinline__ void span_walk(long long lo, long long hi, F&& f) {
  const long long bd = blockDim.x;
  long long u = lo + threadIdx.x;
  for (; u + (U - 1) * bd < hi; u += U * bd) {
    long long at[U];
#pragma unroll
    for (int j = 0; j < U; ++j) at[j] = u + j * bd;
    f(at);
  }
  for (; u < hi; u += bd) {
    long long at[1] = {u};
    f(at);
  }
}

// Reduce each of `rows` rows of row_v units. Block (bx, s) takes units
// [s * chunk, (s + 1) * chunk) of rows bx, bx + gridDim.x, ... (with splits > 1
// the grid has one block column per row): start(row), then fold(row, at, state)
// per call of span_walk; finish(row, state) once per row, in thread 0 - with
// splits > 1 by the last block of the row, after merging the partials.
template <class Op, class Start, class Fold, class Finish>
__device__ void reduce_rows(long long rows, long long row_v, long long chunk, int splits,
                            double* partial, unsigned* tickets, Start start, Fold fold,
                            Finish finish) {
  using S = typename Op::State;
  constexpr int N = S::size;
  const int s = blockIdx.y;
  const long long lo = s * chunk;
  const long long hi = lo + chunk < row_v ? lo + chunk : row_v;
  for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
    start(row);
    S st = Op::identity();
    span_walk<NORM_UNROLL>(lo, hi, [&](const auto& at) { fold(row, at, st); });
    st = block_merge<Op>(st);
    if (splits == 1) {
      if (threadIdx.x == 0) finish(row, st);
      continue;
    }
    if (threadIdx.x == 0)
#pragma unroll
      for (int i = 0; i < N; ++i) partial[(row * splits + s) * N + i] = st.v[i];
    if (!arrive_last(tickets, row, splits)) continue;
    S f = Op::identity();
    for (int i = threadIdx.x; i < splits; i += blockDim.x) {
      S b;
#pragma unroll
      for (int k = 0; k < N; ++k) b.v[k] = load_cg(partial + (row * splits + i) * N + k);
      f = Op::merge(f, b);
    }
    f = block_merge<Op>(f);
    if (threadIdx.x == 0) finish(row, f);
  }
}

// Every element of `rows` rows of L values (L % W == 0: a pack lies in one row),
// grid-strided from the end to the start (the reduction before read it last,
// so the end is likeliest still in L2): f(unit, row, a) for the pack of
// elements [unit * W, unit * W + W), a[j] the affine index (e / post) % A of
// its element j. No division inside the loop.
template <int W, class F>
__device__ __forceinline__ void rows_elementwise(long long rows, long long L, long long post,
                                                 long long A, F&& f) {
  const long long gt = global_tid(), nt = global_threads();
  const long long units = rows * (L / W);
  if (gt >= units) return;
  ChannelCursor row, aff;
  const long long first = (units - 1 - gt) * W;
  row.init(first, nt * W, L, rows);
  aff.init(first, nt * W, post, A);
  for (long long i = gt; i < units; i += nt) {
    long long a[W];
    pack_channels<W>(aff, post, A, a);
    f(units - 1 - i, row.c, a);
    row.retreat(L, rows);
    aff.retreat(post, A);
  }
}

// ---- forward ---------------------------------------------------------------------

// mean, variance (biased) of each row; coef[3 rows]: (m, k, c) per row with
// xhat = (x - m) * k + c, m the mean rounded to T (x - m stays exact for offset
// data) and c = (m - mean) * k its rounding.
template <typename T, int W>
__device__ void norm_stats(const T* __restrict__ x, long long rows, long long row_v,
                           long long chunk, int splits, double* partial, unsigned* tickets,
                           T* __restrict__ mean, T* __restrict__ var, double eps,
                           T* __restrict__ coef) {
  const T* base = x;
  reduce_rows<WelfordOp<double, 1>>(
      rows, row_v, chunk, splits, partial, tickets,
      [&](long long row) { base = x + row * row_v * W; },
      [&](long long, const auto& at, Vals<double, 3>& st) {
        constexpr int K = sizeof(at) / sizeof(at[0]);
        Pack<T, W> v[K];
#pragma unroll
        for (int j = 0; j < K; ++j) v[j] = load_pack<T, W>(base, at[j]);
        double d[K * W];
#pragma unroll
        for (int j = 0; j < K; ++j)
#pragma unroll
          for (int k = 0; k < W; ++k) d[j * W + k] = double(v[j].v[k]);
        welford_push<double, 1, K * W>(st, d);
      },
      [&](long long row, const Vals<double, 3>& st) {
        const double mu = st.v[1], variance = st.v[2] / st.v[0];
        const double k = 1.0 / sqrt(variance + eps);
        const T m = T(mu);
        mean[row] = m;
        var[row] = T(variance);
        coef[row] = m;
        coef[rows + row] = T(k);
        coef[2 * rows + row] = T((double(m) - mu) * k);
      });
}

// y = xhat * scale[a] + bias[a] (scale, bias may be null: 1 and 0).
template <typename T, int W>
__device__ void norm_apply(const T* __restrict__ x, T* __restrict__ y, long long rows,
                           long long L, long long post, long long A, const T* __restrict__ coef,
                           const T* __restrict__ scale, const T* __restrict__ bias) {
  rows_elementwise<W>(rows, L, post, A, [&](long long u, long long r, const long long (&a)[W]) {
    const Pack<T, W> in = load_pack<T, W>(x, u);
    const T m = coef[r], k = coef[rows + r], c = coef[2 * rows + r];
    Pack<T, W> out;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      T v = (in.v[j] - m) * k + c;
      if (scale != nullptr) v *= scale[a[j]];
      if (bias != nullptr) v += bias[a[j]];
      out.v[j] = v;
    }
    store_pack<T, W>(y, u, out);
  });
}

// ---- backward --------------------------------------------------------------------

// sums[2 row] = sum of g, sums[2 row + 1] = sum of g (x - mean[row / rps]) over each
// row, g = dy * scale[position in the row] (scale may be null: g = dy), in double.
template <typename T, int W>
__device__ void norm_grad_sums(const T* __restrict__ x, const T* __restrict__ dy,
                               const T* __restrict__ scale, const T* __restrict__ mean,
                               long long rows, long long row_v, long long rps, long long chunk,
                               int splits, double* partial, unsigned* tickets,
                               double* __restrict__ sums) {
  long long off = 0;
  double m = 0.0;
  reduce_rows<SumOp<double, 2>>(
      rows, row_v, chunk, splits, partial, tickets,
      [&](long long row) {
        off = row * row_v;
        m = double(mean[row / rps]);
      },
      [&](long long, const auto& at, Vals<double, 2>& st) {
        constexpr int K = sizeof(at) / sizeof(at[0]);
        Pack<T, W> xv[K], gv[K];
#pragma unroll
        for (int j = 0; j < K; ++j) {
          xv[j] = load_pack<T, W>(x, off + at[j]);
          gv[j] = load_pack<T, W>(dy, off + at[j]);
        }
#pragma unroll
        for (int j = 0; j < K; ++j)
#pragma unroll
          for (int k = 0; k < W; ++k) {
            double g = double(gv[j].v[k]);
            if (scale != nullptr) g *= double(scale[at[j] * W + k]);
            st.v[0] += g;
            st.v[1] += g * (double(xv[j].v[k]) - m);
          }
      },
      [&](long long row, const Vals<double, 2>& st) {
        sums[2 * row] = st.v[0];
        sums[2 * row + 1] = st.v[1];
      });
}

// One thread per statistics row t (rps planes of sums each, plane r weighted by
// pscale[r % C] when pscale is given): coef[3 stat_rows] = (invstd, kx, kc) with
// dx = g invstd + (x - mean) kx + kc (kx = kc = 0 without sums). One thread per
// channel c < C when dscale or dbias is given (group_norm): the sums of the
// planes n C + c over the N samples, in order.
template <typename T>
__device__ void norm_grad_finish(const double* __restrict__ sums, const T* __restrict__ mean,
                                 const T* __restrict__ var, double eps,
                                 const T* __restrict__ pscale, long long stat_rows, long long rps,
                                 long long C, long long N, double count, T* __restrict__ dscale,
                                 T* __restrict__ dbias, T* __restrict__ coef) {
  const long long t = global_tid();
  if (t < stat_rows) {
    const double k = 1.0 / sqrt(double(var[t]) + eps);
    double sg = 0.0, sgx = 0.0;
    if (sums != nullptr)
      for (long long i = 0; i < rps; ++i) {
        const long long r = t * rps + i;
        const double w = pscale != nullptr ? double(pscale[r % C]) : 1.0;
        sg += w * sums[2 * r];
        sgx += w * sums[2 * r + 1];
      }
    coef[t] = T(k);
    coef[stat_rows + t] = T(-k * k * k * sgx / count);
    coef[2 * stat_rows + t] = T(-k * sg / count);
  }
  if (t < C && (dscale != nullptr || dbias != nullptr)) {
    double sd = 0.0, sx = 0.0;
    for (long long n = 0; n < N; ++n) {
      const long long r = n * C + t;
      sd += sums[2 * r];
      sx += sums[2 * r + 1] / sqrt(double(var[r / rps]) + eps);
    }
    if (dscale != nullptr) dscale[t] = T(sx);
    if (dbias != nullptr) dbias[t] = T(sd);
  }
}

// dx = dy scale[a] invstd + (x - mean) kx + kc per statistics row (norm_grad_finish's
// coefficients; scale may be null).
template <typename T, int W>
__device__ void norm_grad_dx(const T* __restrict__ x, const T* __restrict__ dy,
                             T* __restrict__ dx, long long rows, long long L, long long post,
                             long long A, const T* __restrict__ mean, const T* __restrict__ coef,
                             const T* __restrict__ scale) {
  rows_elementwise<W>(rows, L, post, A, [&](long long u, long long r, const long long (&a)[W]) {
    const Pack<T, W> xv = load_pack<T, W>(x, u), gv = load_pack<T, W>(dy, u);
    const T m = mean[r], k = coef[r], kx = coef[rows + r], kc = coef[2 * rows + r];
    Pack<T, W> out;
#pragma unroll
    for (int j = 0; j < W; ++j) {
      T g = gv.v[j];
      if (scale != nullptr) g *= scale[a[j]];
      out.v[j] = g * k + (xv.v[j] - m) * kx + kc;
    }
    store_pack<T, W>(dx, u, out);
  });
}

// layer_norm's dscale[l] = sum over rows of dy xhat and dbias[l] = sum of dy (either
// may be null), in double: grid (column groups, splits), 2-D blocks (TX, TY), thread
// column tx owns W adjacent columns, rows strided by TY; split partials merged in
// split order by the last block of the column group. xhat uses coef's invstd.
template <typename T, int W>
__device__ void norm_column_sums(const T* __restrict__ x, const T* __restrict__ dy,
                                 long long rows, long long L, long long chunk, int splits,
                                 double* partial, unsigned* tickets, const T* __restrict__ mean,
                                 const T* __restrict__ coef, T* __restrict__ dscale,
                                 T* __restrict__ dbias) {
  const long long Lv = L / W;
  const long long cv = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const bool active = cv < Lv;
  const int s = blockIdx.y;
  const long long lo = s * chunk;
  const long long hi = lo + chunk < rows ? lo + chunk : rows;
  using Op = SumOp<double, 2 * W>;          // v[k]: sum dy, v[W + k]: sum dy xhat
  typename Op::State st = Op::identity();
  if (active) {
    for (long long r = lo + threadIdx.y; r < hi; r += blockDim.y) {
      const Pack<T, W> gv = load_pack<T, W>(dy, r * Lv + cv);
#pragma unroll
      for (int k = 0; k < W; ++k) st.v[k] += double(gv.v[k]);
      if (dscale != nullptr) {
        const Pack<T, W> xv = load_pack<T, W>(x, r * Lv + cv);
        const double m = double(mean[r]), inv = double(coef[r]);
#pragma unroll
        for (int k = 0; k < W; ++k)
          st.v[W + k] += double(gv.v[k]) * ((double(xv.v[k]) - m) * inv);
      }
    }
  }
  st = column_merge<Op>(st);
  const bool owner = active && threadIdx.y == 0;
  if (splits > 1) {
    if (owner)
#pragma unroll
      for (int k = 0; k < 2 * W; ++k) partial[(cv * splits + s) * 2 * W + k] = st.v[k];
    if (!arrive_last(tickets, blockIdx.x, splits)) return;
    st = Op::identity();
    if (active)
      for (int i = threadIdx.y; i < splits; i += blockDim.y)
#pragma unroll
        for (int k = 0; k < 2 * W; ++k)
          st.v[k] += load_cg(partial + (cv * splits + i) * 2 * W + k);
    st = column_merge<Op>(st);
  }
  if (owner)
#pragma unroll
    for (int k = 0; k < W; ++k) {
      if (dbias != nullptr) dbias[cv * W + k] = T(st.v[k]);
      if (dscale != nullptr) dscale[cv * W + k] = T(st.v[W + k]);
    }
}

}  // namespace mg

// ---- entry points ------------------------------------------------------------------

#define MG_NORM_KERNELS(T, SFX, W)                                                              \
  extern "C" __global__ void norm_stats_##SFX##_w##W(                                           \
      const T* x, long long rows, long long row_v, long long chunk, int splits, double* partial, \
      unsigned* tickets, T* mean, T* var, double eps, T* coef) {                                \
    mg::norm_stats<T, W>(x, rows, row_v, chunk, splits, partial, tickets, mean, var, eps, coef); \
  }                                                                                             \
  extern "C" __global__ void norm_apply_##SFX##_w##W(const T* x, T* y, long long rows,          \
                                                     long long L, long long post, long long A,  \
                                                     const T* coef, const T* scale,             \
                                                     const T* bias) {                           \
    mg::norm_apply<T, W>(x, y, rows, L, post, A, coef, scale, bias);                            \
  }                                                                                             \
  extern "C" __global__ void norm_grad_sums_##SFX##_w##W(                                       \
      const T* x, const T* dy, const T* scale, const T* mean, long long rows, long long row_v,  \
      long long rps, long long chunk, int splits, double* partial, unsigned* tickets,           \
      double* sums) {                                                                           \
    mg::norm_grad_sums<T, W>(x, dy, scale, mean, rows, row_v, rps, chunk, splits, partial,      \
                             tickets, sums);                                                    \
  }                                                                                             \
  extern "C" __global__ void norm_grad_dx_##SFX##_w##W(                                         \
      const T* x, const T* dy, T* dx, long long rows, long long L, long long post, long long A, \
      const T* mean, const T* coef, const T* scale) {                                           \
    mg::norm_grad_dx<T, W>(x, dy, dx, rows, L, post, A, mean, coef, scale);                     \
  }                                                                                             \
  extern "C" __global__ void norm_column_sums_##SFX##_w##W(                                     \
      const T* x, const T* dy, long long rows, long long L, long long chunk, int splits,        \
      double* partial, unsigned* tickets, const T* mean, const T* coef, T* dscale, T* dbias) {  \
    mg::norm_column_sums<T, W>(x, dy, rows, L, chunk, splits, partial, tickets, mean, coef,     \
                               dscale, dbias);                                                  \
  }

#define MG_NORM_FINISH_KERNEL(T, SFX)                                                           \
  extern "C" __global__ void norm_grad_finish_##SFX(                                            \
      const double* sums, const T* mean, const T* var, double eps, const T* pscale,             \
      long long stat_rows, long long rps, long long C, long long N, double count, T* dscale,    \
      T* dbias, T* coef) {                                                                      \
    mg::norm_grad_finish<T>(sums, mean, var, eps, pscale, stat_rows, rps, C, N, count, dscale,  \
                            dbias, coef);                                                       \
  }

MG_NORM_KERNELS(float, f32, 1)
MG_NORM_KERNELS(float, f32, 4)
MG_NORM_KERNELS(double, f64, 1)
MG_NORM_KERNELS(double, f64, 2)
MG_NORM_FINISH_KERNEL(float, f32)
MG_NORM_FINISH_KERNEL(double, f64)
