"""clip_by_global_norm: scale a list of gradients so that their joint L2 norm is
at most max_norm (torch.nn.utils.clip_grad_norm_).

total = sqrt(sum over every x_i of sum(x_i ** 2)) (in float64), then
coef = min(max_norm / (total + 1e-6), 1) and out_i = x_i * coef. `out` may
be the x Variables themselves (the optimizers bind it so). No gradient.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels import clip as gpu
from minigraph.kernels import shape_ops
from minigraph.ops.device import GPU_FLOATS
from minigraph.schema import Meta, OpError, OpSchema, Slot, kernel, register
from minigraph.validators import check_float, float_attr, positive


def infer_clip(ins, attrs):
    for i, m in enumerate(ins["x"]):
        check_float("clip_by_global_norm", f"x[{i}]", m)
    return {"out": [Meta(m.shape, m.dtype) for m in ins["x"]]}


def validate_clip(op):
    if len(op.inputs["x"]) != len(op.outputs["out"]):
        raise OpError(f"{op.type}: 'x' has {len(op.inputs['x'])} Variables but 'out' has "
                      f"{len(op.outputs['out'])}; they pair up one to one")


register(OpSchema(
    type="clip_by_global_norm", inputs=(Slot("x", duplicable=True),),
    outputs=(Slot("out", duplicable=True),), attrs=(float_attr("max_norm", 1.0, positive),),
    infer=infer_clip, validate=validate_clip, doc=__doc__))


def clip_coefficient(total_norm, max_norm):
    """min(max_norm / (total_norm + 1e-6), 1), torch's clip_grad_norm_ factor."""
    return min(max_norm / (total_norm + 1e-6), 1.0)


@kernel("clip_by_global_norm", "cpu")
def clip_by_global_norm_cpu(op, ins, ctx):
    """out_i = x_i * min(max_norm / (||x||_2 + 1e-6), 1) over all the x at once."""
    xs = ins["x"]
    total = np.sqrt(sum(float(np.dot(x.ravel().astype(np.float64), x.ravel())) for x in xs))
    coef = clip_coefficient(total, op.attrs["max_norm"])
    return {"out": [x * x.dtype.type(coef) for x in xs]}


# ---- GPU bindings: kernels/clip.cu ----

@kernel("clip_by_global_norm", "gpu", dtypes=GPU_FLOATS)
def clip_by_global_norm_gpu(op, ins, ctx):
    """out_i = x_i * coef on the device, no host sync: in place where out_i is x_i's
    own Variable (as the optimizers bind it), else into a copy."""
    xs = [x if o is v else shape_ops.copy(x)
          for x, v, o in zip(ins["x"], op.inputs["x"], op.outputs["out"], strict=True)]
    return {"out": gpu.clip_by_global_norm(xs, op.attrs["max_norm"])}
