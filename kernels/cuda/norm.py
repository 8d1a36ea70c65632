"""Launchers for kernels/cuda/norm.cu (channels first; norm_nhwc.py/.cu have the
channels-last ones and instance norm's running estimates, norm_op.py the op kernels).

Each op sees x (C-contiguous) as rows of contiguous values: layer_norm's
prod(shape[:begin_norm_axis]) rows of L = prod(shape[begin_norm_axis:]),
group_norm's N * groups rows of C / groups * S (instance_norm: groups = C). The
scale and bias of element e are indexed (e // post) % A: layer_norm post 1, A = L;
group_norm post S, A = C. Nothing is copied to the host.

  forward   2 launches: the row statistics (Welford in double, a long row split
            over several blocks merged by its last one), then the elementwise y.
  backward  the row sums of g and g (x - mean) (layer_norm: g = dy * scale per
            position; group_norm: per (sample, channel) plane of dy), a finish
            kernel (the dx coefficients; group_norm's dscale and dbias summed over
            samples), the elementwise dx; layer_norm's dscale and dbias come from a
            column reduction over the rows. Only the outputs asked for are computed.

Every sum is in double and in a fixed order (no atomics): results are deterministic.
Temporaries (coefficients, sums, split partials) live in the device's scratch.
"""
from __future__ import annotations

import math

import numpy as np

from minigraph.kernels.cuda import launch, loader

MODULE = "norm"
SIGNATURES = {}
for _t, _ws in (("f32", (1, 4)), ("f64", (1, 2))):
    for _w in _ws:
        SIGNATURES.update({
            f"norm_stats_{_t}_w{_w}": "PqqqiPPPPdP",
            f"norm_apply_{_t}_w{_w}": "PPqqqqPPP",
            f"norm_grad_sums_{_t}_w{_w}": "PPPPqqqqiPPP",
            f"norm_grad_dx_{_t}_w{_w}": "PPPqqqqPPP",
            f"norm_column_sums_{_t}_w{_w}": "PPqqqiPPPPPP",
        })
    SIGNATURES[f"norm_grad_finish_{_t}"] = "PPPdPqqqqdPPP"


def _width(dtype, length, *pointers):
    """The pack width for rows of `length` values: 16-byte packs when every pointer
    is aligned and a row holds whole packs (so every row starts aligned), else 1."""
    w = launch.vector_width(np.dtype(dtype).itemsize)
    return w if length % w == 0 and launch.is_aligned(*pointers) else 1


def _row_reduction(stem, dtype, rows, units, width):
    """(chunk, splits, prepared launch) of a row reduction of `rows` rows of `units`
    packs: one block per row (a grid-stride loop over rows), or, when there are too
    few rows to fill the device, each row split over `splits` blocks (grid (rows,
    splits)) chosen for whole waves (launch.best_splits). Memoised per device."""
    plans = loader.cached("norm.rows", dict)
    key = (stem, np.dtype(dtype), rows, units, width, launch.tunables())
    found = plans.get(key)
    if found is None:
        name = f"{stem}_{loader.suffix(dtype)}_w{width}"
        k = loader.kernel(MODULE, name, SIGNATURES[name])
        dev = loader.device()
        threads = launch.row_block_threads(units, dev)
        hi = min(units // (threads * launch.MIN_UNITS_PER_THREAD), launch.MAX_SPLITS,
                 dev.max_grid[1])
        splits = 1
        if hi > 1 and rows <= dev.max_grid[0]:
            resident = dev.sm_count * launch.blocks_per_sm(dev, threads, k.resources)
            splits = launch.best_splits(rows, resident, 1, hi)
        chunk = -(-units // splits)
        splits = -(-units // chunk)
        gx = rows if splits > 1 else launch.rows_grid(rows, threads, dev, k.resources)
        found = loader.cache_put(plans, key, (chunk, splits,
                                              k.prepared((gx, splits, 1), (threads, 1, 1))))
    return found


def _flat(name, items):
    return loader.flat_go(MODULE, name, SIGNATURES[name], items)


def _param(what, slot, a, size, dtype):
    """The device pointer of optional parameter `a` (0 for None), checked to be
    C-contiguous `dtype` of shape (size,)."""
    if a is None:
        return 0
    launch.check_array(f"{what}: {slot}", a, (size,), dtype)
    return loader.ptr(a, f"{what}: {slot}")


def _scratch(doubles, values, dtype):
    """(address of `doubles` float64 words, address of `values` of dtype after them)."""
    base = loader.scratch(doubles + -(-values * np.dtype(dtype).itemsize // 8), np.float64)
    return base, base + 8 * doubles


def _forward(what, x, scale, bias, rows, length, post, affine, eps, stat_shape):
    """(y, mean, variance) of x as `rows` rows of `length` values, the affine
    parameters (`affine` values each, or None) of element e at (e // post) % affine."""
    xp = loader.ptr(x, f"{what}: x")
    sp = _param(what, "scale", scale, affine, x.dtype)
    bp = _param(what, "bias", bias, affine, x.dtype)
    y = loader.empty(x.shape, x.dtype)
    mean, var = loader.empty_group((stat_shape, stat_shape), x.dtype)
    if rows == 0:
        return y, mean, var
    if length == 0:                        # no values: the CPU's zero statistics
        from minigraph.kernels.cuda import fill

        fill.fill_constant(mean, 0)
        fill.fill_constant(var, 0)
        return y, mean, var
    yp, sfx = loader.address(y), loader.suffix(x.dtype)
    w = _width(x.dtype, length, xp)
    chunk, splits, stats = _row_reduction("norm_stats", x.dtype, rows, length // w, w)
    tickets = loader.address(loader.tickets(rows if splits > 1 else 1))
    partial, coef = _scratch(3 * rows * splits if splits > 1 else 0, 3 * rows, x.dtype)
    stats(xp, rows, length // w, chunk, splits, partial, tickets, loader.address(mean),
          loader.address(var), float(eps), coef)
    w = _width(x.dtype, length, xp, yp)
    _flat(f"norm_apply_{sfx}_w{w}", x.size // w)(xp, yp, rows, length, post, affine, coef, sp, bp)
    return y, mean, var


def _grad_outputs(x, size, need_dx, need_dscale, need_dbias):
    dx = loader.empty(x.shape, x.dtype) if need_dx else None
    if need_dscale and need_dbias:
        return (dx, *loader.empty_group(((size,), (size,)), x.dtype))
    return (dx, loader.empty((size,), x.dtype) if need_dscale else None,
            loader.empty((size,), x.dtype) if need_dbias else None)


def _check_grad(what, x, mean, var, dy, stat_shape):
    """The device pointers of x, mean, var and dy, after checking them."""
    launch.check_array(f"{what}: dy", dy, x.shape, x.dtype)
    launch.check_array(f"{what}: mean", mean, stat_shape, x.dtype)
    launch.check_array(f"{what}: variance", var, stat_shape, x.dtype)
    return (loader.ptr(x, f"{what}: x"), loader.ptr(mean), loader.ptr(var), loader.ptr(dy))


def _zero_empty(x, *outs):
    """True (after zeroing the parameter gradients) when x holds no values."""
    if x.size:
        return False
    from minigraph.kernels.cuda import fill

    for a in outs:
        if a is not None and a.size:
            fill.fill_constant(a, 0)
    return True


# ---- layer_norm -------------------------------------------------------------------

def rows_of(what, shape, begin):
    """(R, L): the rows and the row length of `shape` normalised from axis `begin`."""
    shape = tuple(int(d) for d in shape)
    if not 1 <= begin < len(shape):
        raise ValueError(f"{what}: begin_norm_axis {begin} must be in [1, {len(shape)}) for "
                         f"x of shape {shape}")
    return math.prod(shape[:begin]), math.prod(shape[begin:])


def layer_norm(x, scale=None, bias=None, begin_norm_axis=1, epsilon=1e-5):
    """(y, mean, variance) of x normalised over its axes from begin_norm_axis: y = (x -
    mean) / sqrt(variance + epsilon) * scale + bias, scale and bias (optional) of L
    values; mean and the biased variance of shape x.shape[:begin_norm_axis]."""
    rows, length = rows_of("layer_norm", x.shape, begin_norm_axis)
    return _forward("layer_norm", x, scale, bias, rows, length, 1, length, epsilon,
                    tuple(x.shape[:begin_norm_axis]))


def layer_norm_grad(x, scale, mean, variance, dy, begin_norm_axis=1, epsilon=1e-5,
                    need_dx=True, need_dscale=True, need_dbias=True):
    """(dx, dscale, dbias) of layer_norm (None for those not needed), from the
    forward's mean and variance: with xhat = (x - mean) invstd and g = dy * scale,
    dx = invstd (g - mean_row(g) - xhat mean_row(g xhat)), dscale = sum over rows of
    dy xhat, dbias = sum over rows of dy."""
    what = "layer_norm_grad"
    rows, length = rows_of(what, x.shape, begin_norm_axis)
    xp, mp, vp, dyp = _check_grad(what, x, mean, variance, dy, tuple(x.shape[:begin_norm_axis]))
    sp = _param(what, "scale", scale, length, x.dtype)
    dx, dscale, dbias = _grad_outputs(x, length, need_dx, need_dscale, need_dbias)
    if _zero_empty(x, dscale, dbias) or not (need_dx or need_dscale or need_dbias):
        return dx, dscale, dbias
    dev, sfx = loader.device(), loader.suffix(x.dtype)
    w = _width(x.dtype, length, xp, dyp)
    chunk, splits, sums_go = _row_reduction("norm_grad_sums", x.dtype, rows, length // w, w)
    cols = need_dscale or need_dbias
    plan = launch.reduce_plan(rows, length, 1, x.dtype.itemsize, launch.is_aligned(xp, dyp),
                              dev) if cols else None
    words = (2 * rows + 2 * rows * splits) if need_dx else 0
    col_words = 2 * length * plan.splits if cols else 0
    sums, coef = _scratch(words + col_words, 3 * rows, x.dtype)
    tickets = loader.address(loader.tickets(max(rows if splits > 1 else 1,
                                                plan.tickets if cols else 1)))
    if need_dx:
        sums_go(xp, dyp, sp, mp, rows, length // w, 1, chunk, splits, sums + 16 * rows, tickets,
                sums)
    _flat(f"norm_grad_finish_{sfx}", rows)(sums if need_dx else 0, mp, vp, float(epsilon), 0,
                                           rows, 1, 0, 0, float(length), 0, 0, coef)
    if need_dx:
        dxp = loader.address(dx)
        w = _width(x.dtype, length, xp, dyp, dxp)
        _flat(f"norm_grad_dx_{sfx}_w{w}", x.size // w)(xp, dyp, dxp, rows, length, 1, length, mp,
                                                       coef, sp)
    if cols:
        name = f"norm_column_sums_{sfx}_w{plan.width}"
        go = loader.kernel(MODULE, name, SIGNATURES[name]).prepared(plan.grid, plan.block)
        go(xp, dyp, rows, length, *plan.split_args, sums + 8 * words, tickets, mp, coef,
           loader.address(dscale), loader.address(dbias))
    return dx, dscale, dbias


# ---- group_norm -------------------------------------------------------------------

def group_shape(what, shape, groups):
    """(N, C, S): samples, channels and spatial size of x (N, C, *), checked against
    `groups`."""
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        raise ValueError(f"{what}: x must be (N, C, ...), got shape {shape}")
    n, c, s = shape[0], shape[1], math.prod(shape[2:])
    if groups < 1 or c % groups:
        raise ValueError(f"{what}: groups {groups} must divide the {c} channels of x {shape}")
    return n, c, s


def group_norm(x, scale=None, bias=None, groups=1, epsilon=1e-5):
    """(y, mean, variance) of x (N, C, *) normalised over each sample's groups of C /
    groups channels: y = (x - mean) / sqrt(variance + epsilon) * scale[c] + bias[c];
    mean and the biased variance of shape (N, groups)."""
    n, c, s = group_shape("group_norm", x.shape, groups)
    return _forward("group_norm", x, scale, bias, n * groups, c // groups * s, s, c, epsilon,
                    (n, groups))


def group_norm_grad(x, scale, mean, variance, dy, groups=1, epsilon=1e-5, need_dx=True,
                    need_dscale=True, need_dbias=True):
    """(dx, dscale, dbias) of group_norm (None for those not needed): dx as
    layer_norm_grad's over each group, dscale[c] = sum over samples and positions
    of dy xhat, dbias[c] = sum of dy."""
    what = "group_norm_grad"
    n, c, s = group_shape(what, x.shape, groups)
    xp, mp, vp, dyp = _check_grad(what, x, mean, variance, dy, (n, groups))
    sp = _param(what, "scale", scale, c, x.dtype)
    dx, dscale, dbias = _grad_outputs(x, c, need_dx, need_dscale, need_dbias)
    if _zero_empty(x, dscale, dbias) or not (need_dx or need_dscale or need_dbias):
        return dx, dscale, dbias
    sfx, planes, cg = loader.suffix(x.dtype), n * c, c // groups
    w = _width(x.dtype, s, xp, dyp)
    chunk, splits, sums_go = _row_reduction("norm_grad_sums", x.dtype, planes, s // w, w)
    words = 2 * planes + (2 * planes * splits if splits > 1 else 0)
    sums, coef = _scratch(words, 3 * n * groups, x.dtype)
    tickets = loader.address(loader.tickets(planes if splits > 1 else 1))
    sums_go(xp, dyp, 0, mp, planes, s // w, cg, chunk, splits, sums + 16 * planes, tickets, sums)
    dsp, dbp = loader.address(dscale), loader.address(dbias)
    _flat(f"norm_grad_finish_{sfx}", max(n * groups, c if dsp or dbp else 0))(
        sums, mp, vp, float(epsilon), sp, n * groups, cg, c, n, float(cg * s), dsp, dbp, coef)
    if need_dx:
        dxp = loader.address(dx)
        w = _width(x.dtype, cg * s, xp, dyp, dxp)
        _flat(f"norm_grad_dx_{sfx}_w{w}", x.size // w)(xp, dyp, dxp, n * groups, cg * s, s, c,
                                                       mp, coef, sp)
    return dx, dscale, dbias
