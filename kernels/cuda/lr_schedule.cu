// lr_schedule: the learning rate of step t = step[0] from a schedule, written to
// lr[0], then step[0] = t + 1 - one thread, no host sync (ops/lr_schedule.py).
// First a linear warm-up: t < L (linear_warmup_steps) gives
// start + (end - start) * t / L; later steps run the kind at t - L:
//   kind 0 ("step"):        base * gamma ^ (t / step_size)
//   kind 1 ("cosine"):      t < W: base * (t + 1) / W; else, with t' = t - W and
//                           T = total_steps - W: end + (base - end) * (1 + cos(pi t' / T)) / 2
//   kind 2 ("constant"):    base
//   kind 3 ("exponential"): base * gamma ^ t
//   kind 4 ("multistep"):   base * gamma ^ (the number of the n milestones <= t)
//   kind 5 ("onecycle"):    torch OneCycleLR's two cosine phases with max_lr = base
// in double, in the arithmetic order of kernels/cpu/lr_schedule.py's
// schedule_value (the reference), rounded to the rate's dtype.
#include "common.cuh"

namespace mg {

constexpr double PI = 3.141592653589793;

// a * b rounded on its own, never fused with a following addition (Python's order).
__device__ __forceinline__ double mul_rn(double a, double b) {
#ifdef __CUDA_ARCH__
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

// From start (pct 0) to end (pct 1) along half a cosine.
__device__ __forceinline__ double cos_anneal(double start, double end, double pct) {
  return end + mul_rn((start - end) / 2.0, cos(PI * pct) + 1.0);
}

struct Schedule {
  int kind;
  double base;
  long long step_size;
  double gamma;
  long long total_steps;
  double end;
  long long warmup;
  const long long* milestones;
  int n_milestones;
  double divide_factor;
  double phase_pct;
  long long linear_steps;
  double linear_start;
  double linear_end;
};

__device__ __forceinline__ double one_cycle(const Schedule& s, long long t) {
  const double rise_end = mul_rn(s.phase_pct, double(s.total_steps)) - 1.0;
  if (double(t) <= rise_end)
    return cos_anneal(s.base / s.divide_factor, s.base, double(t) / rise_end);
  double pct = (double(t) - rise_end) / (double(s.total_steps - 1) - rise_end);
  if (1.0 < pct) pct = 1.0;
  return cos_anneal(s.base, s.end, pct);
}

__device__ __forceinline__ double schedule_value(const Schedule& s, long long t) {
  if (t < s.linear_steps)
    return s.linear_start + (s.linear_end - s.linear_start) * double(t) / double(s.linear_steps);
  t -= s.linear_steps;
  switch (s.kind) {
    case 0: return s.base * pow(s.gamma, double(t / s.step_size));
    case 2: return s.base;
    case 3: return s.base * pow(s.gamma, double(t));
    case 4: {
      int passed = 0;
      while (passed < s.n_milestones && s.milestones[passed] <= t) ++passed;
      return s.base * pow(s.gamma, double(passed));
    }
    case 5: return one_cycle(s, t);
    default: break;
  }
  if (t < s.warmup) return s.base * double(t + 1) / double(s.warmup);
  const double span = double(s.total_steps - s.warmup);
  return s.end + (s.base - s.end) * (1.0 + cos(PI * double(t - s.warmup) / span)) / 2.0;
}

}  // namespace mg

#define MG_SCHEDULE_KERNEL(T, SFX)                                                            \
  extern "C" __global__ void lr_schedule_##SFX(                                              \
      long long* step, T* lr, int kind, double base, long long step_size, double gamma,       \
      long long total_steps, double end, long long warmup, const long long* milestones,       \
      int n_milestones, double divide_factor, double phase_pct, long long linear_steps,       \
      double linear_start, double linear_end) {                                               \
    if (mg::flat_tid() != 0 || blockIdx.x != 0) return;                                       \
    const mg::Schedule s{kind, base, step_size, gamma, total_steps, end, warmup, milestones,  \
                         n_milestones, divide_factor, phase_pct, linear_steps, linear_start,  \
                         linear_end};                                                         \
    const long long t = step[0];                                                              \
    lr[0] = T(mg::schedule_value(s, t));                                                      \
    step[0] = t + 1;                                                                          \
  }

MG_SCHEDULE_KERNEL(float, f32)
MG_SCHEDULE_KERNEL(double, f64)
