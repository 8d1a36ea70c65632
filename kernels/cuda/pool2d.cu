// pool2d max / avg and their gradients, NCHW or NHWC.
//
// The kernels see `planes` images of H x W pixels of C channels side by side (pixel
// stride C): an NHWC batch is N such images, an NCHW one N * C images of one channel
// (C = 1). Elements are numbered in that layout, outputs likewise (Ho x Wo pixels of
// C channels per image); `where` holds each window's pixel index in its image.
//
// Windows start at (oh * sh - ph, ow * sw - pw). Max: taps in row-major
// order, padding counts as -inf, the first tap always taken and a later one
// only when strictly greater (the first maximum wins, as on the CPU). Avg:
// the sum over the real elements divided by their count (padding excluded).
// Grads gather, one thread per input element, in a fixed window order (no
// atomics: deterministic for overlapping windows too): max sums dout over the
// windows whose first maximum the element is, read from a per-window argmax
// pass (pool_argmax: each window scanned once, so a global max pool's
// gradient costs O(H W), not O((H W)^2)); avg sums dout / count over the
// windows that cover it.
#include "common.cuh"

namespace mg {

struct PoolGeometry {
  int H, W, kh, kw, sh, sw, ph, pw, Ho, Wo, C;
};

// (value, pixel index in the image or -1 for padding) of the window's first maximum;
// `plane` points at the channel's value of the image's first pixel.
template <typename T>
__device__ __forceinline__ void window_max(const T* plane, int oh, int ow, const PoolGeometry& g,
                                           T& best, long long& where) {
  best = T(-HUGE_VAL);
  where = -1;
  for (int i = 0; i < g.kh; ++i) {
    const int h = oh * g.sh - g.ph + i;
    for (int j = 0; j < g.kw; ++j) {
      const int w = ow * g.sw - g.pw + j;
      const bool real = h >= 0 && h < g.H && w >= 0 && w < g.W;
      const T v = real ? plane[((long long)h * g.W + w) * g.C] : T(-HUGE_VAL);
      if ((i == 0 && j == 0) || v > best) {
        best = v;
        where = real ? (long long)h * g.W + w : -1;
      }
    }
  }
}

__device__ __forceinline__ int window_count(int o, int s, int p, int k, int size) {
  const int lo = o * s - p, hi = lo + k;
  return (hi < size ? hi : size) - (lo > 0 ? lo : 0);
}

// Output (or input) element e of the layout: its image, pixel and channel.
struct Element {
  long long image;
  int pixel, c;
};

__device__ __forceinline__ Element element(long long e, long long pixels, int C) {
  const long long q = e / C;
  return Element{q / pixels, int(q % pixels), int(e % C)};
}

// The channel's value of the first pixel of an image of H x W pixels.
template <typename T>
__device__ __forceinline__ const T* channel_plane(const T* x, const Element& at,
                                                  const PoolGeometry& g) {
  return x + at.image * g.H * (long long)g.W * g.C + at.c;
}

template <typename T, bool MAX>
__device__ void pool_forward(const T* __restrict__ x, T* __restrict__ out, long long planes,
                             const PoolGeometry g) {
  const long long per_plane = (long long)g.Ho * g.Wo, total = planes * per_plane * g.C;
  const long long nt = global_threads();
  for (long long e = global_tid(); e < total; e += nt) {
    const Element at = element(e, per_plane, g.C);
    const int p = at.pixel, oh = p / g.Wo, ow = p % g.Wo;
    const T* xp = channel_plane(x, at, g);
    if (MAX) {
      T best;
      long long where;
      window_max(xp, oh, ow, g, best, where);
      out[e] = best;
    } else {
      double sum = 0.0;
      for (int i = 0; i < g.kh; ++i) {
        const int h = oh * g.sh - g.ph + i;
        if (h < 0 || h >= g.H) continue;
        for (int j = 0; j < g.kw; ++j) {
          const int w = ow * g.sw - g.pw + j;
          if (w >= 0 && w < g.W) sum += double(xp[((long long)h * g.W + w) * g.C]);
        }
      }
      const int count = window_count(oh, g.sh, g.ph, g.kh, g.H) *
                        window_count(ow, g.sw, g.pw, g.kw, g.W);
      out[e] = T(sum / double(count));
    }
  }
}

// The windows (oh in [oh_lo, oh_hi], ow likewise) whose taps cover element (h, w).
struct Covering {
  int oh_lo, oh_hi, ow_lo, ow_hi;
};

__device__ __forceinline__ int first_window(int i, int s, int p, int k) {
  const int num = i + p - k + 1;
  return num <= 0 ? 0 : (num + s - 1) / s;
}

__device__ __forceinline__ Covering covering(int h, int w, const PoolGeometry& g) {
  const int oh_hi = (h + g.ph) / g.sh, ow_hi = (w + g.pw) / g.sw;
  return Covering{first_window(h, g.sh, g.ph, g.kh), oh_hi < g.Ho ? oh_hi : g.Ho - 1,
                  first_window(w, g.sw, g.pw, g.kw), ow_hi < g.Wo ? ow_hi : g.Wo - 1};
}

// One thread per window: the flat index in its plane of the window's first
// maximum (-1 when it is padding), for pool_max_grad.
template <typename T>
__device__ void pool_argmax(const T* __restrict__ x, int* __restrict__ where, long long planes,
                            const PoolGeometry g) {
  const long long per_plane = (long long)g.Ho * g.Wo, total = planes * per_plane * g.C;
  const long long nt = global_threads();
  for (long long e = global_tid(); e < total; e += nt) {
    const Element el = element(e, per_plane, g.C);
    const int p = el.pixel, oh = p / g.Wo, ow = p % g.Wo;
    T best;
    long long at;
    window_max(channel_plane(x, el, g), oh, ow, g, best, at);
    where[e] = int(at);
  }
}

// Gather, one thread per input element: the sum, in window order, of dout over
// the windows whose first maximum (pool_argmax's `where`) is this element. No
// atomics and no zero-fill: the same bits on every run, overlapping windows
// included.
template <typename T>
__device__ void pool_max_grad(const int* __restrict__ where, const T* __restrict__ dout,
                              T* __restrict__ dx, long long planes, const PoolGeometry g) {
  const long long per_plane = (long long)g.H * g.W, total = planes * per_plane * g.C;
  const long long nt = global_threads();
  for (long long e = global_tid(); e < total; e += nt) {
    const Element el = element(e, per_plane, g.C);
    const int p = el.pixel, h = p / g.W, w = p % g.W;
    const long long first = el.image * g.Ho * (long long)g.Wo;
    const Covering cov = covering(h, w, g);
    double acc = 0.0;
    for (int oh = cov.oh_lo; oh <= cov.oh_hi; ++oh) {
      for (int ow = cov.ow_lo; ow <= cov.ow_hi; ++ow) {
        const long long o = (first + (long long)oh * g.Wo + ow) * g.C + el.c;
        if (where[o] == p) acc += double(dout[o]);
      }
    }
    dx[e] = T(acc);
  }
}

template <typename T>
__device__ void pool_avg_grad(const T* __restrict__ dout, T* __restrict__ dx, long long planes,
                              const PoolGeometry g) {
  const long long per_plane = (long long)g.H * g.W, total = planes * per_plane * g.C;
  const long long nt = global_threads();
  for (long long e = global_tid(); e < total; e += nt) {
    const Element el = element(e, per_plane, g.C);
    const int p = el.pixel, h = p / g.W, w = p % g.W;
    const T* dp = dout + el.image * g.Ho * (long long)g.Wo * g.C + el.c;
    const Covering cov = covering(h, w, g);
    double acc = 0.0;
    for (int oh = cov.oh_lo; oh <= cov.oh_hi; ++oh) {
      const int ch = window_count(oh, g.sh, g.ph, g.kh, g.H);
      for (int ow = cov.ow_lo; ow <= cov.ow_hi; ++ow) {
        const int cw = window_count(ow, g.sw, g.pw, g.kw, g.W);
        acc += double(dp[((long long)oh * g.Wo + ow) * g.C]) / double(ch * cw);
      }
    }
    dx[e] = T(acc);
  }
}

}  // namespace mg

#define MG_POOL_ARGS \
  long long planes, int H, int W, int kh, int kw, int sh, int sw, int ph, int pw, int Ho, int Wo, \
      int C
#define MG_POOL_GEOMETRY mg::PoolGeometry{H, W, kh, kw, sh, sw, ph, pw, Ho, Wo, C}

#define MG_POOL_KERNELS(T, SFX)                                                                 \
  extern "C" __global__ void pool_max_##SFX(const T* x, T* out, MG_POOL_ARGS) {                 \
    mg::pool_forward<T, true>(x, out, planes, MG_POOL_GEOMETRY);                                \
  }                                                                                             \
  extern "C" __global__ void pool_avg_##SFX(const T* x, T* out, MG_POOL_ARGS) {                 \
    mg::pool_forward<T, false>(x, out, planes, MG_POOL_GEOMETRY);                               \
  }                                                                                             \
  extern "C" __global__ void pool_argmax_##SFX(const T* x, int* where, MG_POOL_ARGS) {          \
    mg::pool_argmax<T>(x, where, planes, MG_POOL_GEOMETRY);                                     \
  }                                                                                             \
  extern "C" __global__ void pool_max_grad_##SFX(const int* where, const T* dout, T* dx,        \
                                                 MG_POOL_ARGS) {                                \
    mg::pool_max_grad<T>(where, dout, dx, planes, MG_POOL_GEOMETRY);                            \
  }                                                                                             \
  extern "C" __global__ void pool_avg_grad_##SFX(const T* dout, T* dx, MG_POOL_ARGS) {          \
    mg::pool_avg_grad<T>(dout, dx, planes, MG_POOL_GEOMETRY);                                   \
  }

MG_POOL_KERNELS(float, f32)
MG_POOL_KERNELS(double, f64)
