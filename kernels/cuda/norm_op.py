"""GPU kernels of layer_norm, group_norm, instance_norm and tracked_instance_norm
(ops/layer_norm.py, ops/group_norm.py, ops/instance_norm.py): the launchers of norm.py
(channels first) and norm_nhwc.py (channels last, running estimates) on device
arrays.

Nothing is copied to the host, with two exceptions that only epsilon 0 pays: the
variances are read back to raise the CPU's error for a zero one. A training batch of
tracked_instance_norm with non-finite statistics leaves the estimates and the counter
as they were; the error (an OpError, as on the CPU) is raised at the next fetch.
"""
from __future__ import annotations

import math

from minigraph import device
from minigraph.kernels import present
from minigraph.kernels.cpu.group_norm import check_group_values, check_variance
from minigraph.kernels.cpu.layer_norm import check_rows
from minigraph.kernels.cuda import batch_norm as gpu_bn
from minigraph.kernels.cuda import broadcast, fill, norm, norm_nhwc
from minigraph.kernels.cuda.batch_norm_op import affine, gpu_guard
from minigraph.schema import OpError


def _needs(op):
    return dict(need_dx=op.wants("dx"), need_dscale=op.wants("dscale"),
                need_dbias=op.wants("dbias"))


def layer_norm_gpu(op, ins, ctx):
    """y, mean and variance of layer_norm on the device."""
    a = op.attrs
    y, mean, var = norm.layer_norm(ins["x"], ins.get("scale"), ins.get("bias"),
                                   a["begin_norm_axis"], a["epsilon"])
    if a["epsilon"] == 0:
        check_rows(op, device.to_host(var), 0.0)
    return {"y": y, "mean": mean, "variance": var}


def layer_norm_grad_gpu(op, ins, ctx):
    """dx, dscale and dbias of layer_norm (those bound) on the device."""
    a = op.attrs
    dx, dscale, dbias = norm.layer_norm_grad(ins["x"], ins.get("scale"), ins["mean"],
                                             ins["variance"], ins["dy"], a["begin_norm_axis"],
                                             a["epsilon"], **_needs(op))
    return present(dx=dx, dscale=dscale, dbias=dbias)


def _groups_forward(op, ins, groups):
    x, a = ins["x"], op.attrs
    run = norm.group_norm if a["data_layout"] == "NCHW" else norm_nhwc.group_norm_nhwc
    y, mean, var = run(x, ins.get("scale"), ins.get("bias"), groups, a["epsilon"])
    if a["epsilon"] == 0:
        check_variance(op.type, device.to_host(var), 0.0, per_channel=op.type != "group_norm")
    return y, mean, var


def _groups_backward(op, ins, groups):
    a = op.attrs
    run = norm.group_norm_grad if a["data_layout"] == "NCHW" else norm_nhwc.group_norm_nhwc_grad
    dx, dscale, dbias = run(ins["x"], ins.get("scale"), ins["mean"], ins["variance"], ins["dy"],
                            groups, a["epsilon"], **_needs(op))
    return present(dx=dx, dscale=dscale, dbias=dbias)


def _channels(x, layout):
    return int(x.shape[1] if layout == "NCHW" else x.shape[-1])


def _spatial(x, layout):
    return math.prod(x.shape[2:] if layout == "NCHW" else x.shape[1:-1])


def group_norm_gpu(op, ins, ctx):
    """y, mean and variance of group_norm on the device."""
    a = op.attrs
    check_group_values(op, ins["x"], a["groups"], a["data_layout"])
    y, mean, var = _groups_forward(op, ins, a["groups"])
    return {"y": y, "mean": mean, "variance": var}


def group_norm_grad_gpu(op, ins, ctx):
    """dx, dscale and dbias of group_norm (those bound) on the device."""
    return _groups_backward(op, ins, op.attrs["groups"])


def instance_norm_gpu(op, ins, ctx):
    """group_norm with a group per channel, on the device."""
    y, mean, var = _groups_forward(op, ins, _channels(ins["x"], op.attrs["data_layout"]))
    return {"y": y, "mean": mean, "variance": var}


def instance_norm_grad_gpu(op, ins, ctx):
    """group_norm_grad with a group per channel, on the device."""
    return _groups_backward(op, ins, _channels(ins["x"], op.attrs["data_layout"]))


def _tracked_infer(op, ins):
    """y from the estimates (batch norm's inference kernel); mean and variance: the
    estimates for every sample."""
    x, a = ins["x"], op.attrs
    layout, eps = a["data_layout"], a["epsilon"]
    est_mean, est_var = ins["estimated_mean"], ins["estimated_var"]
    if eps == 0:
        host = device.to_host(est_var)
        if (host == 0).any():
            raise OpError(f"{op.type}: epsilon is 0 and the estimated variance of channel "
                          f"{int((host == 0).argmax())} is 0: nothing to divide by; use "
                          "epsilon > 0")
    scale, bias = affine(ins, x, layout)
    y = gpu_bn.forward_infer(x, scale, bias, est_mean, est_var, eps, layout)
    n, c = int(x.shape[0]), _channels(x, layout)
    zeros = fill.full((n, c), 0.0, x.dtype)
    return {"y": y, "mean": broadcast.add(zeros, est_mean),
            "variance": broadcast.add(zeros, est_var)}


def tracked_instance_norm_gpu(op, ins, ctx):
    """Training: y and the instances' statistics (instance_norm's kernels), then the
    estimates and the counter updated on the device; inference: y from the estimates."""
    x, a = ins["x"], op.attrs
    est_mean, est_var, counter = (ins["estimated_mean"], ins["estimated_var"],
                                  ins.get("num_batches"))
    out = {"saved_mean": est_mean, "saved_var": est_var, "saved_num_batches": counter}
    if a["is_infer"]:
        return present(**out, **_tracked_infer(op, ins))
    layout = a["data_layout"]
    c, spatial = _channels(x, layout), _spatial(x, layout)
    if spatial == 1:
        raise OpError(f"{op.type}: training needs more than one spatial value per channel, "
                      f"got input 'x' of shape {tuple(x.shape)} ({layout}); inference uses the "
                      "running estimates and takes it")
    y, mean, var = _groups_forward(op, ins, c)
    norm_nhwc.update_estimates(mean, var, spatial, est_mean, est_var, counter, a["momentum"],
                               gpu_guard(op.type), a["first_batch_sets_estimates"])
    return present(**out, y=y, mean=mean, variance=var)
