// add, subtract, multiply and divide with numpy broadcasting both ways, and the
// sum of a tensor down to a shape that broadcasts to it (their gradients).
//
// Shapes arrive collapsed (kernels/cuda/strided.cuh): out has dims n, x and y are
// read through strides xs and ys (0 on their broadcast dims). Equal shapes
// take the packed maps `add` / `subtract` / ... instead. divide_grad_y: out =
// -(dout / y) * x / y in double (dout of out's shape, x and y broadcast), the
// elementwise part of divide's dy. reduce_sum: out[k] = the
// sum, in double, of d over the reduced dims (rn, strides rs) at kept position
// k (dims kn, strides ks; out is contiguous in kept order), one block per
// output with its threads strided over the reduced positions.
#include "map.cuh"
#include "strided.cuh"

MG_BINARY_MAP(add, a, b, a + b)
MG_BINARY_MAP(subtract, a, b, a - b)
MG_BINARY_MAP(multiply, a, b, a * b)
MG_BINARY_MAP(divide, a, b, a / b)
MG_UNARY_MAP(negate, x, -x)

namespace mg {

enum BinaryOp { ADD, SUBTRACT, MULTIPLY, DIVIDE };

// out may be x or y (in place: the fused conv's residual): no __restrict__ here.
template <typename T, int OP>
__device__ void broadcast_op(const T* x, const T* y, T* out, long long total, const Dims n,
                             const Dims xs, const Dims ys) {
  const long long gt = global_tid(), nt = global_threads();
  if (gt >= total) return;
  Cursor c;
  c.init(gt, nt, n);
  for (long long e = gt; e < total; e += nt) {
    const T a = x[c.offset(xs)], b = y[c.offset(ys)];
    out[e] = OP == ADD ? a + b : OP == SUBTRACT ? a - b : OP == MULTIPLY ? a * b : a / b;
    c.advance(n);
  }
}

template <typename T>
__device__ void divide_grad_y(const T* __restrict__ d, const T* __restrict__ x,
                              const T* __restrict__ y, T* __restrict__ out, long long total,
                              const Dims n, const Dims xs, const Dims ys) {
  const long long gt = global_tid(), nt = global_threads();
  if (gt >= total) return;
  Cursor c;
  c.init(gt, nt, n);
  for (long long e = gt; e < total; e += nt) {
    const double yv = double(y[c.offset(ys)]);
    out[e] = T(-(double(d[e]) / yv) * double(x[c.offset(xs)]) / yv);
    c.advance(n);
  }
}

template <typename T>
__device__ void reduce_sum(const T* __restrict__ d, T* __restrict__ out, long long kept,
                           long long reduced, const Dims kn, const Dims ks, const Dims rn,
                           const Dims rs) {
  for (long long k = blockIdx.x; k < kept; k += gridDim.x) {
    const long long base = offset_of(k, kn, ks);
    Vals<double, 1> st = zero_vals<double, 1>();
    if (threadIdx.x < reduced) {
      Cursor c;
      c.init(threadIdx.x, blockDim.x, rn);
      for (long long r = threadIdx.x; r < reduced; r += blockDim.x) {
        st.v[0] += double(d[base + c.offset(rs)]);
        c.advance(rn);
      }
    }
    st = block_merge<SumOp<double, 1>>(st);
    if (threadIdx.x == 0) out[k] = T(st.v[0]);
  }
}

}  // namespace mg

#define MG_BROADCAST_OP_KERNEL(T, SFX, NAME, OP)                                               \
  extern "C" __global__ void broadcast_##NAME##_##SFX(const T* x, const T* y, T* out,         \
                                                      long long total, MG_DIMS_PARAMS(n),     \
                                                      MG_DIMS_PARAMS(xs),                     \
                                                      MG_DIMS_PARAMS(ys)) {                   \
    mg::broadcast_op<T, mg::OP>(x, y, out, total, MG_DIMS(n), MG_DIMS(xs), MG_DIMS(ys));      \
  }

#define MG_BROADCAST_KERNELS(T, SFX)                                                          \
  MG_BROADCAST_OP_KERNEL(T, SFX, add, ADD)                                                    \
  MG_BROADCAST_OP_KERNEL(T, SFX, subtract, SUBTRACT)                                          \
  MG_BROADCAST_OP_KERNEL(T, SFX, multiply, MULTIPLY)                                          \
  MG_BROADCAST_OP_KERNEL(T, SFX, divide, DIVIDE)                                              \
  extern "C" __global__ void divide_grad_y_##SFX(const T* d, const T* x, const T* y, T* out,  \
                                                 long long total, MG_DIMS_PARAMS(n),          \
                                                 MG_DIMS_PARAMS(xs), MG_DIMS_PARAMS(ys)) {    \
    mg::divide_grad_y<T>(d, x, y, out, total, MG_DIMS(n), MG_DIMS(xs), MG_DIMS(ys));          \
  }                                                                                           \
  extern "C" __global__ void reduce_sum_##SFX(const T* d, T* out, long long kept,             \
                                              long long reduced, MG_DIMS_PARAMS(kn),          \
                                              MG_DIMS_PARAMS(ks), MG_DIMS_PARAMS(rn),         \
                                              MG_DIMS_PARAMS(rs)) {                           \
    mg::reduce_sum<T>(d, out, kept, reduced, MG_DIMS(kn), MG_DIMS(ks), MG_DIMS(rn),           \
                      MG_DIMS(rs));                                                           \
  }

MG_BROADCAST_KERNELS(float, f32)
MG_BROADCAST_KERNELS(double, f64)
