"""batch_norm_relu and sync_batch_norm_relu: a batch norm and the relu after it, one op.

    y = max(batch_norm(x), 0)

Slots, attributes and semantics are batch_norm's (sync_batch_norm's for the sync
form): the schema is bn_schema's, so every attribute batch_norm has, this op has
too, and a pass that fuses copies them all. The running estimates, the counter,
the first-batch rule, the non-finite check and the all-or-nothing step are
exactly batch_norm's: only y differs, and it is written in the same pass as the
normalisation (no second tensor-sized pass, no intermediate tensor).

Built by `mg.passes.fuse_batch_norm_relu(net)` from a batch_norm (or
sync_batch_norm) whose y only one relu reads: the relu's output Variable becomes
this op's y (so what reads it is unchanged) and the batch norm's own y is no
longer computed. The persistables are the batch norm's, under the same names, so
checkpoints load either way.

Backward: `batch_norm_relu_grad` (x, scale, mean, var, dy, y -> dx, dscale,
dbias): dy counts only where the forward's output y > 0 (relu's gradient, read
from y's sign), then batch_norm's gradient; dx may be written into dy's array.

ONNX: BatchNormalization then Relu (inference). Folding (fold_batch_norm) folds the
batch norm into the conv2d or fc before it and leaves a relu after it.
Kernels: kernels/cpu/batch_norm.py and kernels/cuda/batch_norm_op.py (the batch
norm drivers with `relu`).
"""
from __future__ import annotations

from minigraph.kernels.cpu import batch_norm as cpu
from minigraph.kernels.cuda import FLOATS as GPU_FLOATS
from minigraph.kernels.cuda import batch_norm_op as cuda
from minigraph.ops.batch_norm import (
    batch_norm_examples,
    bn_grad_schema,
    bn_schema,
    export_batch_norm,
    grad_bn,
)
from minigraph.ops.sync_batch_norm import (
    AVERAGE_RANKS,
    backward_collectives,
    forward_collectives,
    presummed_grads,
)
from minigraph.schema import Slot, examples, kernel, register

ROLES = ("batch_norm", "batch_norm_relu")


def export_batch_norm_relu(ctx, op):
    """BatchNormalization (as batch_norm exports it) into a temporary, then Relu."""
    y = op.outputs["y"]
    normed = ctx.temp(y, "batch_norm")
    return export_batch_norm(ctx, op, out=normed) + [ctx.node("Relu", [normed], [ctx.output(y)])]


def grad_bn_relu(op, dout, make_grad):
    """batch_norm's grad op, reading the forward's output y for relu's mask."""
    return grad_bn(op, dout, make_grad, y=op.outputs["y"])


register(bn_schema("batch_norm_relu", sync_variant="sync_batch_norm_relu", roles=ROLES,
                   export=export_batch_norm_relu, grad=grad_bn_relu, doc=__doc__))
register(bn_grad_schema("batch_norm_relu", extra_inputs=(Slot("y"),),
                        sync_variant="sync_batch_norm_relu_grad"))
register(bn_schema("sync_batch_norm_relu", roles=ROLES, export=export_batch_norm_relu,
                   grad=grad_bn_relu, doc=__doc__, collectives=forward_collectives))
register(bn_grad_schema("sync_batch_norm_relu", extra_inputs=(Slot("y"),),
                        extra_attrs=(AVERAGE_RANKS,), presummed=presummed_grads,
                        presummed_average="average_ranks", collectives=backward_collectives))
kernel("batch_norm_relu", "cpu", cpu.batch_norm_relu_cpu)
kernel("batch_norm_relu_grad", "cpu", cpu.batch_norm_relu_grad_cpu)
kernel("sync_batch_norm_relu", "cpu", cpu.sync_batch_norm_relu_cpu)
kernel("sync_batch_norm_relu_grad", "cpu", cpu.sync_batch_norm_relu_grad_cpu)
kernel("batch_norm_relu", "gpu", cuda.batch_norm_relu_gpu, dtypes=GPU_FLOATS)
kernel("batch_norm_relu_grad", "gpu", cuda.batch_norm_relu_grad_gpu, dtypes=GPU_FLOATS)
kernel("sync_batch_norm_relu", "gpu", cuda.sync_batch_norm_relu_gpu, dtypes=GPU_FLOATS)
kernel("sync_batch_norm_relu_grad", "gpu", cuda.sync_batch_norm_relu_grad_gpu,
       dtypes=GPU_FLOATS)
examples("batch_norm_relu", batch_norm_examples)
examples("sync_batch_norm_relu", batch_norm_examples)       # a world of one
