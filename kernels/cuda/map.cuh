// Elementwise map kernels declared in one line each.
//
//   MG_UNARY_MAP(sigmoid, x, T(1) / (T(1) + exp(-x)))
//   MG_BINARY_MAP(sigmoid_grad, out, dout, dout * out * (T(1) - out))
//   MG_UNARY_MAP_S(leaky_relu, x, alpha, x > T(0) ? x : alpha * x)
//   MG_BINARY_MAP_S(leaky_relu_grad, x, dout, alpha, x > T(0) ? dout : alpha * dout)
//   MG_UNARY_MAP_S2(clip, x, lo, hi, x < lo ? lo : (x > hi ? hi : x))
//
// Each use defines four entry points, NAME_{f32,f64}_w{1,W} (W = 4 for float,
// 2 for double: 16-byte packs, used when every array is 16-byte aligned):
//   unary:  NAME_..(const T* x, T* out, long long total [, double s [, double s1]])
//   binary: NAME_..(const T* a, const T* b, T* out, long long total [, double s [, double s1]])
// The expression (everything after the operand and scalar names; it may hold
// commas) is evaluated in the element type T with the operands of type T; a
// scalar arrives as a double and is converted to T once per launch (the _S
// forms take one scalar, the _S2 forms two).
// kernels/cuda/map.py derives the launch signatures from these macro uses (a .cu
// made only of them needs no launcher of its own) and launches them.
// out may be an operand (in place: the fused conv's relu, a mean's division):
// no pointer here is __restrict__, so no load may take the read-only path.
#pragma once
#include "common.cuh"

namespace mg {

template <typename T, int W, class F>
__device__ __forceinline__ void map_unary(const T* x, T* out, long long total, const F& f) {
  flat_walk<W>(total, [&](long long u, auto width) {
    constexpr int K = decltype(width)::value;
    Pack<T, K> v = load_pack<T, K>(x, u);
#pragma unroll
    for (int j = 0; j < K; ++j) v.v[j] = f(v.v[j]);
    store_pack<T, K>(out, u, v);
  });
}

template <typename T, int W, class F>
__device__ __forceinline__ void map_binary(const T* a, const T* b, T* out, long long total,
                                           const F& f) {
  flat_walk<W>(total, [&](long long u, auto width) {
    constexpr int K = decltype(width)::value;
    Pack<T, K> va = load_pack<T, K>(a, u);
    const Pack<T, K> vb = load_pack<T, K>(b, u);
#pragma unroll
    for (int j = 0; j < K; ++j) va.v[j] = f(va.v[j], vb.v[j]);
    store_pack<T, K>(out, u, va);
  });
}

}  // namespace mg

// ---- entry points: one per element type and pack width ------------------------------

#define MG_MAP_UNARY_ENTRY(NAME, T, SFX, W)                                                   \
  extern "C" __global__ void NAME##_##SFX##_w##W(const T* x, T* out, long long total) {       \
    mg::map_unary<T, W>(x, out, total, mg_map_##NAME<T>{});                                   \
  }
#define MG_MAP_UNARY_S_ENTRY(NAME, T, SFX, W)                                                 \
  extern "C" __global__ void NAME##_##SFX##_w##W(const T* x, T* out, long long total,         \
                                                 double s) {                                  \
    mg::map_unary<T, W>(x, out, total, mg_map_##NAME<T>{T(s)});                               \
  }
#define MG_MAP_BINARY_ENTRY(NAME, T, SFX, W)                                                  \
  extern "C" __global__ void NAME##_##SFX##_w##W(const T* a, const T* b, T* out,              \
                                                 long long total) {                           \
    mg::map_binary<T, W>(a, b, out, total, mg_map_##NAME<T>{});                               \
  }
#define MG_MAP_BINARY_S_ENTRY(NAME, T, SFX, W)                                                \
  extern "C" __global__ void NAME##_##SFX##_w##W(const T* a, const T* b, T* out,              \
                                                 long long total, double s) {                 \
    mg::map_binary<T, W>(a, b, out, total, mg_map_##NAME<T>{T(s)});                           \
  }
#define MG_MAP_UNARY_S2_ENTRY(NAME, T, SFX, W)                                                \
  extern "C" __global__ void NAME##_##SFX##_w##W(const T* x, T* out, long long total,         \
                                                 double s, double s1) {                       \
    mg::map_unary<T, W>(x, out, total, mg_map_##NAME<T>{T(s), T(s1)});                        \
  }
#define MG_MAP_BINARY_S2_ENTRY(NAME, T, SFX, W)                                               \
  extern "C" __global__ void NAME##_##SFX##_w##W(const T* a, const T* b, T* out,              \
                                                 long long total, double s, double s1) {      \
    mg::map_binary<T, W>(a, b, out, total, mg_map_##NAME<T>{T(s), T(s1)});                    \
  }
#define MG_MAP_ENTRIES(KIND, NAME)                                                            \
  KIND(NAME, float, f32, 1)                                                                   \
  KIND(NAME, float, f32, 4)                                                                   \
  KIND(NAME, double, f64, 1)                                                                  \
  KIND(NAME, double, f64, 2)

// ---- the declarations -----------------------------------------------------------------

#define MG_UNARY_MAP(NAME, X, ...)                                                            \
  template <typename T>                                                                       \
  struct mg_map_##NAME {                                                                      \
    __device__ __forceinline__ T operator()(T X) const { return (__VA_ARGS__); }              \
  };                                                                                          \
  MG_MAP_ENTRIES(MG_MAP_UNARY_ENTRY, NAME)

#define MG_UNARY_MAP_S(NAME, X, S, ...)                                                       \
  template <typename T>                                                                       \
  struct mg_map_##NAME {                                                                      \
    T S;                                                                                      \
    __device__ __forceinline__ T operator()(T X) const { return (__VA_ARGS__); }              \
  };                                                                                          \
  MG_MAP_ENTRIES(MG_MAP_UNARY_S_ENTRY, NAME)

#define MG_BINARY_MAP(NAME, A, B, ...)                                                        \
  template <typename T>                                                                       \
  struct mg_map_##NAME {                                                                      \
    __device__ __forceinline__ T operator()(T A, T B) const { return (__VA_ARGS__); }         \
  };                                                                                          \
  MG_MAP_ENTRIES(MG_MAP_BINARY_ENTRY, NAME)

#define MG_BINARY_MAP_S(NAME, A, B, S, ...)                                                   \
  template <typename T>                                                                       \
  struct mg_map_##NAME {                                                                      \
    T S;                                                                                      \
    __device__ __forceinline__ T operator()(T A, T B) const { return (__VA_ARGS__); }         \
  };                                                                                          \
  MG_MAP_ENTRIES(MG_MAP_BINARY_S_ENTRY, NAME)

#define MG_UNARY_MAP_S2(NAME, X, S, S1, ...)                                                  \
  template <typename T>                                                                       \
  struct mg_map_##NAME {                                                                      \
    T S, S1;                                                                                  \
    __device__ __forceinline__ T operator()(T X) const { return (__VA_ARGS__); }              \
  };                                                                                          \
  MG_MAP_ENTRIES(MG_MAP_UNARY_S2_ENTRY, NAME)

#define MG_BINARY_MAP_S2(NAME, A, B, S, S1, ...)                                              \
  template <typename T>                                                                       \
  struct mg_map_##NAME {                                                                      \
    T S, S1;                                                                                  \
    __device__ __forceinline__ T operator()(T A, T B) const { return (__VA_ARGS__); }         \
  };                                                                                          \
  MG_MAP_ENTRIES(MG_MAP_BINARY_S2_ENTRY, NAME)
