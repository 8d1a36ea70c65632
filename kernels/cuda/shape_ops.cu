// Copies that move data between layouts, for any dtype (kernels are per word
// size: u8, u16, u32, u64; 16-byte packs of words when the launcher allows):
//
// copy:      dst[e] = src[e] (reshape, flatten, a copy of any tensor).
// copy_rows: dst[r * dpitch + doff + c] = src[r * spitch + soff + c] for r < rows,
//            c < cols, in packs (pitches, offsets and cols counted in packs):
//            concat writes each input into its columns of the output, and
//            concat_grad reads them back out.
// transpose: dst[e] = src[offset of e's multi-index under strides s], dst
//            contiguous with collapsed dims n (kernels/cuda/strided.cuh).
#include "strided.cuh"

namespace mg {

template <typename U, int W>
__device__ void copy_words(const U* __restrict__ src, U* __restrict__ dst, long long total) {
  flat_walk<W>(total, [&](long long u, auto width) {
    constexpr int K = decltype(width)::value;
    store_pack<U, K>(dst, u, load_pack<U, K>(src, u));
  });
}

template <typename U, int W>
__device__ void copy_rows(const U* __restrict__ src, long long spitch, long long soff,
                          U* __restrict__ dst, long long dpitch, long long doff, long long rows,
                          long long cols) {
  const long long total = rows * cols, gt = global_tid(), nt = global_threads();
  if (gt >= total) return;
  long long r = gt / cols, c = gt - r * cols;
  const long long dr = nt / cols, dc = nt - dr * cols;
  for (long long e = gt; e < total; e += nt) {
    store_pack<U, W>(dst, r * dpitch + doff + c, load_pack<U, W>(src, r * spitch + soff + c));
    c += dc;
    r += dr;
    if (c >= cols) {
      c -= cols;
      r += 1;
    }
  }
}

template <typename U>
__device__ void transpose(const U* __restrict__ src, U* __restrict__ dst, long long total,
                          const Dims n, const Dims s) {
  const long long gt = global_tid(), nt = global_threads();
  if (gt >= total) return;
  Cursor cur;
  cur.init(gt, nt, n);
  for (long long e = gt; e < total; e += nt) {
    dst[e] = src[cur.offset(s)];
    cur.advance(n);
  }
}

}  // namespace mg

#define MG_COPY_KERNELS(U, SFX, W)                                                            \
  extern "C" __global__ void copy_##SFX##_w##W(const U* src, U* dst, long long total) {       \
    mg::copy_words<U, W>(src, dst, total);                                                    \
  }                                                                                           \
  extern "C" __global__ void copy_rows_##SFX##_w##W(const U* src, long long spitch,           \
                                                    long long soff, U* dst, long long dpitch, \
                                                    long long doff, long long rows,           \
                                                    long long cols) {                         \
    mg::copy_rows<U, W>(src, spitch, soff, dst, dpitch, doff, rows, cols);                    \
  }
#define MG_TRANSPOSE_KERNEL(U, SFX)                                                           \
  extern "C" __global__ void transpose_##SFX(const U* src, U* dst, long long total,           \
                                             MG_DIMS_PARAMS(n), MG_DIMS_PARAMS(s)) {          \
    mg::transpose<U>(src, dst, total, MG_DIMS(n), MG_DIMS(s));                                \
  }

MG_COPY_KERNELS(unsigned char, u8, 1)
MG_COPY_KERNELS(unsigned char, u8, 16)
MG_COPY_KERNELS(unsigned short, u16, 1)
MG_COPY_KERNELS(unsigned short, u16, 8)
MG_COPY_KERNELS(unsigned, u32, 1)
MG_COPY_KERNELS(unsigned, u32, 4)
MG_COPY_KERNELS(unsigned long long, u64, 1)
MG_COPY_KERNELS(unsigned long long, u64, 2)
MG_TRANSPOSE_KERNEL(unsigned char, u8)
MG_TRANSPOSE_KERNEL(unsigned short, u16)
MG_TRANSPOSE_KERNEL(unsigned, u32)
MG_TRANSPOSE_KERNEL(unsigned long long, u64)
