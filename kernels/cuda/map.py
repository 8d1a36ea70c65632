"""The generic launcher of the one-line elementwise kernels of kernels/cuda/map.cuh.

A `.cu` file declares maps with `MG_UNARY_MAP(name, x, expr)`,
`MG_BINARY_MAP(name, a, b, expr)`, their one-scalar forms `..._MAP_S` and their
two-scalar forms `..._MAP_S2`;
`signatures(module)` reads those declarations out of the source, so a module
made only of them (a "map-only" module) needs no launcher file of its own:

    // kernels/cuda/softsign.cu
    #include "map.cuh"
    MG_UNARY_MAP(softsign, x, x / (T(1) + fabs(x)))

    out = map.unary("softsign", "softsign", x)           # the whole launcher

Modules with a launcher of their own may declare maps too; the loader merges
both kinds of signatures (`loader.signature_table`).
"""
from __future__ import annotations

import functools
import re

from minigraph.kernels.cuda import launch, loader

# macro -> (argument format without the scalars, number of double scalars)
MACROS = {"MG_UNARY_MAP": ("PPq", 0), "MG_UNARY_MAP_S": ("PPq", 1),
          "MG_UNARY_MAP_S2": ("PPq", 2), "MG_BINARY_MAP": ("PPPq", 0),
          "MG_BINARY_MAP_S": ("PPPq", 1), "MG_BINARY_MAP_S2": ("PPPq", 2)}
VARIANTS = ("f32_w1", "f32_w4", "f64_w1", "f64_w2")      # map.cuh's MG_MAP_ENTRIES
_USE = re.compile(r"^[ \t]*(MG_(?:UNARY|BINARY)_MAP(?:_S2?)?)\s*\(\s*(\w+)\s*,", re.MULTILINE)
_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)


def declarations(source):
    """[(macro, map name)] of the map declarations in CUDA `source`, in order
    (comments are ignored)."""
    return _USE.findall(_COMMENTS.sub("", source))


def source_signatures(source):
    """{kernel name: argument format} of every entry point the map declarations in
    `source` define; ValueError for a name declared twice."""
    out = {}
    seen = set()
    for macro, name in declarations(source):
        if name in seen:
            raise ValueError(f"map {name!r} is declared twice")
        seen.add(name)
        base, scalars = MACROS[macro]
        out.update({f"{name}_{v}": base + "d" * scalars for v in VARIANTS})
    return out


@functools.cache
def signatures(module):
    """{kernel name: format} of the maps declared in kernels/<module>.cu."""
    return source_signatures(loader.read_source(module))


@functools.lru_cache(maxsize=1024)
def _family(module, name, scalars):
    found = signatures(module).get(f"{name}_f32_w1")
    if found is None:
        raise ValueError(f"kernels/{module}.cu declares no map {name!r} (it declares "
                         f"{sorted({n.rsplit('_', 2)[0] for n in signatures(module)})})")
    if found.count("d") != scalars:
        raise TypeError(f"map {module}.{name} takes {found.count('d')} scalar(s), got "
                        f"{scalars}")
    return f"{name}_{{t}}_w{{w}}"


def _out(what, like, out):
    if out is None:
        return loader.empty(like.shape, like.dtype)
    launch.check_array(f"{what}: out", out, like.shape, like.dtype)
    return out


def unary(module, name, x, *scalars, out=None):
    """out = f(x) elementwise, f the map `name` declared in kernels/<module>.cu
    (`scalars`: its scalars, as floats). A new array of x's shape and dtype
    (float32 or float64, C-contiguous) unless `out` is given. Returns out."""
    template = _family(module, name, len(scalars))
    if not x.flags.c_contiguous:
        launch.check_contiguous(f"{module}.{name}: x", x)
    if out is None:
        out = loader.empty(x.shape, x.dtype)
    else:
        out = _out(f"{module}.{name}", x, out)
    if x.size:
        loader.launch_flat(module, signatures(module), template, x.dtype, x.size, (x, out),
                           x.size, *(float(s) for s in scalars))
    return out


def binary(module, name, a, b, *scalars, out=None):
    """out = f(a, b) elementwise (a and b of one shape and dtype, no broadcasting),
    f the map `name` of kernels/<module>.cu. Returns out (new unless given)."""
    template = _family(module, name, len(scalars))
    if not a.flags.c_contiguous:
        launch.check_contiguous(f"{module}.{name}: first operand", a)
    if b.shape != a.shape or b.dtype != a.dtype or not b.flags.c_contiguous:
        launch.check_array(f"{module}.{name}: second operand", b, a.shape, a.dtype)
    if out is None:
        out = loader.empty(a.shape, a.dtype)
    else:
        out = _out(f"{module}.{name}", a, out)
    if a.size:
        loader.launch_flat(module, signatures(module), template, a.dtype, a.size, (a, b, out),
                           a.size, *(float(s) for s in scalars))
    return out


def op_kernels(op_type, keep, scalar=None, module=None):
    """(forward, backward): the GPU kernels of `op_type` and `<op_type>_grad` from the
    map-only module kernels/cuda/<module or op_type>.cu: out = op(x[, attrs]) and
    dx = op_grad(keep, dout[, attrs]); `scalar` names the attribute passed, or is a
    tuple of attribute names."""
    module = module or op_type
    names = () if scalar is None else (scalar,) if isinstance(scalar, str) else tuple(scalar)

    def forward(op, ins, ctx):
        args = tuple(op.attrs[n] for n in names)
        return {"out": unary(module, op_type, ins["x"], *args)}

    def backward(op, ins, ctx):
        if not op.wants("dx"):
            return {}
        args = tuple(op.attrs[n] for n in names)
        return {"dx": binary(module, op_type + "_grad", ins[keep], ins["dout"], *args)}

    forward.__doc__ = f"{op_type} on the device (kernels/cuda/{module}.cu)."
    backward.__doc__ = f"{op_type}_grad on the device (kernels/cuda/{module}.cu), when bound."
    forward.__name__, backward.__name__ = f"{op_type}_gpu", f"{op_type}_grad_gpu"
    return forward, backward
