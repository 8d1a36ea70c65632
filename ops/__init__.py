"""The op library: importing it registers every op's schema and kernels.

One module per op family; each declares its schema, shape checks, CPU
kernel, GPU kernel binding and grad maker.
"""
from importlib import import_module

OP_MODULES = ("batch_norm", "fill", "elementwise", "mul", "conv2d", "pool2d", "activation",
              "softmax_with_cross_entropy", "mean", "optimizer_ops",
              "sync_batch_norm", "collective")

for _name in OP_MODULES:
    import_module(f"{__name__}.{_name}")
