// Batch norm's elementwise passes on (rows, C) tensors - NHWC, and any layout whose
// channels are the innermost axis (post == 1) - with every thread's channels fixed:
// grid (ceil(Cv / TX), row blocks), block (TX, TY); thread column
// cv = blockIdx.x TX + threadIdx.x owns the W channels [cv W, cv W + W) in every row
// it visits (blockIdx.y TY + threadIdx.y, then every gridDim.y TY rows), so their
// coefficients are loaded - in inference computed - once, into registers, and each
// thread keeps UNROLL 16-byte packs in flight. The statistics and the gradient sums
// of these tensors are batch_norm.cu's rows reductions.
//
//   bn_rows_normalize  y = (x - m) k + b (ReLU optional), coefficients from the
//                      statistics kernel; commits the estimates and the counter
//                      unless the launch's epoch was flagged (as bn_normalize)
//   bn_rows_infer      the same with k = scale / sqrt(var + eps) from the estimates
//   bn_rows_dx         dx = (x - m) kx + kc + dy kd (use_x = 0: dy kd), dy masked
//                      for batch_norm_relu by the reduction's bits or by y > 0
#include "batch_norm.cuh"

namespace mg {

constexpr int ROWS_UNROLL = 4;

// f(addr[K]) for K = ROWS_UNROLL packs, then K = 1, over this thread's rows of column cv.
template <int U, class F>
__device__ __forceinline__ void column_rows(long long rows, long long Cv, long long cv, F&& f) {
  const long long step = (long long)gridDim.y * blockDim.y;
  long long r = (long long)blockIdx.y * blockDim.y + threadIdx.y;
  for (; r + (U - 1) * step < rows; r += U * step) {
    long long addr[U];
#pragma unroll
    for (int j = 0; j < U; ++j) addr[j] = (r + j * step) * Cv + cv;
    f(addr);
  }
  for (; r < rows; r += step) {
    long long addr[1] = {r * Cv + cv};
    f(addr);
  }
}

__device__ __forceinline__ long long grid_flat_tid() {
  return ((long long)blockIdx.y * gridDim.x + blockIdx.x) * (blockDim.x * blockDim.y) +
         flat_tid();
}

// y over this thread's rows with the coefficients m, k, b of its W channels.
template <typename T, int W>
__device__ __forceinline__ void rows_apply(const T* x, T* y, long long rows, long long Cv,
                                           long long cv, const T (&m)[W], const T (&k)[W],
                                           const T (&b)[W], int relu) {
  column_rows<ROWS_UNROLL>(rows, Cv, cv, [&](const auto& addr) {
    constexpr int K = sizeof(addr) / sizeof(addr[0]);
    Pack<T, W> v[K];
#pragma unroll
    for (int j = 0; j < K; ++j) v[j] = load_pack<T, W>(x, addr[j]);
#pragma unroll
    for (int j = 0; j < K; ++j) {
#pragma unroll
      for (int i = 0; i < W; ++i) {
        const T o = (v[j].v[i] - m[i]) * k[i] + b[i];
        v[j].v[i] = relu ? relu_of(o) : o;
      }
      store_pack<T, W>(y, addr[j], v[j]);
    }
  });
}

template <typename T, int W>
__device__ void rows_normalize(const T* x, T* y, long long rows, long long C,
                               const T* __restrict__ coef, int commit, T* est_mean, T* est_var,
                               const T* newest, long long* counter, unsigned* status,
                               unsigned epoch, int relu) {
  if (commit)
    commit_estimates(grid_flat_tid(), C, newest, est_mean, est_var, counter, status, epoch);
  const long long Cv = C / W, cv = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (cv >= Cv) return;
  T m[W], k[W], b[W];
#pragma unroll
  for (int i = 0; i < W; ++i) {
    m[i] = coef[cv * W + i];
    k[i] = coef[C + cv * W + i];
    b[i] = coef[2 * C + cv * W + i];
  }
  rows_apply<T, W>(x, y, rows, Cv, cv, m, k, b, relu);
}

template <typename T, int W>
__device__ void rows_infer(const T* x, T* y, long long rows, long long C,
                           const T* __restrict__ est_mean, const T* __restrict__ est_var,
                           const T* __restrict__ scale, const T* __restrict__ bias, double eps,
                           int relu) {
  const long long Cv = C / W, cv = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (cv >= Cv) return;
  const T eps_t = T(eps);
  T m[W], k[W], b[W];
#pragma unroll
  for (int i = 0; i < W; ++i) {
    const long long c = cv * W + i;
    m[i] = est_mean[c];
    k[i] = scale[c] * (T(1) / sqrt(est_var[c] + eps_t));   // as bn_infer, once per thread
    b[i] = bias[c];
  }
  rows_apply<T, W>(x, y, rows, Cv, cv, m, k, b, relu);
}

template <typename T, int W>
__device__ void rows_dx(const T* x, const T* dy, T* dx, long long rows, long long C,
                        const T* __restrict__ coef, int use_x, const T* yr,
                        const unsigned char* bits, int shift) {
  const long long Cv = C / W, cv = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (cv >= Cv) return;
  T m[W], kx[W], kc[W], kd[W];
#pragma unroll
  for (int i = 0; i < W; ++i) {
    const long long c = cv * W + i;
    m[i] = coef[c];
    kx[i] = use_x ? coef[C + c] : T(0);
    kc[i] = use_x ? coef[2 * C + c] : T(0);
    kd[i] = coef[3 * C + c];
  }
  const bool masked = yr != nullptr || bits != nullptr;
  column_rows<ROWS_UNROLL>(rows, Cv, cv, [&](const auto& addr) {
    constexpr int K = sizeof(addr) / sizeof(addr[0]);
    Pack<T, W> g[K], xv[K];
#pragma unroll
    for (int j = 0; j < K; ++j) {
      g[j] = load_pack<T, W>(dy, addr[j]);
      if (use_x) xv[j] = load_pack<T, W>(x, addr[j]);
    }
#pragma unroll
    for (int j = 0; j < K; ++j) {
#pragma unroll
      for (int i = 0; i < W; ++i) {
        const long long e = addr[j] * W + i;
        const T gv = masked && !mask_on(bits, shift, yr, e) ? T(0) : g[j].v[i];
        g[j].v[i] = use_x ? (xv[j].v[i] - m[i]) * kx[i] + kc[i] + gv * kd[i] : gv * kd[i];
      }
      store_pack<T, W>(dx, addr[j], g[j]);
    }
  });
}

}  // namespace mg

#define MG_BN_ROWS_KERNELS(T, SFX, W)                                                          \
  extern "C" __global__ void bn_rows_normalize_##SFX##_w##W(                                  \
      const T* x, T* y, long long rows, long long C, const T* coef, int commit, T* est_mean,  \
      T* est_var, const T* newest, long long* counter, unsigned* status, unsigned epoch,      \
      int relu) {                                                                              \
    mg::rows_normalize<T, W>(x, y, rows, C, coef, commit, est_mean, est_var, newest, counter, \
                             status, epoch, relu);                                             \
  }                                                                                            \
  extern "C" __global__ void bn_rows_infer_##SFX##_w##W(                                      \
      const T* x, T* y, long long rows, long long C, const T* est_mean, const T* est_var,     \
      const T* scale, const T* bias, double eps, int relu) {                                  \
    mg::rows_infer<T, W>(x, y, rows, C, est_mean, est_var, scale, bias, eps, relu);           \
  }                                                                                            \
  extern "C" __global__ void bn_rows_dx_##SFX##_w##W(                                         \
      const T* x, const T* dy, T* dx, long long rows, long long C, const T* coef, int use_x,  \
      const T* yr, const unsigned char* bits, int shift) {                                    \
    mg::rows_dx<T, W>(x, dy, dx, rows, C, coef, use_x, yr, bits, shift);                      \
  }

MG_BN_ROWS_KERNELS(float, f32, 1)
MG_BN_ROWS_KERNELS(float, f32, 4)
MG_BN_ROWS_KERNELS(double, f64, 1)
MG_BN_ROWS_KERNELS(double, f64, 2)
