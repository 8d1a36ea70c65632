// conv2d helpers in channels-last layout (NHWC): im2col and its adjoint col2im, for a
// chunk of nb images x (nb, H, W, C). The products run in matmul.cu (see
// kernels/conv2d_nhwc.py).
//
// cols has shape (nb * Ho * Wo, C * kh * kw), one row per output pixel:
// cols[(n * Ho + oh) * Wo + ow][(c * kh + i) * kw + j]
//   = x[n][oh * sh - ph + i * dh][ow * sw - pw + j * dw][c], 0 outside the image:
// along a row, the filter's own (O, C / groups * kh * kw) order, so that per group
// out (pixels, O / groups) = cols' group columns @ filter_g^T lands in NHWC as it is.
// col2im gathers instead of scattering: each input element sums the column entries
// that read it, so no atomics and a fixed order.
#include "common.cuh"

namespace mg {

struct ConvGeometryNhwc {
  int C, H, W, kh, kw, sh, sw, ph, pw, dh, dw, Ho, Wo;
};

template <typename T>
__device__ void im2col_nhwc(const T* __restrict__ x, T* __restrict__ cols, int nb,
                            const ConvGeometryNhwc g) {
  const long long ckk = (long long)g.C * g.kh * g.kw;
  const long long total = (long long)nb * g.Ho * g.Wo * ckk;
  const long long nt = global_threads();
  for (long long e = global_tid(); e < total; e += nt) {
    const long long k = e % ckk, pixel = e / ckk;
    const int j = k % g.kw, i = (k / g.kw) % g.kh, c = k / ((long long)g.kw * g.kh);
    const int ow = pixel % g.Wo, oh = (pixel / g.Wo) % g.Ho;
    const long long n = pixel / ((long long)g.Wo * g.Ho);
    const int h = oh * g.sh - g.ph + i * g.dh, w = ow * g.sw - g.pw + j * g.dw;
    T v = T(0);
    if (h >= 0 && h < g.H && w >= 0 && w < g.W)
      v = x[((n * g.H + h) * g.W + w) * (long long)g.C + c];
    cols[e] = v;
  }
}

template <typename T>
__device__ void col2im_nhwc(const T* __restrict__ cols, T* __restrict__ dx, int nb,
                            const ConvGeometryNhwc g) {
  const long long ckk = (long long)g.C * g.kh * g.kw;
  const long long total = (long long)nb * g.H * g.W * g.C;
  const long long nt = global_threads();
  for (long long e = global_tid(); e < total; e += nt) {
    const int c = e % g.C;
    long long rest = e / g.C;
    const int w = rest % g.W;
    rest /= g.W;
    const int h = rest % g.H;
    const long long n = rest / g.H;
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
        const long long pixel = (n * g.Ho + oh) * g.Wo + ow;
        acc += cols[pixel * ckk + ((long long)c * g.kh + i) * g.kw + j];
      }
    }
    dx[e] = acc;
  }
}

}  // namespace mg

#define MG_CONV_NHWC_ARGS                                                                    \
  int nb, int C, int H, int W, int kh, int kw, int sh, int sw, int ph, int pw, int dh, int dw, \
      int Ho, int Wo
#define MG_CONV_NHWC_GEOMETRY mg::ConvGeometryNhwc{C, H, W, kh, kw, sh, sw, ph, pw, dh, dw, Ho, Wo}

#define MG_CONV_NHWC_KERNELS(T, SFX)                                                         \
  extern "C" __global__ void im2col_nhwc_##SFX(const T* x, T* cols, MG_CONV_NHWC_ARGS) {     \
    mg::im2col_nhwc<T>(x, cols, nb, MG_CONV_NHWC_GEOMETRY);                                  \
  }                                                                                          \
  extern "C" __global__ void col2im_nhwc_##SFX(const T* cols, T* dx, MG_CONV_NHWC_ARGS) {    \
    mg::col2im_nhwc<T>(cols, dx, nb, MG_CONV_NHWC_GEOMETRY);                                 \
  }

MG_CONV_NHWC_KERNELS(float, f32)
MG_CONV_NHWC_KERNELS(double, f64)
