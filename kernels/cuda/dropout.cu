// dropout (training) and its gradient.
//
// Element i keeps its value when u_i >= p, u_i = (word >> 8) / 2^24 with word =
// word (i % 4) of philox(i / 4, stream 2, seed + (step << 32)) (philox.cuh):
// the mask depends on (seed, step, i) only, the same bits as the CPU kernel's.
// out = x * (keep * factor), factor = 1 / (1 - p) rounded to T by the
// launcher's double; mask = keep as a byte (skipped when mask is null). Each
// thread makes one generator call, four elements; with PW > 1 (16-byte aligned
// data) those four move as packs and their mask bytes as one word. The last
// block to finish (a ticket) increments the int64 step counter on the device:
// every block has read it by then.
#include "common.cuh"
#include "philox.cuh"

namespace mg {

constexpr unsigned DROPOUT_STREAM = 2u;

template <typename T, int PW>
__device__ void dropout_train(const T* __restrict__ x, T* __restrict__ out,
                              unsigned char* __restrict__ mask, long long* step,
                              unsigned* tickets, long long total, double p, double factor_d,
                              unsigned seed) {
  const long long s = step[0];
  const unsigned long long key = (unsigned long long)seed | ((unsigned long long)s << 32);
  const T factor = T(factor_d);
  const long long calls = (total + 3) / 4, nt = global_threads();
  for (long long c = global_tid(); c < calls; c += nt) {
    const Philox4x32 r = philox((unsigned long long)c, DROPOUT_STREAM, key);
    bool keep[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) keep[j] = double(r.v[j] >> 8) * (1.0 / 16777216.0) >= p;
    const long long e0 = 4 * c;
    if (PW > 1 && e0 + 4 <= total) {
#pragma unroll
      for (int q = 0; q < 4 / PW; ++q) {
        Pack<T, PW> v = load_pack<T, PW>(x, e0 / PW + q);
#pragma unroll
        for (int j = 0; j < PW; ++j) v.v[j] = v.v[j] * (T(keep[q * PW + j]) * factor);
        store_pack<T, PW>(out, e0 / PW + q, v);
      }
      if (mask != nullptr)
        reinterpret_cast<unsigned*>(mask)[c] = unsigned(keep[0]) | (unsigned(keep[1]) << 8) |
                                               (unsigned(keep[2]) << 16) |
                                               (unsigned(keep[3]) << 24);
    } else {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const long long e = e0 + j;
        if (e < total) {
          out[e] = x[e] * (T(keep[j]) * factor);
          if (mask != nullptr) mask[e] = keep[j] ? 1 : 0;
        }
      }
    }
  }
  if (arrive_last(tickets, 0, gridDim.x) && flat_tid() == 0) step[0] = s + 1;
}

// dx = dout * (mask * factor).
template <typename T, int W>
__device__ void dropout_grad(const unsigned char* __restrict__ mask, const T* __restrict__ dout,
                             T* __restrict__ dx, long long total, double factor_d) {
  const T factor = T(factor_d);
  flat_walk<W>(total, [&](long long u, auto width) {
    constexpr int K = decltype(width)::value;
    Pack<T, K> d = load_pack<T, K>(dout, u);
#pragma unroll
    for (int j = 0; j < K; ++j) d.v[j] = d.v[j] * (T(mask[u * K + j]) * factor);
    store_pack<T, K>(dx, u, d);
  });
}

}  // namespace mg

#define MG_DROPOUT_KERNELS(T, SFX, W)                                                         \
  extern "C" __global__ void dropout_##SFX##_w##W(const T* x, T* out, unsigned char* mask,    \
                                                  long long* step, unsigned* tickets,         \
                                                  long long total, double p, double factor,   \
                                                  unsigned seed) {                            \
    mg::dropout_train<T, W>(x, out, mask, step, tickets, total, p, factor, seed);             \
  }                                                                                           \
  extern "C" __global__ void dropout_grad_##SFX##_w##W(const unsigned char* mask,             \
                                                       const T* dout, T* dx, long long total, \
                                                       double factor) {                       \
    mg::dropout_grad<T, W>(mask, dout, dx, total, factor);                                    \
  }

MG_DROPOUT_KERNELS(float, f32, 1)
MG_DROPOUT_KERNELS(float, f32, 4)
MG_DROPOUT_KERNELS(double, f64, 1)
MG_DROPOUT_KERNELS(double, f64, 2)
