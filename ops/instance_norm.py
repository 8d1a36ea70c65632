"""instance_norm and tracked_instance_norm: each channel of each sample normalised over
its spatial positions (torch.nn.InstanceNorm1d/2d/3d).

instance_norm(x, scale, bias; epsilon, data_layout): group_norm with a group per
channel (ops/group_norm.py has the formulas, the gradient and the export); no
running estimates, not mode-dependent.

tracked_instance_norm(x, scale, bias, estimated_mean, estimated_var, num_batches;
is_infer, epsilon, momentum, first_batch_sets_estimates, data_layout): PyTorch's
track_running_stats=True, mode-dependent like batch_norm (a net forks at it):
  training:  y as instance_norm's, and the per-channel running estimates follow the
             batch: with mean[n, c], var[n, c] the instances' statistics over S
             spatial values, the batch's mean is mean over n of mean[n, c] and its
             variance the mean over n of the unbiased var[n, c] * S / (S - 1)
             (PyTorch's rule); they update the estimates as batch_norm's do (the
             first-batch rule unless first_batch_sets_estimates=False, momentum
             weighting the OLD estimate, None the cumulative average), and the
             counter goes up by one. S == 1 is an error; an empty batch writes
             nothing. The outputs `mean` and `variance` (N, C) are the instances'.
  is_infer:  y = (x - estimated_mean) / sqrt(estimated_var + epsilon) * scale + bias
             per channel; `mean` and `variance` are the estimates for every sample;
             nothing is written.
The in-place pairs are batch_norm's (saved_mean, saved_var, saved_num_batches).
Its gradient (training) is instance_norm_grad. In ONNX (inference) it is
BatchNormalization on the estimates, as an inference batch_norm.
Kernels: kernels/cpu/instance_norm.py, kernels/cuda/norm.py.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cpu import group_norm as cpu_group
from minigraph.kernels.cpu import instance_norm as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import norm_op as cuda
from minigraph.ops.batch_norm import export_batch_norm, momentum_range
from minigraph.ops.group_norm import (
    EPSILON,
    LAYOUT,
    export_instance_norm,
    layout_channels,
    register_norm,
)
from minigraph.schema import Meta, OpDesc, OpError, OpSchema, Slot, examples, kernel, register
from minigraph.validators import (
    bool_attr,
    check_float,
    check_rank,
    check_same_dtype,
    check_shape,
    fail,
    float_attr,
)

register_norm("instance_norm", (EPSILON, LAYOUT),
              lambda x, attrs: layout_channels(x, attrs.get("data_layout", "NCHW"))[0],
              export_instance_norm, doc=__doc__)
kernel("instance_norm", "cpu", cpu_group.instance_norm_cpu)
kernel("instance_norm_grad", "cpu", cpu_group.instance_norm_grad_cpu)
kernel("instance_norm", "gpu", cuda.instance_norm_gpu, dtypes=GPU_FLOATS)
kernel("instance_norm_grad", "gpu", cuda.instance_norm_grad_gpu, dtypes=GPU_FLOATS)

TRACKED = "tracked_instance_norm"


def infer_tracked(ins, attrs):
    """x (N, C, *) or (N, *, C) of rank 3 to 5, float; scale, bias and the estimates
    (C,) of x's dtype; the counter an int64 scalar. y is x's shape, mean and variance
    (N, C)."""
    x = ins["x"]
    check_rank(TRACKED, "x", x, (3, 4, 5))
    check_float(TRACKED, "x", x)
    layout = attrs["data_layout"]
    c, _ = layout_channels(x, layout)
    for slot in ("scale", "bias", "estimated_mean", "estimated_var"):
        if ins.get(slot) is not None:
            check_shape(TRACKED, slot, ins[slot], (c,),
                        f" (one value per channel of input 'x' with shape {x.shape}, {layout})")
            check_same_dtype(TRACKED, slot, ins[slot], "x", x)
    nb = ins.get("num_batches")
    if nb is not None and (nb.shape != () or nb.dtype != np.int64):
        fail(TRACKED, "num_batches", f"must be an int64 scalar (shape ()), got {nb.dtype} of "
                                     f"shape {nb.shape}")
    stat = Meta((x.shape[0], c), x.dtype)
    return {"y": Meta(x.shape, x.dtype), "mean": stat, "variance": stat}


def validate_tracked(op):
    """momentum=None (the cumulative average) needs the counter."""
    if op.attrs["momentum"] is None and op.inputs["num_batches"] is None:
        raise OpError(f"{TRACKED}: momentum=None (cumulative average) needs the "
                      "'num_batches' counter input")


def grad_tracked(op, dout, make_grad):
    """Training: instance_norm_grad on the instances' statistics. The inference copy
    has no gradient (backward is built on the train branch)."""
    dy = dout.get("y")
    if dy is None:
        return []
    if op.attrs["is_infer"]:
        raise OpError(f"{TRACKED}: the inference copy has no gradient; gradients come from "
                      "the train branch")
    made = {"dx": make_grad(op.inputs["x"])}
    for slot in ("scale", "bias"):
        if op.inputs[slot] is not None:
            made["d" + slot] = make_grad(op.inputs[slot])
    return [OpDesc("instance_norm_grad", dict(
        x=op.inputs["x"], scale=op.inputs["scale"], mean=op.outputs["mean"],
        variance=op.outputs["variance"], dy=dy, epsilon=op.attrs["epsilon"],
        data_layout=op.attrs["data_layout"], **made))]


register(OpSchema(
    type=TRACKED,
    inputs=(Slot("x"), Slot("scale", optional=True), Slot("bias", optional=True),
            Slot("estimated_mean"), Slot("estimated_var"), Slot("num_batches", optional=True)),
    outputs=(Slot("y"), Slot("mean"), Slot("variance"), Slot("saved_mean", optional=True),
             Slot("saved_var", optional=True), Slot("saved_num_batches", optional=True)),
    attrs=(bool_attr("is_infer", False), EPSILON,
           float_attr("momentum", 0.9, momentum_range, nullable=True),
           bool_attr("first_batch_sets_estimates", True), LAYOUT),
    inplace={"saved_mean": "estimated_mean", "saved_var": "estimated_var",
             "saved_num_batches": "num_batches"},
    mode_attr="is_infer", infer=infer_tracked, validate=validate_tracked, grad=grad_tracked,
    export=export_batch_norm, doc=__doc__))
kernel(TRACKED, "cpu", cpu.tracked_instance_norm_cpu)
kernel(TRACKED, "gpu", cuda.tracked_instance_norm_gpu, dtypes=GPU_FLOATS)


# ---- examples ---------------------------------------------------------------------

def instance_norm_examples(ex):
    """Cases the device tests run on every place against the CPU."""
    grads = (("x", "scale", "bias"), ("x",))
    return [
        ("f32", {"x": ex.r(2, 3, 7, 5) - 3, "scale": ex.r(3, seed=1), "bias": ex.r(3, seed=2)},
         {}, grads),
        ("one-sample-f64", {"x": ex.r(1, 5, 11, dtype=np.float64)}, dict(epsilon=1e-3),
         (("x",),)),
        ("nhwc-rank5-f32", {"x": ex.r(2, 3, 2, 4, 5) + 1, "scale": ex.r(5, seed=1)},
         dict(data_layout="NHWC"), (("x", "scale"),)),
        ("eps0-f64", {"x": ex.r(3, 4, 6, dtype=np.float64), "bias": ex.r(4, seed=2,
                                                                        dtype=np.float64)},
         dict(epsilon=0.0), (("x", "bias"),)),
    ]


def tracked_examples(ex):
    """Cases the device tests run on every place against the CPU (the estimates and
    the counter are updated in place)."""
    def ins(x, c, counter=0, dt=np.float32):
        return {"x": x, "scale": ex.r(c, dtype=dt, seed=1) + 1, "bias": ex.r(c, dtype=dt, seed=2),
                "estimated_mean": ex.r(c, dtype=dt, seed=3),
                "estimated_var": ex.r(c, dtype=dt, seed=4) ** 2 + 0.5,
                "num_batches": np.array(counter, np.int64)}

    grads = (("x", "scale", "bias"), ("x",))
    return [
        ("train-f32", ins(ex.r(3, 4, 5, 6), 4), {}, grads),
        ("train-torch-rule-nhwc-f64", ins(ex.r(2, 5, 3, 6, dtype=np.float64), 6, 2, np.float64),
         dict(first_batch_sets_estimates=False, momentum=0.7, data_layout="NHWC"), grads),
        ("train-cumulative-f32", ins(ex.r(4, 3, 9), 3, 3), dict(momentum=None), grads),
        ("infer-f32", ins(ex.r(2, 3, 4, 4), 3), dict(is_infer=True), ()),
        ("infer-nhwc-eps0-f64", ins(ex.r(2, 4, 1, 3, dtype=np.float64), 3, 0, np.float64),
         dict(is_infer=True, epsilon=0.0, data_layout="NHWC"), ()),
        ("empty-f32", ins(ex.r(0, 3, 4), 3, 5), {}, ()),
    ]


examples("instance_norm", instance_norm_examples)
examples(TRACKED, tracked_examples)
