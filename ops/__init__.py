"""What each op is: importing this package registers every op.

One module per op family: its schemas (slots, typed attributes, in-place pairs,
roles), shape and dtype inference, grad maker, ONNX exporter, and the
registration of its kernels, which live in kernels/cpu and kernels/cuda. No
numerics here. Every module of the package is imported below, so a new op is
one new module (see docs/adding_an_op.md).
"""
import pkgutil
from importlib import import_module

OP_MODULES = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__)))

for _name in OP_MODULES:
    import_module(f"{__name__}.{_name}")
