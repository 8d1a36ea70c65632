// conv2d helpers: im2col and its adjoint col2im, for a chunk of nb images
// (NCHW). The products themselves run in matmul.cu (see kernels/conv2d.py).
//
// cols has shape (nb, C * kh * kw, Ho * Wo): cols[n][(c * kh + i) * kw + j][oh * Wo + ow]
// = x[n][c][oh * sh - ph + i * dh][ow * sw - pw + j * dw], 0 outside the image; or,
// `folded`, shape (C * kh * kw, nb * Ho * Wo): cols[row][n * Ho * Wo + p], the images
// side by side, so that the filter gradient is one product over every image and pixel.
// swap01 turns a (A, B, L) tensor into (B, A, L) (dout (nb, O, HoWo) into (O, nb, HoWo)).
// col2im gathers instead of scattering: each input element sums the column
// entries that read it, so no atomics and a fixed order.
#include "common.cuh"

namespace mg {

struct ConvGeometry {
  int C, H, W, kh, kw, sh, sw, ph, pw, dh, dw, Ho, Wo;
};

template <typename T>
__device__ void im2col(const T* __restrict__ x, T* __restrict__ cols, int nb, int folded,
                       const ConvGeometry g) {
  const long long hw = (long long)g.Ho * g.Wo;
  const long long total = (long long)nb * g.C * g.kh * g.kw * hw;
  const long long nt = global_threads();
  for (long long e = global_tid(); e < total; e += nt) {
    const long long p = e % hw;
    long long rest = e / hw;
    long long n = 0;
    if (folded) {                       // e = (row * nb + n) * hw + p
      n = rest % nb;
      rest /= nb;
    }
    const int j = rest % g.kw;
    rest /= g.kw;
    const int i = rest % g.kh;
    rest /= g.kh;
    const int c = rest % g.C;
    if (!folded) n = rest / g.C;        // e = (n * C * kh * kw + row) * hw + p
    const int oh = p / g.Wo, ow = p % g.Wo;
    const int h = oh * g.sh - g.ph + i * g.dh, w = ow * g.sw - g.pw + j * g.dw;
    T v = T(0);
    if (h >= 0 && h < g.H && w >= 0 && w < g.W)
      v = x[((n * g.C + c) * g.H + h) * (long long)g.W + w];
    cols[e] = v;
  }
}

template <typename T>
__device__ void col2im(const T* __restrict__ cols, T* __restrict__ dx, int nb,
                       const ConvGeometry g) {
  const long long total = (long long)nb * g.C * g.H * g.W;
  const long long hw = (long long)g.Ho * g.Wo;
  const long long nt = global_threads();
  for (long long e = global_tid(); e < total; e += nt) {
    const int w = e % g.W;
    long long rest = e / g.W;
    const int h = rest % g.H;
    rest /= g.H;
    const int c = rest % g.C;
    const long long n = rest / g.C;
    T acc = T(0);
    for (int i = 0; i < g.kh; ++i) {
      const int hs = h + g.ph - i * g.dh;       // = oh * sh for the window that reads (h, w)
      if (hs < 0 || hs % g.sh != 0) continue;
      const int oh = hs / g.sh;
      if (oh >= g.Ho) continue;
      for (int j = 0; j < g.kw; ++j) {
        const int ws = w + g.pw - j * g.dw;
        if (ws < 0 || ws % g.sw != 0) continue;
        const int ow = ws / g.sw;
        if (ow >= g.Wo) continue;
        const long long row = (long long)n * g.C * g.kh * g.kw + (c * g.kh + i) * g.kw + j;
        acc += cols[row * hw + (long long)oh * g.Wo + ow];
      }
    }
    dx[e] = acc;
  }
}

template <typename T>
__device__ void swap01(const T* __restrict__ src, T* __restrict__ dst, long long a, long long b,
                       long long l) {
  const long long total = a * b * l;
  const long long nt = global_threads();
  for (long long e = global_tid(); e < total; e += nt) {    // e indexes dst (b, a, l)
    const long long q = e % l, rest = e / l;
    const long long i = rest % a, j = rest / a;
    dst[e] = src[(i * b + j) * l + q];
  }
}

}  // namespace mg

#define MG_CONV_ARGS                                                                         \
  int nb, int C, int H, int W, int kh, int kw, int sh, int sw, int ph, int pw, int dh, int dw, \
      int Ho, int Wo
#define MG_CONV_GEOMETRY mg::ConvGeometry{C, H, W, kh, kw, sh, sw, ph, pw, dh, dw, Ho, Wo}

#define MG_CONV_KERNELS(T, SFX)                                                              \
  extern "C" __global__ void im2col_##SFX(const T* x, T* cols, int folded, MG_CONV_ARGS) {   \
    mg::im2col<T>(x, cols, nb, folded, MG_CONV_GEOMETRY);                                    \
  }                                                                                          \
  extern "C" __global__ void swap01_##SFX(const T* src, T* dst, long long a, long long b,     \
                                          long long l) {                                     \
    mg::swap01<T>(src, dst, a, b, l);                                                        \
  }                                                                                          \
  extern "C" __global__ void col2im_##SFX(const T* cols, T* dx, MG_CONV_ARGS) {              \
    mg::col2im<T>(cols, dx, nb, MG_CONV_GEOMETRY);                                           \
  }

MG_CONV_KERNELS(float, f32)
MG_CONV_KERNELS(double, f64)
