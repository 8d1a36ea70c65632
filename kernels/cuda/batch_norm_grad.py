"""Launchers of batch_norm.cu's backward: dx, dscale and dbias from x, dy and the
statistics used (batch_norm.py launches the forward passes; batch_norm_sync.py
the multi-process ones, with the helpers here).
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cuda import batch_norm as bn
from minigraph.kernels.cuda import bn_resident, bn_rows, launch, loader


def check_grad(x, dy, layout, params):
    """(pre, channels, post, x's pointer, dy's pointer, the pointers of `params`)
    after checking them (dy: x's shape and dtype)."""
    pre, channels, post = bn.geometry(x, layout)
    xp = loader.ptr(x, "batch_norm: x")
    found = bn.param_ptrs(x, layout, channels, params)
    dyp = loader.ptr(dy, "batch_norm_grad: dy")
    if dy.shape != x.shape or dy.dtype != x.dtype:
        raise ValueError(f"batch_norm_grad: dy must match x {x.dtype}{tuple(x.shape)}, got "
                         f"{dy.dtype}{tuple(dy.shape)}")
    return pre, channels, post, xp, dyp, found


def grad_outputs(x, channels, need_dx, need_dscale, need_dbias):
    """(dx, dscale, dbias), None where not needed; dscale and dbias share one
    allocation (loader.empty_group) when both are."""
    dtype = x.dtype
    dx = loader.empty(x.shape, dtype) if need_dx else None
    if need_dscale and need_dbias:
        return (dx, *loader.empty_group(((channels,), (channels,)), dtype))
    return (dx, loader.empty((channels,), dtype) if need_dscale else None,
            loader.empty((channels,), dtype) if need_dbias else None)


def grad_reduce(name_stem, x, xp, dyp, pre, channels, post, tail, coef_words=0, yp=0):
    """Launch the per-channel sums of dy and dy (x - mean) (x and dy at xp and dyp; dy
    masked by y > 0 when yp is not 0); `tail` ends the arguments, before the mask's y.
    The scratch (loader.scratch) holds `coef_words` values (the dx coefficients, whose
    pointer then ends the arguments) and the split partials. Returns the coefficients'
    device address."""
    plan, reduce = bn.reduce_plan(name_stem, x, bn.aligned(xp, dyp, yp), pre, channels, post)
    coef = loader.scratch(coef_words + 2 * channels * plan.splits, x.dtype)
    partial = coef + coef_words * np.dtype(x.dtype).itemsize
    reduce(xp, dyp, pre, channels, *plan.split_args, partial,
           loader.ptr(loader.tickets(plan.tickets)), *tail, *((coef,) if coef_words else ()), yp)
    return coef


def grad_dx(x, xp, dyp, dx, channels, post, coef, use_global_est, yp=0, bits=0, shift=0):
    """dx from the coefficients at `coef` (4C); dy masked by the reduction's `bits`
    (bytes of 2^shift values) or, without them, by y > 0 at yp (batch_norm_relu)."""
    if not x.size:
        return
    dxp = loader.address(dx)
    yp = 0 if bits else yp
    if post == 1:
        bn_rows.dx(x, xp, dyp, dxp, channels, coef, not use_global_est, yp, bits, shift)
    elif use_global_est:
        bn.packed_launch("bn_grad_dx_global", x.dtype, x.size, bn.aligned(dyp, dxp, yp), 1, dyp,
                         dxp, x.size, channels, post, coef, yp, bits, shift)
    else:
        bn.packed_launch("bn_grad_dx", x.dtype, x.size, bn.aligned(xp, dyp, dxp, yp), 1, xp, dyp,
                         dxp, x.size, channels, post, coef, yp, bits, shift)


_GRAD_PARAMS = ("scale", "mean", "var")


def relu_pointer(x, relu_out):
    """The device address of batch_norm_relu's forward output (0 for None), checked to
    match x."""
    if relu_out is None:
        return 0
    if relu_out.shape != x.shape or np.dtype(relu_out.dtype) != np.dtype(x.dtype):
        raise ValueError(f"batch_norm_relu_grad: y must match x {x.dtype}{tuple(x.shape)}, got "
                         f"{relu_out.dtype}{tuple(relu_out.shape)}")
    return loader.ptr(relu_out, "batch_norm_relu_grad: y")


def backward(x, dy, scale, mean, var, eps, layout="NCHW", use_global_est=False, need_dx=True,
             need_dscale=True, need_dbias=True, relu_out=None):
    """Gradients of batch norm given dy (x's shape and dtype).

    mean, var: the statistics the forward normalised with - the batch mean and
    (biased) batch variance, or the estimates with use_global_est=True (then
    they are constants: dx = dy * scale / sqrt(var + eps)). With
    xhat = (x - mean) * invstd: dbias = sum(dy), dscale = sum(dy * xhat),
    dx = scale * invstd * (dy - mean(dy) - xhat * mean(dy * xhat)).
    relu_out: batch_norm_relu's forward output y; dy then counts only where y > 0.
    Returns (dx, dscale, dbias), None for those not needed.
    """
    xp = loader.ptr(x, "batch_norm: x")
    dyp = loader.ptr(dy, "batch_norm_grad: dy")
    if dy.shape != x.shape or dy.dtype is not x.dtype and dy.dtype != x.dtype:
        raise ValueError(f"batch_norm_grad: dy must match x {x.dtype}{tuple(x.shape)}, got "
                         f"{dy.dtype}{tuple(dy.shape)}")
    yp = relu_pointer(x, relu_out)
    plans = loader.cached("batch_norm.grad", dict)
    key = (x.shape, x.dtype, layout, bn.aligned(xp, dyp, yp), bool(yp), launch.tunables())
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = _GradPlan(x, layout, key[3], bool(yp))
    channels = plan.channels
    sp, mp, vp = bn.param_ptrs(x, layout, channels, zip(_GRAD_PARAMS, (scale, mean, var)))
    dx, dscale, dbias = grad_outputs(x, channels, need_dx, need_dscale, need_dbias)
    if plan.n == 0:
        from minigraph.kernels.cuda import fill

        for a in (dscale, dbias):
            if a is not None:
                fill.fill_constant(a, 0)
        return dx, dscale, dbias
    dxp, dsp, dbp = (loader.address(a) for a in (dx, dscale, dbias))
    resident = plan.resident
    if resident is not None and (resident.width == 1 or bn.aligned(dxp)):
        bn_resident.grad(resident, x, (xp, dyp, yp, dxp), plan.pre, channels, plan.post,
                         (sp, mp, vp, dsp, dbp), eps, use_global_est)
        return dx, dscale, dbias
    itemsize = x.dtype.itemsize
    mask_words = -(-x.size // plan.width // itemsize) if yp and dx is not None else 0
    coef = loader.scratch(4 * channels + plan.partials + mask_words, x.dtype)
    partial = coef + 4 * channels * itemsize
    bits = partial + plan.partials * itemsize if mask_words else 0
    plan.reduce(xp, dyp, plan.pre, channels, *plan.split_args, partial,
                loader.address(loader.tickets(plan.tickets)), sp, mp, vp, float(eps),
                float(plan.n), int(bool(use_global_est)), dsp, dbp, coef, yp, bits)
    if dx is not None:
        grad_dx(x, xp, dyp, dx, channels, plan.post, coef, use_global_est, yp, bits,
                plan.width.bit_length() - 1)
    return dx, dscale, dbias


class _GradPlan:
    """backward's geometry and launches for one device, x shape, dtype, layout,
    alignment of x and dy (and y) and whether dy is masked by y (batch_norm_relu)."""

    def __init__(self, x, layout, aligned, masked):
        self.pre, self.channels, self.post = bn.geometry(x, layout)
        self.n = self.pre * self.post
        reduce, self.reduce = bn.reduce_plan("bn_grad", x, aligned, self.pre, self.channels,
                                             self.post)
        self.split_args, self.tickets = reduce.split_args, reduce.tickets
        self.width = reduce.width
        self.partials = 2 * self.channels * reduce.splits
        self.resident = bn_resident.cached_plan(x, self.pre, self.channels, self.post, aligned,
                                                3 if masked else 2)
