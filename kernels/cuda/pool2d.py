"""Launchers for kernels/pool2d.cu: max / avg pooling of NCHW or NHWC (channels-last)
device arrays and their gradients (avg excludes padding; max grad goes to the first maximum).
Both gradients gather per input element in a fixed order: deterministic, the
same bits on every run, overlapping windows included. The max gradient first
finds each window's first maximum once (pool_argmax, into scratch), so it
costs O(windows x window size + inputs x windows covering each), never a
rescan of every covering window per input element."""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cuda import launch, loader
from minigraph.kernels.layout import image_shape, nchw_sizes

MODULE = "pool2d"
_GEOM = "i" * 11
SIGNATURES = {}
for _t in ("f32", "f64"):
    SIGNATURES.update({f"pool_max_{_t}": "PPq" + _GEOM, f"pool_avg_{_t}": "PPq" + _GEOM,
                       f"pool_argmax_{_t}": "PPq" + _GEOM,
                       f"pool_max_grad_{_t}": "PPPq" + _GEOM,
                       f"pool_avg_grad_{_t}": "PPq" + _GEOM})


def _pair(v):
    return (int(v), int(v)) if np.isscalar(v) else (int(v[0]), int(v[1]))


def geometry(x_shape, ksize=2, strides=None, paddings=0, global_pooling=False,
             data_layout="NCHW"):
    """(H, W, kh, kw, sh, sw, ph, pw, Ho, Wo, C): C the channels side by side in a
    pixel (NHWC; 1 for NCHW, whose N * C planes the kernels see as images of one
    channel); global pooling is one window of the whole plane. ValueError when a
    window would hold only padding."""
    _, c, h, w = (int(d) for d in nchw_sizes(data_layout, x_shape))
    c = c if data_layout == "NHWC" else 1
    if global_pooling:
        return (h, w, h, w, 1, 1, 0, 0, 1, 1, c)
    (kh, kw) = _pair(ksize)
    (sh, sw) = _pair(strides) if strides is not None else (kh, kw)
    (ph, pw) = _pair(paddings)
    if ph >= kh or pw >= kw:
        raise ValueError(f"pool2d: paddings {(ph, pw)} must be smaller than ksize {(kh, kw)}")
    ho, wo = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    if ho <= 0 or wo <= 0:
        raise ValueError(f"pool2d: output would be {ho}x{wo} for input {tuple(x_shape)}")
    return (h, w, kh, kw, sh, sw, ph, pw, ho, wo, c)


def _plan(x, ksize, strides, paddings, global_pooling, data_layout):
    """(geometry, planes, out shape, kernel-name suffix) of pooling x, once per
    device, shape, dtype and attributes (unhashable attributes: computed anew)."""
    plans = loader.cached("pool2d.plans", dict)
    key = (x.shape, x.dtype, ksize, strides, paddings, global_pooling, data_layout)
    try:
        found = plans.get(key)
    except TypeError:
        key, found = None, None
    if found is None:
        geom = geometry(x.shape, ksize, strides, paddings, global_pooling, data_layout)
        n, c = int(x.shape[0]), int(nchw_sizes(data_layout, x.shape)[1])
        planes = n if data_layout == "NHWC" else n * c
        found = (geom, planes, image_shape(data_layout, n, c, geom[8], geom[9]),
                 loader.suffix(x.dtype))
        if key is not None:
            loader.cache_put(plans, key, found)
    return found


def _launch(name, items, *args):
    loader.flat_go(MODULE, name, SIGNATURES[name], items)(*args)


def pool2d(x, pool_type="max", ksize=2, strides=None, paddings=0, global_pooling=False,
           out=None, data_layout="NCHW"):
    """out (N, C, Ho, Wo): the max or average (over real elements) of each
    window of x (N, C, H, W) (NHWC: out (N, Ho, Wo, C) of x (N, H, W, C)). Returns out."""
    geom, planes, out_shape, sfx = _plan(x, ksize, strides, paddings, global_pooling,
                                         data_layout)
    if out is None:
        out = loader.empty(out_shape, x.dtype)
    else:
        launch.check_array("pool2d: out", out, out_shape, x.dtype)
    if out.size:
        _launch(f"pool_{pool_type}_{sfx}", out.size, loader.ptr(x, "pool2d: x"),
                loader.address(out), planes, *geom)
    return out


def pool2d_grad(x, dout, pool_type="max", ksize=2, strides=None, paddings=0,
                global_pooling=False, dx=None, data_layout="NCHW"):
    """dx of pool2d: dout routed to each window's first maximum, or spread evenly
    over its real elements. Returns dx."""
    geom, planes, out_shape, sfx = _plan(x, ksize, strides, paddings, global_pooling,
                                         data_layout)
    if dout.shape != out_shape or dout.dtype != x.dtype:
        launch.check_array("pool2d_grad: dout", dout, out_shape, x.dtype)
    if dx is None:
        dx = loader.empty(x.shape, x.dtype)
    else:
        launch.check_array("pool2d_grad: dx", dx, x.shape, x.dtype)
    if dx.size == 0:
        return dx
    dp = loader.ptr(dout, "pool2d_grad: dout")
    if pool_type != "max":
        _launch(f"pool_avg_grad_{sfx}", dx.size, dp, loader.address(dx), planes, *geom)
        return dx
    if geom[0] * geom[1] > np.iinfo(np.int32).max:
        raise ValueError(f"pool2d_grad: a {geom[0]}x{geom[1]} plane has more elements than the "
                         "int32 argmax of the max gradient can index")
    where = loader.scratch(dout.size, np.int32)      # each window's first maximum
    _launch(f"pool_argmax_{sfx}", dout.size, loader.ptr(x, "pool2d_grad: x"), where, planes,
            *geom)
    _launch(f"pool_max_grad_{sfx}", dx.size, where, dp, loader.address(dx), planes, *geom)
    return dx


# ---- op kernels -------------------------------------------------------------------

def pool_geometry(op):
    """The launchers' keyword arguments for this op's attributes."""
    a = op.attrs
    return dict(pool_type=a["pool_type"], ksize=a["ksize"], strides=a["strides"],
                paddings=a["paddings"], global_pooling=a["global_pooling"],
                data_layout=a["data_layout"])


def pool2d_gpu(op, ins, ctx):
    """Max or average of every window on the device (see the module doc)."""
    return {"out": pool2d(ins["x"], **pool_geometry(op))}


def pool2d_grad_gpu(op, ins, ctx):
    """dx on the device: dout routed to each window's first max, or spread evenly
    over its real elements; nothing when dx is unbound."""
    x, d = ins["x"], ins["dout"]
    if not op.wants("dx"):
        return {}
    return {"dx": pool2d_grad(x, d, **pool_geometry(op))}
