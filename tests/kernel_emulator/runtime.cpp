// The fiber scheduler behind emu.h: emu_launch runs a kernel wrapper over a grid.
#include <stdio.h>
#include <stdlib.h>
#include <ucontext.h>

#include <algorithm>
#include <random>
#include <vector>

#include "emu.h"

namespace emu {
FiberState* current = nullptr;
dim3 grid_dim, block_dim, block_idx;

namespace {
struct Fiber {
  FiberState state;
  ucontext_t ctx;
  char* stack = nullptr;
  bool done = false;
  int wait = 0;        // 0: runnable, 1: block barrier, 2: warp barrier
  unsigned wait_gen = 0;
  unsigned shuffle_seq = 0;
};
struct Barrier {
  unsigned gen = 0, arrived = 0, alive = 0;
  void arrive_last_check() {
    if (arrived > 0 && arrived == alive) {
      arrived = 0;
      ++gen;
    }
  }
};

ucontext_t scheduler;
std::vector<Fiber> fibers;
Fiber* running = nullptr;
Barrier block_barrier;
std::vector<Barrier> warp_barriers;
std::vector<uint64_t> shuffle_slots;     // [warp][parity][lane]
void (*wrapper)(void**) = nullptr;
void** wrapper_args = nullptr;
const size_t STACK_BYTES = 128 * 1024;
std::vector<char*> stacks;              // reused across launches, never touched up front

void fiber_main() {
  wrapper(wrapper_args);
  Fiber* f = running;
  f->done = true;
  block_barrier.alive--;
  block_barrier.arrive_last_check();
  Barrier& wb = warp_barriers[f->state.warp];
  wb.alive--;
  wb.arrive_last_check();
  // returning switches to uc_link (the scheduler)
}

void wait_on(int kind, Barrier& b) {
  Fiber* f = running;
  const unsigned gen = b.gen;
  if (++b.arrived == b.alive) {
    b.arrived = 0;
    ++b.gen;
    return;
  }
  f->wait = kind;
  f->wait_gen = gen;
  swapcontext(&f->ctx, &scheduler);
}

bool runnable(const Fiber& f) {
  if (f.done) return false;
  if (f.wait == 1) return block_barrier.gen != f.wait_gen;
  if (f.wait == 2) return warp_barriers[f.state.warp].gen != f.wait_gen;
  return true;
}
}  // namespace

void syncthreads() { wait_on(1, block_barrier); }

void warp_exchange(int warp, uint64_t bits, int src_lane, uint64_t* out) {
  Fiber* f = running;
  const unsigned parity = f->shuffle_seq++ & 1u;
  uint64_t* slots = &shuffle_slots[(warp * 2 + parity) * 32];
  slots[f->state.lane] = bits;
  wait_on(2, warp_barriers[warp]);
  *out = slots[src_lane & 31];
}
}  // namespace emu

// Run `fn(args)` for every thread of the grid. Returns 0, or 1 with a message
// in `err` (deadlock: a barrier some threads never reach).
extern "C" int emu_launch(void (*fn)(void**), unsigned gx, unsigned gy, unsigned gz,
                          unsigned bx, unsigned by, unsigned bz, void** args, unsigned seed,
                          char* err, int errlen) {
  using namespace emu;
  const unsigned threads = bx * by * bz;
  if (threads == 0 || threads % 32 != 0 || threads > 1024) {
    snprintf(err, errlen, "block of %u threads: must be a multiple of 32, at most 1024", threads);
    return 1;
  }
  wrapper = fn;
  wrapper_args = args;
  grid_dim = dim3{gx, gy, gz};
  block_dim = dim3{bx, by, bz};
  const unsigned warps = threads / 32;
  std::mt19937 rng(seed);
  std::vector<dim3> blocks;
  for (unsigned z = 0; z < gz; ++z)
    for (unsigned y = 0; y < gy; ++y)
      for (unsigned x = 0; x < gx; ++x) blocks.push_back(dim3{x, y, z});
  std::shuffle(blocks.begin(), blocks.end(), rng);
  fibers.assign(threads, Fiber());
  while (stacks.size() < threads) stacks.push_back(static_cast<char*>(malloc(STACK_BYTES)));
  for (unsigned t = 0; t < threads; ++t) fibers[t].stack = stacks[t];
  std::vector<unsigned> order(threads);
  for (unsigned i = 0; i < threads; ++i) order[i] = i;
  for (const dim3& b : blocks) {
    block_idx = b;
    block_barrier = Barrier{0, 0, threads};
    warp_barriers.assign(warps, Barrier{0, 0, 32});
    shuffle_slots.assign(warps * 2 * 32, 0);
    for (unsigned t = 0; t < threads; ++t) {
      Fiber& f = fibers[t];
      f.state.tid = dim3{t % bx, (t / bx) % by, t / (bx * by)};
      f.state.lane = t % 32;
      f.state.warp = t / 32;
      f.done = false;
      f.wait = 0;
      f.shuffle_seq = 0;
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = f.stack;
      f.ctx.uc_stack.ss_size = STACK_BYTES;
      f.ctx.uc_link = &scheduler;
      makecontext(&f.ctx, fiber_main, 0);
    }
    unsigned done = 0;
    while (done < threads) {
      std::shuffle(order.begin(), order.end(), rng);
      bool progress = false;
      done = 0;
      for (unsigned i : order) {
        Fiber& f = fibers[i];
        if (f.done) {
          ++done;
          continue;
        }
        if (!runnable(f)) continue;
        f.wait = 0;
        running = &f;
        current = &f.state;
        swapcontext(&scheduler, &f.ctx);
        progress = true;
        if (f.done) ++done;
      }
      if (!progress && done < threads) {
        snprintf(err, errlen, "deadlock in block (%u, %u, %u): %u of %u threads finished",
                 b.x, b.y, b.z, done, threads);
        return 1;
      }
    }
  }
  return 0;
}
