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
