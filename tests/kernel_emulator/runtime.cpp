// The fiber scheduler behind emu.h: emu_launch runs a kernel wrapper over a grid,
// checking what the hardware would refuse: the launch's grid and block sizes, the
// static shared memory a block touches plus the dynamic shared memory it asked for,
// writes outside the dynamic shared memory, and the alignment of every access (the
// kernel module is compiled with -fsanitize=alignment; the handler is below).
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#if !defined(__x86_64__) || defined(EMU_UCONTEXT)
#include <ucontext.h>
#endif

#include <algorithm>
#include <random>
#include <vector>

#include "emu.h"

namespace emu {
FiberState* current = nullptr;
dim3 grid_dim, block_dim, block_idx;

// The first misaligned access of a launch (kernels keep running: x86 allows it).
struct Misaligned {
  bool seen;
  const char* file;
  unsigned line, col, align, kind;
  uintptr_t addr;
};
Misaligned misaligned;

// The module's __shared__ variables (function statics): their addresses and sizes,
// set once by emu_set_shared. Poisoned before every block, as shared memory is
// uninitialised on a GPU; those a block changed count as its static shared memory.
std::vector<unsigned char*> shared_at;
std::vector<size_t> shared_size;
const unsigned char SHARED_POISON = 0xFF;

// The launch's dynamic shared memory: `dynamic_size` bytes at dynamic_at, 16-byte
// aligned, with DYNAMIC_PAD canary bytes on each side (checked after every block).
const size_t DYNAMIC_PAD = 64;
const unsigned char DYNAMIC_CANARY = 0x5A;
std::vector<unsigned char> dynamic_raw;
unsigned char* dynamic_at = nullptr;
size_t dynamic_size = 0;

unsigned char* dynamic_shared() { return dynamic_at; }

namespace {
// A fiber's saved context, and the switch between two. On x86-64 a few instructions
// that save the callee-saved registers and the FP control words on the old stack and
// restore them from the new one; ucontext's getcontext/swapcontext also save and
// restore the signal mask, a system call on every switch (most of the time of the
// emulated GPU tests).
// Elsewhere, or built with -DEMU_UCONTEXT: ucontext.
#if defined(__x86_64__) && !defined(EMU_UCONTEXT)
struct Context {
  void* sp = nullptr;
};
extern "C" void emu_switch_stack(void** save_sp, void* load_sp);
asm(R"(
  .pushsection .text
  .p2align 4
  .globl emu_switch_stack
  .hidden emu_switch_stack
  .type emu_switch_stack, @function
emu_switch_stack:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  subq $8, %rsp
  stmxcsr (%rsp)
  fnstcw 4(%rsp)
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  ldmxcsr (%rsp)
  fldcw 4(%rsp)
  addq $8, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size emu_switch_stack, .-emu_switch_stack
  .popsection
)");

void switch_context(Context* from, Context* to) { emu_switch_stack(&from->sp, to->sp); }

// `ctx` starts `entry` on `stack` at its first switch (entry must never return).
void start_context(Context* ctx, char* stack, size_t bytes, void (*entry)()) {
  uint32_t words[2] = {0, 0};                 // MXCSR, the x87 control word
  asm volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(words[0]), "=m"(words[1]));
  uintptr_t* sp = reinterpret_cast<uintptr_t*>(
      reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t(15));
  *--sp = 0;                                  // entry's return address: none
  *--sp = reinterpret_cast<uintptr_t>(entry);  // where the switch's ret goes
  for (int r = 0; r < 6; ++r) *--sp = 0;       // rbp, rbx, r12-r15
  *--sp = uint64_t(words[1]) << 32 | words[0];
  ctx->sp = sp;
}
#else
struct Context {
  ucontext_t uc;
};

void switch_context(Context* from, Context* to) { swapcontext(&from->uc, &to->uc); }

void start_context(Context* ctx, char* stack, size_t bytes, void (*entry)()) {
  getcontext(&ctx->uc);
  ctx->uc.uc_stack.ss_sp = stack;
  ctx->uc.uc_stack.ss_size = bytes;
  ctx->uc.uc_link = nullptr;
  makecontext(&ctx->uc, entry, 0);
}
#endif

struct Fiber {
  FiberState state;
  Context ctx;
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

Context scheduler;
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
  switch_context(&f->ctx, &scheduler);        // done: never resumed
  abort();
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
  switch_context(&f->ctx, &scheduler);
}

bool runnable(const Fiber& f) {
  if (f.done) return false;
  if (f.wait == 1) return block_barrier.gen != f.wait_gen;
  if (f.wait == 2) return warp_barriers[f.state.warp].gen != f.wait_gen;
  return true;
}
}  // namespace

void syncthreads() { wait_on(1, block_barrier); }

void abandon_fiber() { switch_context(&running->ctx, &scheduler); }

void warp_exchange(int warp, uint64_t bits, int src_lane, uint64_t* out) {
  Fiber* f = running;
  const unsigned parity = f->shuffle_seq++ & 1u;
  uint64_t* slots = &shuffle_slots[(warp * 2 + parity) * 32];
  slots[f->state.lane] = bits;
  wait_on(2, warp_barriers[warp]);
  *out = slots[src_lane & 31];
}
}  // namespace emu

// UBSan's record of a checked access (GCC's -fsanitize=alignment, handler version 1).
struct UbsanLocation {
  const char* file;
  uint32_t line, column;
};
struct UbsanTypeMismatch {
  UbsanLocation location;
  const void* type;
  unsigned char log_alignment;
  unsigned char check_kind;     // 0 load, 1 store, others: a reference or member access
};

// A misaligned access: recorded, and the fiber never resumes (the access itself
// may be an aligned SSE move that faults on x86); the launch then fails.
extern "C" void __ubsan_handle_type_mismatch_v1(UbsanTypeMismatch* data, uintptr_t pointer) {
  emu::Misaligned& m = emu::misaligned;
  if (!m.seen)
    m = emu::Misaligned{true, data->location.file, data->location.line, data->location.column,
                        1u << data->log_alignment, data->check_kind, pointer};
  emu::abandon_fiber();
}

// Tell the runtime where the module's __shared__ variables are (see emu::shared_at).
extern "C" void emu_set_shared(int count, unsigned long long* addresses,
                               unsigned long long* sizes) {
  emu::shared_at.assign(count, nullptr);
  emu::shared_size.assign(count, 0);
  for (int i = 0; i < count; ++i) {
    emu::shared_at[i] = reinterpret_cast<unsigned char*>(addresses[i]);
    emu::shared_size[i] = sizes[i];
  }
}

namespace {
void poison_shared() {
  for (size_t i = 0; i < emu::shared_at.size(); ++i)
    memset(emu::shared_at[i], emu::SHARED_POISON, emu::shared_size[i]);
}

void set_dynamic(size_t bytes) {
  emu::dynamic_raw.assign(bytes + 2 * emu::DYNAMIC_PAD + 64, emu::DYNAMIC_CANARY);
  uintptr_t start = reinterpret_cast<uintptr_t>(emu::dynamic_raw.data()) + emu::DYNAMIC_PAD;
  start = (start + 63) & ~uintptr_t(63);
  emu::dynamic_at = reinterpret_cast<unsigned char*>(start);
  emu::dynamic_size = bytes;
}

void poison_dynamic() {
  memset(emu::dynamic_raw.data(), emu::DYNAMIC_CANARY, emu::dynamic_raw.size());
  memset(emu::dynamic_at, emu::SHARED_POISON, emu::dynamic_size);
}

bool dynamic_fenced() {
  const unsigned char* raw = emu::dynamic_raw.data();
  const unsigned char* end = raw + emu::dynamic_raw.size();
  for (const unsigned char* p = raw; p < emu::dynamic_at; ++p)
    if (*p != emu::DYNAMIC_CANARY) return false;
  for (const unsigned char* p = emu::dynamic_at + emu::dynamic_size; p < end; ++p)
    if (*p != emu::DYNAMIC_CANARY) return false;
  return true;
}

size_t shared_touched() {
  size_t bytes = 0;
  for (size_t i = 0; i < emu::shared_at.size(); ++i) {
    const unsigned char* p = emu::shared_at[i];
    for (size_t b = 0; b < emu::shared_size[i]; ++b)
      if (p[b] != emu::SHARED_POISON) {
        bytes += emu::shared_size[i];
        break;
      }
  }
  return bytes;
}

const char* const ACCESS_KINDS[] = {"a load", "a store", "a reference binding",
                                    "a member access", "a member call"};   // UBSan's

const char* access_kind(unsigned kind) { return kind < 5 ? ACCESS_KINDS[kind] : "an access"; }
}  // namespace

// Run `fn(args)` for every thread of the grid, blocks one after another in an
// order shuffled by `seed`, each with `dynamic_bytes` of dynamic shared memory.
// Returns 0, or 1 with a message in `err`: a grid or block the hardware refuses,
// more static shared memory plus `dynamic_bytes` than `shared_limit` bytes, a
// write outside the dynamic shared memory, a misaligned access, or a deadlock (a
// barrier some threads never reach). `*shared_used`: the most static shared
// memory one block touched.
extern "C" int emu_launch(void (*fn)(void**), unsigned gx, unsigned gy, unsigned gz,
                          unsigned bx, unsigned by, unsigned bz, void** args, unsigned seed,
                          char* err, int errlen, unsigned long long shared_limit,
                          unsigned long long dynamic_bytes, unsigned long long* shared_used) {
  using namespace emu;
  const unsigned long long threads = 1ull * bx * by * bz;
  *shared_used = 0;
  if (dynamic_bytes > shared_limit) {
    snprintf(err, errlen, "%llu bytes of dynamic shared memory, more than the %llu a block of "
             "it may have", dynamic_bytes, shared_limit);
    return 1;
  }
  set_dynamic(dynamic_bytes);
  if (gx == 0 || gy == 0 || gz == 0 || gx > 2147483647u || gy > 65535 || gz > 65535) {
    snprintf(err, errlen, "grid (%u, %u, %u): the hardware allows x in [1, 2^31 - 1] and "
             "y, z in [1, 65535]", gx, gy, gz);
    return 1;
  }
  if (bx > 1024 || by > 1024 || bz > 64 || threads == 0 || threads % 32 != 0 ||
      threads > 1024) {
    snprintf(err, errlen, "block (%u, %u, %u) of %llu threads: the hardware allows x, y <= "
             "1024, z <= 64 and 1024 threads; the kernels need a multiple of 32", bx, by, bz,
             threads);
    return 1;
  }
  misaligned.seen = false;
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
    poison_shared();
    poison_dynamic();
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
      start_context(&f.ctx, f.stack, STACK_BYTES, fiber_main);
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
        switch_context(&scheduler, &f.ctx);
        progress = true;
        if (misaligned.seen) break;          // the fiber was abandoned: the launch fails
        if (f.done) ++done;
      }
      if (misaligned.seen) break;
      if (!progress && done < threads) {
        snprintf(err, errlen, "deadlock in block (%u, %u, %u): %u of %llu threads finished",
                 b.x, b.y, b.z, done, threads);
        return 1;
      }
    }
    if (misaligned.seen) {
      const Misaligned& m = misaligned;
      snprintf(err, errlen, "misaligned %u-byte access (%s) at %s:%u:%u in block (%u, %u, %u): "
               "address %#llx is %llu bytes past a %u-byte boundary (a GPU kills the context)",
               m.align, access_kind(m.kind), m.file, m.line, m.col, b.x, b.y, b.z,
               (unsigned long long)m.addr, (unsigned long long)(m.addr % m.align), m.align);
      return 1;
    }
    if (!dynamic_fenced()) {
      snprintf(err, errlen, "block (%u, %u, %u) wrote outside its %llu bytes of dynamic shared "
               "memory", b.x, b.y, b.z, dynamic_bytes);
      return 1;
    }
    const size_t used = shared_touched();
    if (used > *shared_used) *shared_used = used;
    if (used + dynamic_bytes > shared_limit) {
      if (dynamic_bytes)
        snprintf(err, errlen, "block (%u, %u, %u) uses %zu bytes of static shared memory and "
                 "%llu of dynamic, more than the %llu a block may have", b.x, b.y, b.z, used,
                 dynamic_bytes, shared_limit);
      else
        snprintf(err, errlen, "block (%u, %u, %u) uses %zu bytes of static shared memory, more "
                 "than the %llu a block may have", b.x, b.y, b.z, used, shared_limit);
      return 1;
    }
  }
  return 0;
}
