"""The op library: importing it registers every op's schema and kernels.

One module per op family (`relu.py`-style: schema, shape checks, CPU
kernel, GPU binding, grad maker); every module in this package is imported
here, so a new op is one new file. Helper modules (`device`, `window`,
`batch_norm_cpu`, ...) register nothing and are imported harmlessly.
See docs/adding_an_op.md for the recipe.
"""
import pkgutil
from importlib import import_module

OP_MODULES = tuple(sorted(m.name for m in pkgutil.iter_modules(__path__)))

for _name in OP_MODULES:
    import_module(f"{__name__}.{_name}")
