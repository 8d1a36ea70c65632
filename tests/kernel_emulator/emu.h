// A CPU stand-in for the CUDA device runtime, force-included (g++ -include)
// when a kernels/*.cu file is compiled for the tests' emulator.
//
// Each block runs as blockDim cooperative fibers (runtime.cpp) on one OS thread;
// a fiber gives up the processor only at __syncthreads() and warp shuffles,
// in a shuffled order, so missing barriers and warp-level mistakes show up
// as wrong results. Blocks run one after another in an order shuffled per
// launch. __shared__ variables become function statics (one block at a time),
// poisoned with 0xFF bytes before every block (shared memory starts
// uninitialised); device memory is host memory, atomics are plain
// read-modify-writes (one thread). Dynamic shared memory (the launch's shared
// size) is one buffer, poisoned before every block and fenced by canaries
// that are checked after it; kernels reach it through mg::dynamic_shared
// (kernels/cuda/common.cuh). Asynchronous copies (cp.async) are plain copies. The module is compiled with
// -fsanitize=alignment, so every misaligned access (a 16-byte pack at an
// address that is not a multiple of 16) fails the launch, as on a GPU.
#pragma once
#include <math.h>
#include <stdint.h>
#include <string.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static

struct dim3 {
  unsigned x, y, z;
};

namespace emu {
struct FiberState {
  dim3 tid;
  int lane, warp;
};
extern FiberState* current;
extern dim3 grid_dim, block_dim, block_idx;
void syncthreads();
void warp_exchange(int warp, uint64_t bits, int src_lane, uint64_t* out);
unsigned char* dynamic_shared();
}  // namespace emu

#define threadIdx (emu::current->tid)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)
#define warpSize 32

inline void __syncthreads() { emu::syncthreads(); }
inline void __threadfence() {}
inline void __syncwarp(unsigned = 0xffffffffu) {}

template <typename T>
inline T __shfl_xor_sync(unsigned, T v, int offset, int = 32) {
  static_assert(sizeof(T) <= 8, "shuffle of more than 8 bytes");
  uint64_t bits = 0, got = 0;
  memcpy(&bits, &v, sizeof(T));
  emu::warp_exchange(emu::current->warp, bits, emu::current->lane ^ offset, &got);
  T r;
  memcpy(&r, &got, sizeof(T));
  return r;
}

template <typename T>
inline T atomicAdd(T* p, T v) {
  T old = *p;
  *p = old + v;
  return old;
}
template <typename T>
inline T atomicExch(T* p, T v) {
  T old = *p;
  *p = v;
  return old;
}
