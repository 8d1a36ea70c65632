"""clip_by_global_norm: scale a list of gradients so that their joint L2 norm is
at most max_norm (torch.nn.utils.clip_grad_norm_).

total = sqrt(sum over every x_i of sum(x_i ** 2)) (in float64), then
coef = min(max_norm / (total + 1e-6), 1) and out_i = x_i * coef. `out` may
be the x Variables themselves (the optimizers bind it so). No gradient.
Kernels: kernels/cpu/clip.py, kernels/cuda/clip.py.
"""
from __future__ import annotations

from minigraph.kernels.cpu import clip as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import clip as cuda
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
    infer=infer_clip, validate=validate_clip, no_export="a training update of gradients",
    roles=("clip_gradients",), doc=__doc__))


kernel("clip_by_global_norm", "cpu", cpu.clip_by_global_norm_cpu)
kernel("clip_by_global_norm", "gpu", cuda.clip_by_global_norm_gpu, dtypes=GPU_FLOATS)
