// Device helpers shared by every kernel module: vector packs, warp and block
// reductions (sums and Welford/Chan merges), the last-block-done ticket, and
// the walkers that visit one channel of a (pre, C, post) tensor.
//
// Conventions: every block has a multiple of 32 threads (full-mask shuffles);
// 1-D blocks have at most 1024 threads, the 2-D "row" blocks at most
// ROW_THREADS. Element indices are 64-bit.
#pragma once

namespace mg {

constexpr unsigned FULL_MASK = 0xffffffffu;
constexpr int ROW_THREADS = 256;        // threads of a 2-D row block (kernels/cuda/launch.py agrees)
constexpr int MERGE_SLOTS = 256;        // shared slots of a column merge: 8 warps x 32 lanes

// ---- thread geometry -------------------------------------------------------

__device__ __forceinline__ int flat_tid() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}
__device__ __forceinline__ int block_threads() { return blockDim.x * blockDim.y * blockDim.z; }
__device__ __forceinline__ long long global_tid() {
  return (long long)blockIdx.x * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ long long global_threads() {
  return (long long)gridDim.x * blockDim.x;
}

// ---- 16-byte packs ---------------------------------------------------------

// W consecutive values of T, aligned so that a pack moves in one access
// (float x4 and double x2 are 16 bytes).
template <typename T, int W>
struct alignas(sizeof(T) * W) Pack {
  T v[W];
};

template <typename T, int W>
__device__ __forceinline__ Pack<T, W> load_pack(const T* p, long long unit) {
  return reinterpret_cast<const Pack<T, W>*>(p)[unit];
}
template <typename T, int W>
__device__ __forceinline__ void store_pack(T* p, long long unit, const Pack<T, W>& v) {
  reinterpret_cast<Pack<T, W>*>(p)[unit] = v;
}

// A load that bypasses the (incoherent) L1: for data other blocks of the
// same launch wrote (partial results read by the last block).
template <typename T>
__device__ __forceinline__ T load_cg(const T* p) {
  return *reinterpret_cast<const volatile T*>(p);
}

// ---- dynamic shared memory and asynchronous copies into it ----------------------

// The block's dynamic shared memory (the launch's shared size; past 48 KiB the kernel's
// MAX_DYNAMIC_SHARED_SIZE_BYTES attribute must allow it), 16-byte aligned.
#ifdef __CUDACC__
template <typename T>
__device__ __forceinline__ T* dynamic_shared() {
  extern __shared__ __align__(16) unsigned char mg_dynamic_shared[];
  return reinterpret_cast<T*>(mg_dynamic_shared);
}
#else
template <typename T>
inline T* dynamic_shared() {
  return reinterpret_cast<T*>(emu::dynamic_shared());
}
#endif

// Copy BYTES (4, 8 or 16; both addresses aligned to it) from global to shared memory
// without waiting (cp.async on sm_80 and later: no registers, no stall). The copies a
// thread issued are complete after async_wait_all(); other threads see them after a
// __syncthreads() that follows it. Elsewhere (the emulator) a plain copy.
template <int BYTES>
__device__ __forceinline__ void async_copy(void* smem, const void* gmem) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if (BYTES == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(s), "l"(gmem), "n"(BYTES)
                 : "memory");
#else
  struct alignas(BYTES) Bytes {
    unsigned char b[BYTES];
  };
  *reinterpret_cast<Bytes*>(smem) = *reinterpret_cast<const Bytes*>(gmem);
#endif
}

// Close the group of copies issued so far (async_wait_prior counts groups).
__device__ __forceinline__ void async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Wait until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void async_wait_prior() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// A compile-time width handed to walker callbacks: Width<K>::value.
template <int K>
struct Width {
  static constexpr int value = K;
};

// ---- reduction states -------------------------------------------------------

// N accumulators that travel together through shuffles and shared memory.
// Each merge op below has an identity() (the empty state) and merge(a, b).
template <typename A, int N>
struct Vals {
  using value_type = A;
  static constexpr int size = N;
  A v[N];
};

template <typename A, int N>
__device__ __forceinline__ Vals<A, N> zero_vals() {
  Vals<A, N> s;
#pragma unroll
  for (int i = 0; i < N; ++i) s.v[i] = A(0);
  return s;
}

template <typename A, int N>
__device__ __forceinline__ Vals<A, N> shfl_xor(const Vals<A, N>& s, int offset) {
  Vals<A, N> r;
#pragma unroll
  for (int i = 0; i < N; ++i) r.v[i] = __shfl_xor_sync(FULL_MASK, s.v[i], offset);
  return r;
}

// Maximum (the first operand wins ties and NaN comparisons).
template <typename A>
struct MaxOp {
  using State = Vals<A, 1>;
  static __device__ __forceinline__ State identity() { return State{{A(-HUGE_VAL)}}; }
  static __device__ __forceinline__ State merge(const State& a, const State& b) {
    return b.v[0] > a.v[0] ? b : a;
  }
};

// N independent sums.
template <typename A, int N>
struct SumOp {
  using State = Vals<A, N>;
  static __device__ __forceinline__ State identity() { return zero_vals<A, N>(); }
  static __device__ __forceinline__ State merge(const State& a, const State& b) {
    State r;
#pragma unroll
    for (int i = 0; i < N; ++i) r.v[i] = a.v[i] + b.v[i];
    return r;
  }
};

// Welford statistics of W channels that share one count:
// v[0] = n, v[1 + k] = mean of channel k, v[1 + W + k] = M2 (sum of squared
// deviations) of channel k. Merged with Chan's formula.
template <typename A, int W>
struct WelfordOp {
  using State = Vals<A, 1 + 2 * W>;
  static __device__ __forceinline__ State identity() { return zero_vals<A, 1 + 2 * W>(); }
  static __device__ __forceinline__ State merge(const State& a, const State& b) {
    const A n = a.v[0] + b.v[0];
    if (n == A(0)) return a;
    const A wb = b.v[0] / n;            // share of b; 0 or 1 when one side is empty
    const A cross = a.v[0] * wb;        // n_a n_b / n
    State r;
    r.v[0] = n;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      const A delta = b.v[1 + k] - a.v[1 + k];
      r.v[1 + k] = a.v[1 + k] + delta * wb;
      r.v[1 + W + k] = a.v[1 + W + k] + b.v[1 + W + k] + delta * delta * cross;
    }
    return r;
  }
};

// Fold K more values per channel (d[j * W + k] is value j of channel k) into a
// Welford state: the batch's own mean and M2 first (exact divisor K, a power
// of two), then one Chan merge - one division per K values.
template <typename A, int W, int K>
__device__ __forceinline__ void welford_push(Vals<A, 1 + 2 * W>& s, const A (&d)[K * W]) {
  const A inv_k = A(1) / A(K);
  const A n = s.v[0] + A(K);
  const A wb = A(K) / n;
  const A cross = s.v[0] * wb;
#pragma unroll
  for (int k = 0; k < W; ++k) {
    A sum = A(0);
#pragma unroll
    for (int j = 0; j < K; ++j) sum += d[j * W + k];
    const A bmean = sum * inv_k;
    A bm2 = A(0);
#pragma unroll
    for (int j = 0; j < K; ++j) {
      const A e = d[j * W + k] - bmean;
      bm2 += e * e;
    }
    const A delta = bmean - s.v[1 + k];
    s.v[1 + k] += delta * wb;
    s.v[1 + W + k] += bm2 + delta * delta * cross;
  }
  s.v[0] = n;
}

// ---- warp and block merges --------------------------------------------------

// Butterfly over the lanes whose index differs in bits [lowest, 16]:
// lowest = 1 merges the whole warp, lowest = TX merges lanes of equal lane % TX.
template <class Op, class S>
__device__ __forceinline__ S warp_merge(S s, int lowest = 1) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    if (offset < lowest) break;
    s = Op::merge(s, shfl_xor(s, offset));
  }
  return s;
}

// Merge over a 1-D block; the result is valid in thread 0.
template <class Op, class S>
__device__ S block_merge(S s) {
  __shared__ S slots[32];                // one per warp
  const int tid = flat_tid(), lane = tid & 31, warp = tid >> 5;
  const int warps = block_threads() >> 5;
  s = warp_merge<Op>(s);
  __syncthreads();                       // the slots may still be read by an earlier merge
  if (lane == 0) slots[warp] = s;
  __syncthreads();
  if (warp == 0) {
    s = lane < warps ? slots[lane] : Op::identity();   // lanes past the warp count: empty
    s = warp_merge<Op>(s);
  }
  return s;
}

// Merge over the y dimension of a 2-D block (blockDim.x = TX, a power of two
// <= 32, blockDim.x * blockDim.y <= MERGE_SLOTS): threads with threadIdx.y == 0
// end with the merge of their column.
template <class Op, class S>
__device__ S column_merge(S s) {
  __shared__ S slots[MERGE_SLOTS];
  const int tx = threadIdx.x, tid = flat_tid(), lane = tid & 31, warp = tid >> 5;
  const int warps = block_threads() >> 5;
  const int TX = blockDim.x;
  s = warp_merge<Op>(s, TX);             // lanes of one column within the warp
  __syncthreads();
  if (lane < TX) slots[warp * TX + lane] = s;   // lane < TX: this warp's column tx = lane
  __syncthreads();
  if (threadIdx.y == 0) {
    s = slots[tx];
    for (int w = 1; w < warps; ++w) s = Op::merge(s, slots[w * TX + tx]);
  }
  return s;
}

// ---- last block done ----------------------------------------------------------

// Every block of a group calls this after writing its partial results; it
// returns true in all threads of the block that arrives last, which may then
// read every partial of the group (with load_cg). The ticket is reset for the
// next launch, so tickets must be zero before the first one.
__device__ __forceinline__ bool arrive_last(unsigned* tickets, long long group, unsigned blocks) {
  __shared__ int last;
  __threadfence();                       // publish this thread's partial writes
  __syncthreads();
  if (flat_tid() == 0) {
    const unsigned ticket = atomicAdd(&tickets[group], 1u);
    last = ticket == blocks - 1;
    if (last) tickets[group] = 0;        // every other block has arrived
  }
  __syncthreads();
  if (last) __threadfence();
  return last != 0;
}

// ---- walkers over one channel ------------------------------------------------

// Planar layout (pre, C, post_v) in units: visit units [lo, hi) of channel c
// (unit u is row u / post_v, column u % post_v), thread-strided over a 1-D
// block, U units per call of f where possible: f(const long long (&addr)[K])
// for K = U, then K = 1 for the rest. No division inside the loop.
template <int U, class F>
__device__ __forceinline__ void planar_walk(long long lo, long long hi, long long c, long long C,
                                            long long post_v, F&& f) {
  const long long bd = blockDim.x;
  long long u = lo + threadIdx.x;
  if (u >= hi) return;
  long long p = u / post_v, q = u - p * post_v;
  const long long row = C * post_v;
  const long long dp = bd / post_v, dq = bd - dp * post_v;
  const long long step = dp * row + dq, wrap = row - post_v;
  long long a = (p * C + c) * post_v + q;
  for (; u + (U - 1) * bd < hi; u += U * bd) {
    long long addr[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      addr[j] = a;
      q += dq;
      a += step;
      if (q >= post_v) { q -= post_v; a += wrap; }
    }
    f(addr);
  }
  for (; u < hi; u += bd) {
    long long addr[1] = {a};
    f(addr);
    q += dq;
    a += step;
    if (q >= post_v) { q -= post_v; a += wrap; }
  }
}

// Row layout (rows, Cv) in units, 2-D block: visit rows [lo, hi) of unit
// column cv, strided by blockDim.y; f as in planar_walk.
template <int U, class F>
__device__ __forceinline__ void row_walk(long long lo, long long hi, long long cv, long long Cv,
                                         F&& f) {
  const long long ty = threadIdx.y, TY = blockDim.y;
  long long r = lo + ty;
  for (; r + (U - 1) * TY < hi; r += U * TY) {
    long long addr[U];
#pragma unroll
    for (int j = 0; j < U; ++j) addr[j] = (r + j * TY) * Cv + cv;
    f(addr);
  }
  for (; r < hi; r += TY) {
    long long addr[1] = {r * Cv + cv};
    f(addr);
  }
}

// The channel of a flat element index of a (pre, C, post) tensor, kept up to
// date while the index advances by a fixed stride, with no division per step.
struct ChannelCursor {
  long long q;    // position within the channel's row of `post` elements
  long long c;    // channel
  long long dq, dc;
  __device__ __forceinline__ void init(long long e, long long stride, long long post,
                                       long long C) {
    const long long row = e / post;
    q = e - row * post;
    c = row % C;
    const long long srow = stride / post;
    dq = stride - srow * post;
    dc = srow % C;
  }
  __device__ __forceinline__ void advance(long long post, long long C) {
    q += dq;
    c += dc;
    if (q >= post) { q -= post; c += 1; }
    if (c >= C) c -= C;
  }
  __device__ __forceinline__ void retreat(long long post, long long C) {
    q -= dq;
    c -= dc;
    if (q < 0) { q += post; c -= 1; }
    if (c < 0) c += C;
  }
};

// Channel of each of the W elements starting at the cursor.
template <int W>
__device__ __forceinline__ void pack_channels(const ChannelCursor& cur, long long post,
                                              long long C, long long (&ch)[W]) {
  long long q = cur.q, c = cur.c;
#pragma unroll
  for (int j = 0; j < W; ++j) {
    ch[j] = c;
    if (++q == post) {
      q = 0;
      if (++c == C) c = 0;
    }
  }
}

// Grid-stride walk over `total` elements in packs of W (16-byte aligned data
// when W > 1): f(unit, K) for the K = W elements at [unit * W, unit * W + W),
// then f(e, 1) for each of the fewer than W elements left over.
template <int W, class F>
__device__ __forceinline__ void flat_walk(long long total, F&& f) {
  const long long gt = global_tid(), nt = global_threads();
  const long long units = total / W;
  for (long long u = gt; u < units; u += nt) f(u, Width<W>());
  if (W > 1) {
    const long long e = units * W + gt;
    if (e < total) f(e, Width<1>());
  }
}

// Grid-stride walk over a flat (pre, C, post) tensor of `total` elements in
// packs of W (the data must be 16-byte aligned when W > 1):
// f(unit, ch, uniform) for the pack at elements [unit * K, unit * K + K) with
// ch[j] the channel of element j and `uniform` true when all K share ch[0];
// K = W for the packs, then K = 1 for the fewer than W elements left over.
// REVERSE walks from the end of the tensor to its start: a pass that follows
// a reduction over the same data then first reads what is still in L2.
template <int W, bool REVERSE = false, class F>
__device__ __forceinline__ void channel_elementwise(long long total, long long C, long long post,
                                                    F&& f) {
  const long long gt = global_tid(), nt = global_threads();
  const long long units = total / W;
  if (gt < units) {
    ChannelCursor cur;
    cur.init((REVERSE ? units - 1 - gt : gt) * W, nt * W, post, C);
    for (long long i = gt; i < units; i += nt) {
      const long long u = REVERSE ? units - 1 - i : i;
      long long ch[W];
      pack_channels<W>(cur, post, C, ch);
      f(u, ch, cur.q + W <= post);
      if (REVERSE) cur.retreat(post, C);
      else cur.advance(post, C);
    }
  }
  if (W > 1) {
    const long long e = units * W + gt;
    if (e < total) {
      long long ch[1] = {(e / post) % C};
      f(e, ch, true);
    }
  }
}

}  // namespace mg
