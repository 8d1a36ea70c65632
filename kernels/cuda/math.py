"""GPU kernels of the elementwise math ops (ops/math.py) beyond the map-only ones of
math.cu that ops/math.py registers through map.op_kernels."""
from __future__ import annotations

from minigraph.kernels.cuda import map as maps

MODULE = "math"


def scale_grad_gpu(op, ins, ctx):
    """dx = dout * scale on the device (math.cu's `scale` map with bias 0), when bound."""
    if not op.wants("dx"):
        return {}
    return {"dx": maps.unary(MODULE, "scale", ins["dout"], op.attrs["scale"], 0.0)}
