"""Layers that combine or rearrange tensors: add, multiply, concat, reshape,
flatten, transpose. None has parameters."""
from __future__ import annotations

from minigraph.layers.base import axis_arg, known_rank, layer, tensor
from minigraph.validators import is_int


@layer("add")
def add(net, x, y, name=None):
    """x + y with numpy broadcasting both ways; gradients are summed back to each
    input's shape (a residual connection: add(net, block_out, shortcut))."""
    tensor(net, "add", "x", x, float_only=True)
    tensor(net, "add", "y", y, float_only=True)
    return net.append("add", {"x": x, "y": y}, {"out": f"{name}.out"})["out"]


@layer("multiply")
def multiply(net, x, y, name=None):
    """x * y elementwise with numpy broadcasting both ways."""
    tensor(net, "multiply", "x", x, float_only=True)
    tensor(net, "multiply", "y", y, float_only=True)
    return net.append("multiply", {"x": x, "y": y}, {"out": f"{name}.out"})["out"]


@layer("concat")
def concat(net, xs, axis=1, name=None):
    """The tensors of `xs` joined along `axis` (every other size must match)."""
    if isinstance(xs, (str, bytes)) or not hasattr(xs, "__iter__"):
        raise TypeError(f"concat: argument 'xs' must be a list of Variables, got "
                        f"{type(xs).__name__}")
    xs = list(xs)
    if not xs:
        raise ValueError("concat: argument 'xs' must hold at least one Variable")
    for i, x in enumerate(xs):
        tensor(net, "concat", f"xs[{i}]", x)
    axis = axis_arg("concat", "axis", axis, len(known_rank("concat", xs[0])))
    return net.append("concat", {"x": xs}, {"out": f"{name}.out"}, {"axis": axis})["out"]


@layer("reshape")
def reshape(net, x, shape, name=None):
    """x with a new shape: each size > 0, or one -1 inferred from the total; a
    -1 batch axis of x flows through (reshape(net, x, (-1, 64)))."""
    tensor(net, "reshape", "x", x)
    if is_int(shape) or not hasattr(shape, "__iter__") or not all(is_int(d) for d in shape):
        raise ValueError(f"reshape: argument 'shape' must be a tuple of ints, got {shape!r}")
    return net.append("reshape", {"x": x}, {"out": f"{name}.out"},
                      {"shape": tuple(int(d) for d in shape)})["out"]


@layer("flatten")
def flatten(net, x, start_axis=1, stop_axis=-1, name=None):
    """Axes start_axis..stop_axis merged into one (torch.flatten); by default every
    axis after the batch axis."""
    tensor(net, "flatten", "x", x)
    rank = len(known_rank("flatten", x))
    start = axis_arg("flatten", "start_axis", start_axis, rank)
    stop = axis_arg("flatten", "stop_axis", stop_axis, rank)
    if start > stop:
        raise ValueError(f"flatten: argument 'start_axis' ({start_axis}) must not come after "
                         f"'stop_axis' ({stop_axis})")
    return net.append("flatten", {"x": x}, {"out": f"{name}.out"},
                      {"start_axis": start, "stop_axis": stop})["out"]


@layer("transpose")
def transpose(net, x, perm, name=None):
    """x with its axes permuted: out.shape[i] = x.shape[perm[i]]."""
    tensor(net, "transpose", "x", x)
    if not hasattr(perm, "__iter__") or not all(is_int(d) for d in perm):
        raise ValueError(f"transpose: argument 'perm' must be a tuple of ints, got {perm!r}")
    perm = tuple(int(d) for d in perm)
    if sorted(perm) != list(range(len(known_rank("transpose", x)))):
        raise ValueError(f"transpose: argument 'perm' must be a permutation of "
                         f"{tuple(range(len(x.shape)))} for a rank-{len(x.shape)} input, got "
                         f"{perm}")
    return net.append("transpose", {"x": x}, {"out": f"{name}.out"}, {"perm": perm})["out"]
