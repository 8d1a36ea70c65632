"""Launchers for kernels/cuda/broadcast.cu: add, subtract, multiply and divide with
numpy broadcasting both ways, their gradients, and sums of a tensor down to a
broadcastable shape.

Equal shapes run the packed maps; otherwise the shapes are collapsed
(kernels/cuda/strided.py) and each output element reads x and y through their
broadcast strides. A sum down to a shape whose kept dims form one run (a
bias, a row or column sum, a full sum) is elementwise.channel_sum; any other
one is reduce_sum, one block per output; both add in double.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels import present
from minigraph.kernels.cuda import elementwise, launch, loader, shape_ops, strided
from minigraph.kernels.cuda import map as maps

MODULE = "broadcast"
_DIMS = "q" * strided.MAX_DIMS
OPS = ("add", "subtract", "multiply", "divide")
SIGNATURES = {**{f"broadcast_{op}_{t}": "PPPq" + 3 * _DIMS for op in OPS for t in ("f32", "f64")},
              **{f"divide_grad_y_{t}": "PPPPq" + 3 * _DIMS for t in ("f32", "f64")},
              **{f"reduce_sum_{t}": "PPqq" + 4 * _DIMS for t in ("f32", "f64")}}


def _binary(op, x, y, out):
    if np.dtype(x.dtype) != np.dtype(y.dtype):
        raise ValueError(f"{op}: x and y must have one dtype, got {np.dtype(x.dtype)} and "
                         f"{np.dtype(y.dtype)}")
    launch.check_contiguous(f"{op}: x", x)
    launch.check_contiguous(f"{op}: y", y)
    shape = strided.broadcast_shape(op, x.shape, y.shape)
    if out is None:
        out = loader.empty(shape, x.dtype)
    launch.check_array(f"{op}: out", out, shape, x.dtype)
    if out.size == 0:
        return out
    if tuple(x.shape) == tuple(y.shape):
        return maps.binary(MODULE, op, x, y, out=out)
    dims, (xs, ys) = strided.collapse(shape, strided.broadcast_strides(shape, x.shape),
                                      strided.broadcast_strides(shape, y.shape))
    name = f"broadcast_{op}_{loader.suffix(x.dtype)}"
    k = loader.kernel(MODULE, name, SIGNATURES[name])
    dev = loader.device()
    threads = launch.block_threads(dev)
    grid = launch.flat_grid(out.size, dev, threads, k.resources)
    k.launch((grid, 1, 1), (threads, 1, 1), loader.ptr(x, f"{op}: x"), loader.ptr(y, f"{op}: y"),
             loader.ptr(out, f"{op}: out"), out.size, *strided.padded(op, dims, xs, ys))
    return out


def add(x, y, out=None):
    """out = x + y with numpy broadcasting (float32/64, one dtype); a new array of
    the broadcast shape unless `out` is given. Returns out."""
    return _binary("add", x, y, out)


def subtract(x, y, out=None):
    """out = x - y with numpy broadcasting. Returns out (new unless given)."""
    return _binary("subtract", x, y, out)


def multiply(x, y, out=None):
    """out = x * y with numpy broadcasting. Returns out (new unless given)."""
    return _binary("multiply", x, y, out)


def divide(x, y, out=None):
    """out = x / y with numpy broadcasting (IEEE: x / 0 is inf or nan). Returns out
    (new unless given)."""
    return _binary("divide", x, y, out)


def reduce_to(d, shape, out=None, what="reduce_to"):
    """out (of `shape`, which broadcasts to d's shape) = d summed over the
    broadcast dims, in double; a device copy when nothing is summed. Returns out."""
    shape = tuple(int(n) for n in shape)
    try:
        fits = strided.broadcast_shape(what, shape, d.shape) == tuple(d.shape)
    except ValueError:
        fits = False
    if not fits:
        raise ValueError(f"{what}: shape {shape} does not broadcast to {tuple(d.shape)}")
    if out is None:
        out = loader.empty(shape, d.dtype)
    launch.check_array(f"{what}: out", out, shape, d.dtype)
    if out.size == 0:
        return out
    if d.size == 0:                          # sums over nothing
        from minigraph.kernels.cuda import fill

        return fill.fill_constant(out, 0)
    dims, (ds, ts) = strided.collapse(d.shape, strided.contiguous_strides(d.shape),
                                      strided.broadcast_strides(d.shape, shape))
    if all(ts):                              # only dims of size 1 differ
        return shape_ops.copy(d, out=out)
    view = strided.channel_view_of(dims, ts)
    if view is not None:
        return elementwise.channel_sum(d, *view, out=out)
    kn, ks, rn, rs = strided.split_kept(dims, ds, ts)
    name = f"reduce_sum_{loader.suffix(d.dtype)}"
    k = loader.kernel(MODULE, name, SIGNATURES[name])
    dev = loader.device()
    kept = out.size
    threads = launch.row_block_threads(d.size // kept, dev)
    grid = launch.rows_grid(kept, threads, dev, k.resources)
    k.launch((grid, 1, 1), (threads, 1, 1), loader.ptr(d, f"{what}: d"),
             loader.ptr(out, f"{what}: out"), kept, d.size // kept,
             *strided.padded(what, kn, ks), *strided.padded(what, rn, rs))
    return out


def add_grad(x_shape, y_shape, dout, need_dx=True, need_dy=True):
    """(dx, dy) of out = x + y (broadcast): dout summed back to each input's shape
    (None for the ones not needed)."""
    dx = reduce_to(dout, x_shape, what="add_grad: dx") if need_dx else None
    dy = reduce_to(dout, y_shape, what="add_grad: dy") if need_dy else None
    return dx, dy


def multiply_grad(x, y, dout, need_dx=True, need_dy=True):
    """(dx, dy) of out = x * y (broadcast): dx = dout * y summed back to x's shape,
    dy = dout * x summed back to y's shape (the products in the dtype, the sums
    in double); None for the ones not needed."""
    return (_product_grad(dout, y, x.shape, "multiply_grad: dx") if need_dx else None,
            _product_grad(dout, x, y.shape, "multiply_grad: dy") if need_dy else None)


def _product_grad(dout, other, shape, what):
    product = multiply(dout, other)
    if tuple(product.shape) == tuple(shape):
        return product
    return reduce_to(product, shape, what=what)


def subtract_grad(x_shape, y_shape, dout, need_dx=True, need_dy=True):
    """(dx, dy) of out = x - y (broadcast): dx = dout summed back to x's shape,
    dy = -(dout summed back to y's shape); None for the ones not needed."""
    dx = reduce_to(dout, x_shape, what="subtract_grad: dx") if need_dx else None
    dy = None
    if need_dy:
        dy = reduce_to(dout, y_shape, what="subtract_grad: dy")
        maps.unary(MODULE, "negate", dy, out=dy)
    return dx, dy


def divide_grad(x, y, dout, need_dx=True, need_dy=True):
    """(dx, dy) of out = x / y (broadcast): dx = dout / y summed back to x's shape
    (the quotient in the dtype), dy = -(dout / y) * x / y (in double) summed back to
    y's shape; the sums in double; None for the ones not needed."""
    dx = dy = None
    if need_dx:
        q = divide(dout, y)
        dx = q if tuple(q.shape) == tuple(x.shape) else reduce_to(q, x.shape,
                                                                  what="divide_grad: dx")
    if need_dy:
        g = divide_grad_y(dout, x, y)
        dy = g if tuple(g.shape) == tuple(y.shape) else reduce_to(g, y.shape,
                                                                  what="divide_grad: dy")
    return dx, dy


def divide_grad_y(dout, x, y):
    """-(dout / y) * x / y elementwise in double, x and y broadcast to dout's shape (their
    broadcast shape); a new array of dout's shape and dtype."""
    what = "divide_grad"
    launch.check_contiguous(f"{what}: dout", dout)
    launch.check_contiguous(f"{what}: x", x)
    launch.check_contiguous(f"{what}: y", y)
    shape = tuple(int(n) for n in dout.shape)
    if strided.broadcast_shape(what, x.shape, y.shape) != shape:
        raise ValueError(f"{what}: dout has shape {shape}, not the broadcast shape of x "
                         f"{tuple(x.shape)} and y {tuple(y.shape)}")
    if not np.dtype(x.dtype) == np.dtype(y.dtype) == np.dtype(dout.dtype):
        raise ValueError(f"{what}: dout, x and y must have one dtype, got "
                         f"{np.dtype(dout.dtype)}, {np.dtype(x.dtype)} and {np.dtype(y.dtype)}")
    out = loader.empty(shape, dout.dtype)
    if out.size == 0:
        return out
    dims, (_, xs, ys) = strided.collapse(shape, strided.contiguous_strides(shape),
                                         strided.broadcast_strides(shape, x.shape),
                                         strided.broadcast_strides(shape, y.shape))
    name = f"divide_grad_y_{loader.suffix(dout.dtype)}"
    loader.flat_go(MODULE, name, SIGNATURES[name], out.size)(
        loader.ptr(dout), loader.ptr(x), loader.ptr(y), loader.address(out), out.size,
        *strided.padded(what, dims, xs, ys))
    return out


# ---- op kernels -------------------------------------------------------------------

def add_gpu(op, ins, ctx):
    """out = x + y, broadcast, on the device."""
    return {"out": add(ins["x"], ins["y"])}


def add_grad_gpu(op, ins, ctx):
    """dx, dy = dout summed (in double) back to x's and y's shapes, each when bound."""
    dx, dy = add_grad(ins["x"].shape, ins["y"].shape, ins["dout"], need_dx=op.wants("dx"),
                          need_dy=op.wants("dy"))
    return present(dx=dx, dy=dy)


def multiply_gpu(op, ins, ctx):
    """out = x * y, broadcast, on the device."""
    return {"out": multiply(ins["x"], ins["y"])}


def multiply_grad_gpu(op, ins, ctx):
    """dx = (dout * y) and dy = (dout * x) summed back to x's and y's shapes, each when
    bound; the products in the dtype, the sums in double."""
    dx, dy = multiply_grad(ins["x"], ins["y"], ins["dout"], need_dx=op.wants("dx"),
                               need_dy=op.wants("dy"))
    return present(dx=dx, dy=dy)


def subtract_gpu(op, ins, ctx):
    """out = x - y, broadcast, on the device."""
    return {"out": subtract(ins["x"], ins["y"])}


def subtract_grad_gpu(op, ins, ctx):
    """dx = dout and dy = -dout, each summed (in double) back to its input's shape, each
    when bound."""
    dx, dy = subtract_grad(ins["x"].shape, ins["y"].shape, ins["dout"],
                           need_dx=op.wants("dx"), need_dy=op.wants("dy"))
    return present(dx=dx, dy=dy)


def divide_gpu(op, ins, ctx):
    """out = x / y, broadcast, on the device."""
    return {"out": divide(ins["x"], ins["y"])}


def divide_grad_gpu(op, ins, ctx):
    """dx = dout / y and dy = -(dout / y) * x / y, each summed (in double) back to its
    input's shape, each when bound."""
    dx, dy = divide_grad(ins["x"], ins["y"], ins["dout"], need_dx=op.wants("dx"),
                         need_dy=op.wants("dy"))
    return present(dx=dx, dy=dy)
