"""CPU kernels: numpy engines, native C kernels, and the op kernels that use them.

Engines: `blocks` (blocked, threaded elementwise passes and per-channel
reductions), `batch_norm_stats` (batch norm's stable statistics and passes),
`conv_im2col` / `conv_im2col_grad` (convolution by columns and matrix products:
float64, groups, and everything where no C compiler is at hand), `conv_native`
(float32 convolution in C, conv_native.c: direct, and Winograd's F(4x4, 3x3)
for 3x3 convs of stride 1 in conv_winograd.h; built by `native` for this machine
and cached), `erf`, `philox`.

Op kernels: one module per op family of ops/ (`activation` for
ops/activation.py, ...), each function `<op>_cpu(op, ins, ctx)`.
"""
