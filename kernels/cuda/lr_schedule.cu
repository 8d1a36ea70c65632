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
//   kind 5 ("onecycle"):    torch OneCycleLR's two (or three) phases with max_lr =
//                           base, cosine or linear; with a momentum pointer, its
//                           cycled momentum of step t is written there too (other
//                           kinds write max_momentum)
// in double, in the arithmetic order of kernels/cpu/lr_schedule.py's
// schedule_value and momentum_value (the references), rounded to the rate's dtype.
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

// From start (pct 0) to end (pct 1) along half a cosine, or a line.
__device__ __forceinline__ double cos_anneal(double start, double end, double pct) {
  return end + mul_rn((start - end) / 2.0, cos(PI * pct) + 1.0);
}
__device__ __forceinline__ double linear_anneal(double start, double end, double pct) {
  return mul_rn(end - start, pct) + start;
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
  int three_phase;
  int linear;                  // anneal "linear" (else "cos")
  double base_momentum;
  double max_momentum;
};

// torch OneCycleLR's phases (kernels/cpu/lr_schedule.py's one_cycle_phases): the
// learning rate of step t, or with `momentum` the cycled momentum.
__device__ __forceinline__ double one_cycle(const Schedule& s, long long t, bool momentum) {
  const double initial = s.base / s.divide_factor;
  const double lo = s.base_momentum, hi = s.max_momentum;
  const double rise = mul_rn(s.phase_pct, double(s.total_steps)) - 1.0;
  double ends[3], lr0[3], lr1[3], m0[3], m1[3];
  int phases;
  if (s.three_phase) {
    phases = 3;
    ends[0] = rise; lr0[0] = initial; lr1[0] = s.base; m0[0] = hi; m1[0] = lo;
    ends[1] = mul_rn(2.0 * s.phase_pct, double(s.total_steps)) - 2.0;
    lr0[1] = s.base; lr1[1] = initial; m0[1] = lo; m1[1] = hi;
    ends[2] = double(s.total_steps - 1); lr0[2] = initial; lr1[2] = s.end; m0[2] = hi;
    m1[2] = hi;
  } else {
    phases = 2;
    ends[0] = rise; lr0[0] = initial; lr1[0] = s.base; m0[0] = hi; m1[0] = lo;
    ends[1] = double(s.total_steps - 1); lr0[1] = s.base; lr1[1] = s.end; m0[1] = lo;
    m1[1] = hi;
  }
  double start = 0.0;
  for (int i = 0; i < phases; ++i) {
    if (double(t) <= ends[i] || i == phases - 1) {
      double pct = (double(t) - start) / (ends[i] - start);
      if (1.0 < pct) pct = 1.0;
      const double a = momentum ? m0[i] : lr0[i], b = momentum ? m1[i] : lr1[i];
      return s.linear ? linear_anneal(a, b, pct) : cos_anneal(a, b, pct);
    }
    start = ends[i];
  }
  return 0.0;
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
    case 5: return one_cycle(s, t, false);
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
      double linear_start, double linear_end, int three_phase, int linear,                   \
      double* momentum, double base_momentum, double max_momentum) {                         \
    if (mg::flat_tid() != 0 || blockIdx.x != 0) return;                                       \
    const mg::Schedule s{kind, base, step_size, gamma, total_steps, end, warmup, milestones,  \
                         n_milestones, divide_factor, phase_pct, linear_steps, linear_start,  \
                         linear_end, three_phase, linear, base_momentum, max_momentum};       \
    const long long t = step[0];                                                              \
    lr[0] = T(mg::schedule_value(s, t));                                                      \
    if (momentum != nullptr)                                                                  \
      momentum[0] = kind == 5 ? mg::one_cycle(s, t, true) : max_momentum;                     \
    step[0] = t + 1;                                                                          \
  }

MG_SCHEDULE_KERNEL(float, f32)
MG_SCHEDULE_KERNEL(double, f64)
