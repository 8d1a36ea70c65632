// lr_schedule: the learning rate of step t = step[0] from a schedule, written to
// lr[0], then step[0] = t + 1 - one thread, no host sync (ops/lr_schedule.py):
//   kind 0 ("step"):   base * gamma ^ (t / step_size)
//   kind 1 ("cosine"): t < W: base * (t + 1) / W; else, with t' = t - W and
//                      T = total_steps - W: end + (base - end) * (1 + cos(pi t' / T)) / 2
// computed in double and rounded to the rate's dtype.
#include "common.cuh"

namespace mg {

__device__ __forceinline__ double schedule_value(long long t, int kind, double base,
                                                 long long step_size, double gamma,
                                                 long long total_steps, double end,
                                                 long long warmup) {
  if (kind == 0) return base * pow(gamma, double(t / step_size));
  if (t < warmup) return base * double(t + 1) / double(warmup);
  const double span = double(total_steps - warmup);
  return end + (base - end) * (1.0 + cos(3.141592653589793 * double(t - warmup) / span)) / 2.0;
}

}  // namespace mg

#define MG_SCHEDULE_KERNEL(T, SFX)                                                            \
  extern "C" __global__ void lr_schedule_##SFX(long long* step, T* lr, int kind, double base, \
                                               long long step_size, double gamma,             \
                                               long long total_steps, double end,             \
                                               long long warmup) {                            \
    if (mg::flat_tid() != 0 || blockIdx.x != 0) return;                                       \
    const long long t = step[0];                                                              \
    lr[0] = T(mg::schedule_value(t, kind, base, step_size, gamma, total_steps, end, warmup)); \
    step[0] = t + 1;                                                                          \
  }

MG_SCHEDULE_KERNEL(float, f32)
MG_SCHEDULE_KERNEL(double, f64)
