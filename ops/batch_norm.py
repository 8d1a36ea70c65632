"""batch_norm: the op's schema, shape checks, grad maker, exporter and kernels.

Semantics (n = values per channel in the batch):
  training:        y = (x - batch_mean) / sqrt(batch_var + eps) * scale + bias,
                   batch_var biased; the estimates take the unbiased variance.
                   First batch (counter 0, first_batch_sets_estimates=True, the
                   default): est = batch. Otherwise
                   est = momentum * est + (1 - momentum) * batch (with
                   first_batch_sets_estimates=False from the first batch on:
                   PyTorch's _NormBase), or, with momentum=None,
                   est += (batch - est) / k for the k-th batch.
                   n == 1 is an error; an empty batch (n == 0) gives an empty y
                   and writes nothing (batch_mean/batch_var: the estimates, or
                   zeros without them).
  use_global_est:  normalise with the estimates; nothing is updated.
  is_infer:        likewise; nothing persistable is written.
`saved_*` outputs are the `estimated_*` / `num_batches` Variables themselves,
updated in place, and never with NaN or Inf. minigraph's `saved_mean`/`saved_var`
are these in-place running estimates (Paddle's `MeanOut`/`VarianceOut`), the
reverse of Paddle's `SavedMean`/`SavedVariance`, which are batch statistics
(ours are `batch_mean`/`batch_var`).
Optional parts (PyTorch's _NormBase options): without scale (bias) y is not
scaled (shifted) - affine=False binds neither, PyTorch's bias=False only the
scale; without the estimates, their in-place outputs and the counter
(track_running_stats=False) both modes normalise with the batch's statistics and
nothing persistable is written.

docs/batch_norm.md explains the names and the momentum convention.
Kernels: kernels/cpu/batch_norm.py (on the stable statistics of
kernels/cpu/batch_norm_stats.py) and kernels/cuda/batch_norm_op.py; sync_batch_norm
shares the schema and the kernels' drivers. In ONNX an inference batch norm is
BatchNormalization on the estimates.
"""
from __future__ import annotations

import numpy as np

from minigraph.io import onnx_export
from minigraph.kernels.cpu import batch_norm as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import batch_norm_op as cuda
from minigraph.schema import Meta, OpDesc, OpError, OpSchema, Slot, examples, kernel, register
from minigraph.validators import (
    bool_attr,
    check_float,
    check_rank,
    check_same_dtype,
    check_shape,
    fail,
    float_attr,
    one_of,
    positive,
    str_attr,
)

PARAM_SLOTS = ("scale", "bias", "estimated_mean", "estimated_var")


def momentum_range(v):
    """The momentum attribute's check: a weight of the old estimate, in [0, 1]."""
    if 0.0 <= v <= 1.0:
        return None
    return ("must be in [0, 1] (the weight of the old estimate), or None for the "
            "cumulative average")


def batch_statistics(op):
    """Whether `op` normalises with its batch's statistics: in training, and in
    inference too when it keeps no estimates (track_running_stats=False)."""
    a = op.attrs
    return not a["use_global_est"] and (not a["is_infer"] or op.inputs["estimated_mean"] is None)


def export_batch_norm(ctx, op, out=None):
    """BatchNormalization on the estimates (inference; ones and zeros for an absent
    scale and bias); NHWC is transposed to NCHW and back around it. Without
    estimates the batch's moments are spelled out (onnx_export.moments_normalize).
    `out`: the ONNX name of the result (default: y's)."""
    onnx_export.infer_only(op)
    x, y = op.inputs["x"], op.outputs["y"]
    out = ctx.output(y) if out is None else out
    rank, dt = len(ctx.shape(x)), ctx.dtype(x)
    nchw = op.attrs["data_layout"] == "NCHW" or rank == 2
    channels = ctx.shape(x)[1 if nchw else -1]
    eps = float(op.attrs["epsilon"])
    scale, bias = (ctx.value(op.inputs[s]) if op.inputs[s] is not None else
                   ctx.const(y, s, np.full(channels, 1.0 if s == "scale" else 0.0, dt))
                   for s in ("scale", "bias"))
    if op.inputs["estimated_mean"] is None:
        return export_batch_statistics(ctx, op, scale, bias, nchw, eps, out)
    ins = [scale, bias] + [ctx.value(op.inputs[s]) for s in ("estimated_mean", "estimated_var")]
    if nchw:
        return [ctx.node("BatchNormalization", [ctx.value(x), *ins], [out], epsilon=eps)]
    to_nchw = [0, rank - 1, *range(1, rank - 1)]
    to_nhwc = [0, *range(2, rank), 1]
    xt, yt = ctx.temp(y, "nchw"), ctx.temp(y, "bn_nchw")
    return [ctx.node("Transpose", [ctx.value(x)], [xt], perm=to_nchw),
            ctx.node("BatchNormalization", [xt, *ins], [yt], epsilon=eps),
            ctx.node("Transpose", [yt], [out], perm=to_nhwc)]


def export_batch_statistics(ctx, op, scale, bias, nchw, eps, out):
    """y = (x - mean) / sqrt(var + eps) * scale + bias with the batch's per-channel
    moments (track_running_stats=False), the scale and bias reshaped to broadcast, into
    the ONNX value `out`."""
    x, y = op.inputs["x"], op.outputs["y"]
    shape, dt = ctx.shape(x), ctx.dtype(x)
    rank = len(shape)
    axes = [0, *range(2, rank)] if nchw else list(range(rank - 1))
    per_channel = np.array([-1] + [1] * (rank - 2) if nchw else [-1], np.int64)
    normed, scaled, s_col, b_col = (ctx.temp(y, n) for n in
                                    ("normalized", "scaled", "scale_col", "bias_col"))
    nodes = onnx_export.moments_normalize(ctx, ctx.value(x), axes, eps, normed, y, dt)
    shape_const = ctx.const(y, "per_channel", per_channel)
    return nodes + [ctx.node("Reshape", [scale, shape_const], [s_col]),
                    ctx.node("Reshape", [bias, shape_const], [b_col]),
                    ctx.node("Mul", [normed, s_col], [scaled]),
                    ctx.node("Add", [scaled, b_col], [out])]


def bn_schema(op_type, **fields):
    """The batch-norm schema under `op_type` (sync_batch_norm and the batch_norm_relu ops
    share it); `fields` add OpSchema fields or replace these (roles, export, grad, doc)."""
    schema = dict(
        type=op_type,
        inputs=(Slot("x"), Slot("estimated_mean", optional=True),
                Slot("estimated_var", optional=True), Slot("scale", optional=True),
                Slot("bias", optional=True), Slot("num_batches", optional=True)),
        outputs=(Slot("y"), Slot("batch_mean"), Slot("batch_var"),
                 Slot("saved_mean", optional=True), Slot("saved_var", optional=True),
                 Slot("saved_num_batches", optional=True)),
        attrs=(bool_attr("is_infer", False), bool_attr("use_global_est", False),
               float_attr("epsilon", 1e-5, positive),
               float_attr("momentum", 0.9, momentum_range, nullable=True),
               str_attr("data_layout", "NCHW", one_of("NCHW", "NHWC")),
               bool_attr("first_batch_sets_estimates", True)),
        inplace={"saved_mean": "estimated_mean", "saved_var": "estimated_var",
                 "saved_num_batches": "num_batches"},
        mode_attr="is_infer",
        roles=("batch_norm",),
        export=export_batch_norm,
        infer=lambda ins, attrs: infer_bn(op_type, ins, attrs),
        validate=validate_bn,
        grad=grad_bn,
        doc=__doc__,
    )
    schema.update(fields)
    return OpSchema(**schema)


def validate_bn(op):
    """Cross-slot rules: the two estimates go together (each in-place pair too:
    Operator checks those; scale and bias are each optional); the counter and
    use_global_est need the estimates; with them, momentum=None needs the counter."""
    ins = op.inputs
    if (ins["estimated_mean"] is None) != (ins["estimated_var"] is None):
        raise OpError(f"{op.type}: 'estimated_mean' and 'estimated_var' go together (the "
                      "running estimates); bind both or neither")
    if ins["estimated_mean"] is None:
        for needs, what in ((ins["num_batches"] is not None, "the 'num_batches' counter"),
                            (op.attrs["use_global_est"], "use_global_est=True")):
            if needs:
                raise OpError(f"{op.type}: {what} needs the running estimates "
                              "('estimated_mean', 'estimated_var'); without them both modes "
                              "normalise with the batch's statistics")
    elif ins["num_batches"] is None and op.attrs["momentum"] is None:
        raise OpError(f"{op.type}: momentum=None (cumulative average) needs the "
                      "'num_batches' counter input")


def infer_bn(op_type, ins, attrs):
    """Check x (rank 2-5, float), the per-channel parameters and the counter; y is x's shape."""
    x = ins["x"]
    check_rank(op_type, "x", x, (2, 3, 4, 5))
    check_float(op_type, "x", x)
    layout = attrs["data_layout"]
    channels = x.shape[1] if layout == "NCHW" else x.shape[-1]
    for slot in PARAM_SLOTS:
        if ins.get(slot) is None:
            continue
        check_shape(op_type, slot, ins[slot], (channels,),
                    f" to match the {channels} channels of input 'x' ({layout}, shape {x.shape})")
        check_same_dtype(op_type, slot, ins[slot], "x", x)
    if ins.get("num_batches") is not None:
        nb = ins["num_batches"]
        if nb.shape != () or nb.dtype != np.int64:
            fail(op_type, "num_batches", f"must be an int64 scalar (shape ()), got "
                                         f"{nb.dtype} of shape {nb.shape}")
    stat = Meta((channels,), x.dtype)
    return {"y": Meta(x.shape, x.dtype), "batch_mean": stat, "batch_var": stat}


def grad_bn(op, dout, make_grad, **extra):
    """batch_norm_grad from batch statistics, or with the estimates as constants;
    `extra`: more slots of the grad op (batch_norm_relu's y)."""
    dy = dout.get("y")
    if dy is None:
        return []
    use_est = not batch_statistics(op)
    src = op.inputs if use_est else op.outputs
    mean_slot, var_slot = (("estimated_mean", "estimated_var") if use_est
                           else ("batch_mean", "batch_var"))
    scale, bias = op.inputs["scale"], op.inputs["bias"]
    return [OpDesc(op.type + "_grad", dict(
        x=op.inputs["x"], scale=scale, mean=src[mean_slot], var=src[var_slot], dy=dy,
        dx=make_grad(op.inputs["x"]), dscale=None if scale is None else make_grad(scale),
        dbias=None if bias is None else make_grad(bias), use_global_est=use_est,
        epsilon=op.attrs["epsilon"], data_layout=op.attrs["data_layout"], **extra))]


def bn_grad_schema(op_type, extra_inputs=(), extra_attrs=(), **fields):
    """`<op_type>_grad`: dx, dscale, dbias from x, dy and the statistics used.
    extra_inputs / extra_attrs: more slots and attributes (batch_norm_relu's y;
    sync_batch_norm's average_ranks); fields: more OpSchema fields (sync_batch_norm's
    `presummed`, dscale and dbias)."""
    def infer(ins, attrs):
        x = ins["x"]
        check_shape(op_type + "_grad", "dy", ins["dy"], x.shape, " (the shape of x)")
        c = Meta(ins["mean"].shape, x.dtype)
        return {"dx": Meta(x.shape, x.dtype), "dscale": c, "dbias": c}

    return OpSchema(
        type=op_type + "_grad",
        inputs=(Slot("x"), Slot("scale", optional=True), Slot("mean"), Slot("var"), Slot("dy"),
                *extra_inputs),
        outputs=(Slot("dx", optional=True), Slot("dscale", optional=True),
                 Slot("dbias", optional=True)), reuse={"dx": ("dy",)},
        attrs=(bool_attr("use_global_est", False), float_attr("epsilon", 1e-5, positive),
               str_attr("data_layout", "NCHW", one_of("NCHW", "NHWC")), *extra_attrs),
        infer=infer,
        no_export="a gradient op (training only)",
        **fields,
    )


register(bn_schema("batch_norm", sync_variant="sync_batch_norm"))
register(bn_grad_schema("batch_norm", sync_variant="sync_batch_norm_grad"))
kernel("batch_norm", "cpu", cpu.batch_norm_cpu)
kernel("batch_norm_grad", "cpu", cpu.batch_norm_grad_cpu)
kernel("batch_norm", "gpu", cuda.batch_norm_gpu, dtypes=GPU_FLOATS)
kernel("batch_norm_grad", "gpu", cuda.batch_norm_grad_gpu, dtypes=GPU_FLOATS)


def batch_norm_examples(ex):
    """Cases the device tests run on every place against the CPU: (name, inputs,
    attrs, grad sets); the estimates and the counter are updated in place."""
    def ins(x, counter=0, channels_last=False):
        c, dt = x.shape[-1 if channels_last else 1], x.dtype
        return {"x": x, "scale": ex.r(c, dtype=dt, seed=1) + 1, "bias": ex.r(c, dtype=dt, seed=2),
                "estimated_mean": ex.r(c, dtype=dt, seed=3),
                "estimated_var": ex.r(c, dtype=dt, seed=4) ** 2 + 0.5,
                "num_batches": np.array(counter, np.int64)}

    grads = (("x", "scale", "bias"), ("x",), ("scale",))
    return [("train-f32", ins(ex.r(6, 3, 4, 5)), {}, grads),
            ("first-batch-f64", ins(ex.r(5, 4, 3, 2, dtype=np.float64)), {}, grads),
            ("later-batch-f32", ins(ex.r(7, 4, 3), counter=3), dict(momentum=0.8), grads),
            ("infer-f32", ins(ex.r(2, 3, 4, 4)), dict(is_infer=True), grads),
            ("global-est-f64", ins(ex.r(4, 3, 2, 2, dtype=np.float64)),
             dict(use_global_est=True), grads),
            ("nhwc-f32", ins(ex.r(3, 2, 5, 4), channels_last=True), dict(data_layout="NHWC"),
             grads),
            ("no-affine-f32", {k: v for k, v in ins(ex.r(5, 3, 2, 2)).items()
                               if k not in ("scale", "bias")}, {}, (("x",),)),
            ("untracked-f64", {k: v for k, v in ins(ex.r(4, 3, 3, dtype=np.float64)).items()
                               if k in ("x", "scale", "bias")}, {}, grads),
            ("untracked-infer-f32", {"x": ex.r(6, 2, 3)}, dict(is_infer=True), (("x",),))]


examples("batch_norm", batch_norm_examples)
