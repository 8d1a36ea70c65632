"""Launchers for kernels/cuda/norm_nhwc.cu: group_norm and instance_norm of
channels-last x (N, *spatial, C), and instance norm's running estimates.

  forward   3 launches: per-(sample, channel) Welford statistics over the spatial
            positions (a column reduction of each sample's (S, C) matrix, 2-D
            blocks reading whole rows of adjacent channels), one thread per (sample,
            group) merging its channels (Chan) into mean, variance and the
            normalisation coefficients, then the elementwise y.
  backward  the per-(sample, channel) sums of dy and dy (x - mean) (the same column
            reduction), norm.cu's norm_grad_finish (the dx coefficients, dscale and
            dbias summed over samples in order), the elementwise dx.
  estimates one thread per channel: the batch's mean and variance from the
            instances' (PyTorch's rule), blended into candidate estimates (the
            rule word of batch_norm.estimate_rule); a second launch commits them
            and the counter unless a value was not finite (then the guard's status
            records the batch; nothing is written).

Sums are in double and in a fixed order: results are deterministic. Nothing is
copied to the host.
"""
from __future__ import annotations

import math

from minigraph.kernels.cuda import loader, norm
from minigraph.kernels.cuda.batch_norm import estimate_rule
from minigraph.kernels.cuda.norm import _check_grad, _grad_outputs, _param, _scratch, _zero_empty

MODULE = "norm_nhwc"
SIGNATURES = {}
for _t in ("f32", "f64"):
    SIGNATURES.update({
        f"norm_cl_stats_{_t}": "PqqqP",
        f"norm_cl_finish_{_t}": "PqqqdPPP",
        f"norm_cl_apply_{_t}": "PPqqqqqPPP",
        f"norm_cl_grad_sums_{_t}": "PPPqqqqP",
        f"norm_cl_grad_dx_{_t}": "PPPqqqqqPPP",
        f"norm_estimates_{_t}": "PPqqqPPPdiPPI",
        f"norm_estimates_commit_{_t}": "qPPPPPI",
    })

TX, TY = 32, 8                    # the column reductions' blocks: 32 channels x 8 rows
MAX_GRID_Y = 65535


def sizes(what, shape, groups):
    """(N, C, S) of x (N, *spatial, C), checked against `groups`."""
    shape = tuple(int(d) for d in shape)
    if len(shape) < 2:
        raise ValueError(f"{what}: x must be (N, ..., C), got shape {shape}")
    n, c, s = shape[0], shape[-1], math.prod(shape[1:-1])
    if groups < 1 or c % groups:
        raise ValueError(f"{what}: groups {groups} must divide the {c} channels of x {shape}")
    return n, c, s


def _flat(name, items):
    return loader.flat_go(MODULE, name, SIGNATURES[name], items)


def _columns(name, x, n, c):
    """The prepared launch of column reduction `name` over n samples of c channels."""
    k = loader.kernel(MODULE, name, SIGNATURES[name])
    return k.prepared((-(-c // TX), min(n, MAX_GRID_Y), 1), (TX, TY, 1))


def group_norm_nhwc(x, scale=None, bias=None, groups=1, epsilon=1e-5):
    """(y, mean, variance) of x (N, *spatial, C) normalised over each sample's groups of
    C / groups channels and their positions; mean and the biased variance (N, groups)."""
    what = "group_norm"
    n, c, s = sizes(what, x.shape, groups)
    xp = loader.ptr(x, f"{what}: x")
    sp = _param(what, "scale", scale, c, x.dtype)
    bp = _param(what, "bias", bias, c, x.dtype)
    y = loader.empty(x.shape, x.dtype)
    mean, var = loader.empty_group(((n, groups), (n, groups)), x.dtype)
    if n == 0:
        return y, mean, var
    if s == 0:                             # no values: the CPU's zero statistics
        from minigraph.kernels.cuda import fill

        fill.fill_constant(mean, 0)
        fill.fill_constant(var, 0)
        return y, mean, var
    rows, cg, sfx = n * groups, c // groups, loader.suffix(x.dtype)
    cstats, coef = _scratch(2 * n * c, 3 * rows, x.dtype)
    _columns(f"norm_cl_stats_{sfx}", x, n, c)(xp, n, s, c, cstats)
    _flat(f"norm_cl_finish_{sfx}", rows)(cstats, rows, cg, s, float(epsilon),
                                         loader.address(mean), loader.address(var), coef)
    _flat(f"norm_cl_apply_{sfx}", x.size)(xp, loader.address(y), x.size, s, c, cg, rows, coef,
                                          sp, bp)
    return y, mean, var


def group_norm_nhwc_grad(x, scale, mean, variance, dy, groups=1, epsilon=1e-5, need_dx=True,
                         need_dscale=True, need_dbias=True):
    """(dx, dscale, dbias) of group_norm_nhwc (None for those not needed), as
    norm.group_norm_grad's for channels-last x."""
    what = "group_norm_grad"
    n, c, s = sizes(what, x.shape, groups)
    xp, mp, vp, dyp = _check_grad(what, x, mean, variance, dy, (n, groups))
    sp = _param(what, "scale", scale, c, x.dtype)
    dx, dscale, dbias = _grad_outputs(x, c, need_dx, need_dscale, need_dbias)
    if _zero_empty(x, dscale, dbias) or not (need_dx or need_dscale or need_dbias):
        return dx, dscale, dbias
    rows, cg, sfx = n * groups, c // groups, loader.suffix(x.dtype)
    sums, coef = _scratch(2 * n * c, 3 * rows, x.dtype)
    _columns(f"norm_cl_grad_sums_{sfx}", x, n, c)(xp, dyp, mp, n, s, c, cg, sums)
    dsp, dbp = loader.address(dscale), loader.address(dbias)
    norm._flat(f"norm_grad_finish_{sfx}", max(rows, c if dsp or dbp else 0))(
        sums, mp, vp, float(epsilon), sp, rows, cg, c, n, float(cg * s), dsp, dbp, coef)
    if need_dx:
        _flat(f"norm_cl_grad_dx_{sfx}", x.size)(xp, dyp, loader.address(dx), x.size, s, c, cg,
                                                rows, mp, coef, sp)
    return dx, dscale, dbias


def update_estimates(mean, variance, spatial, est_mean, est_var, counter, momentum, guard,
                     first_batch=True):
    """Instance norm's running estimates after a training batch, in place: from the
    instances' mean and biased variance (N, C) over `spatial` values each, the batch's
    mean (of the means) and variance (of the unbiased variances) blended into
    est_mean and est_var (C,) as batch norm's (momentum weighting the old estimate,
    None the cumulative average; the first batch sets them unless first_batch is
    False); the int64 counter (or None) goes up by one. A non-finite value leaves
    everything as it was and is recorded in `guard` (a batch_norm.Guard)."""
    n, c = (int(d) for d in mean.shape)
    if n == 0:
        return
    if counter is None and momentum is None:
        raise ValueError("tracked_instance_norm: momentum=None (cumulative average) needs the "
                         "counter")
    sfx = loader.suffix(mean.dtype)
    newest = loader.scratch(2 * c, mean.dtype)
    epoch = guard.next_epoch()
    cp = 0 if counter is None else loader.ptr(counter, "tracked_instance_norm: counter")
    emp = loader.ptr(est_mean, "tracked_instance_norm: estimated_mean")
    evp = loader.ptr(est_var, "tracked_instance_norm: estimated_var")
    _flat(f"norm_estimates_{sfx}", c)(
        loader.address(mean), loader.address(variance), n, c, int(spatial), emp, evp, cp,
        0.0 if momentum is None else float(momentum), estimate_rule(momentum, first_batch),
        newest, guard.address, epoch)
    _flat(f"norm_estimates_commit_{sfx}", c)(c, newest, emp, evp, cp, guard.address, epoch)
