// Tiled matrix product in shared memory: C = op(A) @ op(B) (+ C when beta),
// op = identity or transpose (nn: A @ B, tn: A^T @ B, nt: A @ B^T, tt: A^T @ B^T), all
// row-major with leading dimensions lda, ldb, ldc.
//
// Batches: blockIdx.z = outer * inner_count + inner picks the matrices at
// A + outer * a_outer + inner * a_inner (likewise B, C); each output also sums
// `red` products A + r * a_red, B + r * b_red (r < red) - conv2d's filter
// gradient sums over the images of a chunk this way.
//
// 64 x 64 output tile per 256-thread block, K in steps of 16, 4 x 4 outputs
// per thread (rows ty + 16 i, columns tx + 16 j).
#include "common.cuh"

namespace mg {

constexpr int TM = 64, TN = 64, TK = 16, GEMM_THREADS = 256;

template <typename T, bool TA, bool TB>
__device__ void gemm(int M, int N, int K, const T* __restrict__ A, long long lda,
                     const T* __restrict__ B, long long ldb, T* __restrict__ Cm, long long ldc,
                     int inner_count, long long a_outer, long long a_inner, long long b_outer,
                     long long b_inner, long long c_outer, long long c_inner, int red,
                     long long a_red, long long b_red, int beta) {
  __shared__ T As[TK][TM + 1];
  __shared__ T Bs[TK][TN + 1];
  const int tid = threadIdx.x, tx = tid % 16, ty = tid / 16;
  const int m0 = blockIdx.y * TM, n0 = blockIdx.x * TN;
  const long long outer = blockIdx.z / inner_count, inner = blockIdx.z % inner_count;
  A += outer * a_outer + inner * a_inner;
  B += outer * b_outer + inner * b_inner;
  Cm += outer * c_outer + inner * c_inner;
  T acc[4][4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) acc[i][j] = T(0);
  for (int r = 0; r < red; ++r) {
    const T* Ar = A + r * a_red;
    const T* Br = B + r * b_red;
    for (int k0 = 0; k0 < K; k0 += TK) {
#pragma unroll
      for (int l = 0; l < TM * TK / GEMM_THREADS; ++l) {
        const int idx = tid + l * GEMM_THREADS;
        // consecutive threads read consecutive addresses in either layout
        const int mm = TA ? idx % TM : idx / TK, kk = TA ? idx / TM : idx % TK;
        const int m = m0 + mm, k = k0 + kk;
        T v = T(0);
        if (m < M && k < K) v = TA ? Ar[(long long)k * lda + m] : Ar[(long long)m * lda + k];
        As[kk][mm] = v;
      }
#pragma unroll
      for (int l = 0; l < TN * TK / GEMM_THREADS; ++l) {
        const int idx = tid + l * GEMM_THREADS;
        const int nn = TB ? idx / TK : idx % TN, kk = TB ? idx % TK : idx / TN;
        const int n = n0 + nn, k = k0 + kk;
        T v = T(0);
        if (n < N && k < K) v = TB ? Br[(long long)n * ldb + k] : Br[(long long)k * ldb + n];
        Bs[kk][nn] = v;
      }
      __syncthreads();
#pragma unroll
      for (int kk = 0; kk < TK; ++kk) {
        T a[4], b[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) a[i] = As[kk][ty + 16 * i];
#pragma unroll
        for (int j = 0; j < 4; ++j) b[j] = Bs[kk][tx + 16 * j];
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
      }
      __syncthreads();
    }
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int m = m0 + ty + 16 * i;
    if (m >= M) continue;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int n = n0 + tx + 16 * j;
      if (n >= N) continue;
      T* c = Cm + (long long)m * ldc + n;
      *c = beta ? *c + acc[i][j] : acc[i][j];
    }
  }
}

}  // namespace mg

#define MG_GEMM_KERNEL(T, SFX, NAME, TA, TB)                                                  \
  extern "C" __global__ void __launch_bounds__(mg::GEMM_THREADS) gemm_##NAME##_##SFX(         \
      int M, int N, int K, const T* A, long long lda, const T* B, long long ldb, T* C,        \
      long long ldc, int inner_count, long long a_outer, long long a_inner, long long b_outer, \
      long long b_inner, long long c_outer, long long c_inner, int red, long long a_red,      \
      long long b_red, int beta) {                                                            \
    mg::gemm<T, TA, TB>(M, N, K, A, lda, B, ldb, C, ldc, inner_count, a_outer, a_inner,       \
                        b_outer, b_inner, c_outer, c_inner, red, a_red, b_red, beta);          \
  }

MG_GEMM_KERNEL(float, f32, nn, false, false)
MG_GEMM_KERNEL(float, f32, tn, true, false)
MG_GEMM_KERNEL(float, f32, nt, false, true)
MG_GEMM_KERNEL(float, f32, tt, true, true)
MG_GEMM_KERNEL(double, f64, nn, false, false)
MG_GEMM_KERNEL(double, f64, tn, true, false)
MG_GEMM_KERNEL(double, f64, nt, false, true)
MG_GEMM_KERNEL(double, f64, tt, true, true)

// Split-K: the products of one GEMM over `slices` slices of K land in partials
// [group][slice][M*N]; c[group][i] = (beta ? c : 0) + sum over s = 0, 1, ... of
// partials[group][s][i], in that fixed order (the result never depends on timing).
template <typename T>
__device__ void gemm_sum_slices(const T* __restrict__ partials, T* __restrict__ c,
                                long long mn, long long total, int slices, int beta) {
  const long long nt = mg::global_threads();
  for (long long e = mg::global_tid(); e < total; e += nt) {
    const long long g = e / mn, i = e - g * mn;
    const T* p = partials + g * slices * mn + i;
    T acc = beta ? c[e] : T(0);
    for (int s = 0; s < slices; ++s) acc += p[s * mn];
    c[e] = acc;
  }
}

// The fused ops' epilogue, in place on out (a matrix product's or a convolution's
// output): out[e] = act(out[e] + bias[(e / inner) % channels] + residual[e]), bias and
// residual optional (null), act = relu when `relu`, else the identity. `out` and
// `residual` carry no __restrict__ (a residual may be out itself).
template <typename T>
__device__ void bias_act(T* out, const T* __restrict__ bias, const T* residual,
                         long long total, long long inner, long long channels, int relu) {
  const long long nt = mg::global_threads();
  for (long long e = mg::global_tid(); e < total; e += nt) {
    T v = out[e];
    if (bias) v += bias[(e / inner) % channels];
    if (residual) v += residual[e];
    out[e] = (!relu || v > T(0) || v != v) ? v : T(0);
  }
}

#define MG_GEMM_HELPERS(T, SFX)                                                              \
  extern "C" __global__ void gemm_sum_slices_##SFX(const T* partials, T* c, long long mn,     \
                                                   long long total, int slices, int beta) {  \
    gemm_sum_slices<T>(partials, c, mn, total, slices, beta);                                \
  }                                                                                          \
  extern "C" __global__ void bias_act_##SFX(T* out, const T* bias, const T* residual,         \
                                            long long total, long long inner,                \
                                            long long channels, int relu) {                  \
    bias_act<T>(out, bias, residual, total, inner, channels, relu);                          \
  }

MG_GEMM_HELPERS(float, f32)
MG_GEMM_HELPERS(double, f64)
