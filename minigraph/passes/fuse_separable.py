"""Graph pass: fuse_separable_conv2d makes a fused_separable_conv2d of each

    fused_conv2d of a depthwise conv (groups = its input's channels, more than one;
                 no residual, no pooling)
    -> fused_conv2d of a 1x1 conv (stride 1, no padding, one group, no pooling) that
       alone reads the depthwise conv's output, as its x only

of an NCHW infer-only net (after fuse_conv2d: optimize_for_inference runs it last), a
MobileNet block: its depthwise outputs then stay in cache until the 1x1 conv has read
them (ops/fused_separable_conv2d.py). The depthwise conv's bias and relu and the 1x1
conv's bias, residual and relu come along. Channels-last nets keep their two ops (the
separable kernel reads NCHW). The ops are found by their roles ("fused_conv",
"fused_separable_conv"), never by type name.
"""
from __future__ import annotations

from minigraph.operator import Operator
from minigraph.passes.fuse import FuseNote, _only_reader
from minigraph.passes.infer_clone import check_infer_only, check_net, kept_ids, record
from minigraph.schema import op_for_role

NAME = "fuse_separable_conv2d"


def fuse_separable_conv2d(net, verbose=False):
    """Rewrite the trunk of an infer-only net in place, fusing each depthwise -> 1x1
    pair of fused_conv2d ops of the module doc into a fused_separable_conv2d. Returns a
    FuseNote per fused pair, also kept as `net.reports["fuse_separable_conv2d"]`."""
    check_net(net, NAME)
    check_infer_only(net, NAME)
    kept, fused_type, notes = kept_ids(net), op_for_role("fused_separable_conv"), []
    for dw in [op for op in net.section("trunk") if op.schema.has_role("fused_conv")]:
        pw = _only_reader(net.section("trunk"), dw.outputs["out"], kept)
        if not (_depthwise(dw) and pw is not None and _pointwise(pw, dw)):
            continue
        optional = {"dw_bias": dw.inputs["bias"], "bias": pw.inputs["bias"],
                    "residual": pw.inputs["residual"]}
        out = pw.outputs["out"]
        fused = Operator(fused_type, x=dw.inputs["x"], dw_filter=dw.inputs["filter"],
                         filter=pw.inputs["filter"],
                         **{s: v for s, v in optional.items() if v is not None}, out=out,
                         **{k: v for k, v in dw.attrs.items() if k not in ("activation", "pool")},
                         dw_activation=dw.attrs["activation"],
                         activation=pw.attrs["activation"])
        fused.layer = pw.layer
        net.replace_op("trunk", pw, fused)
        net.remove_op("trunk", dw)
        notes.append(FuseNote((dw.type, pw.type), out.name, fused_type))
    return record(net, NAME, notes, verbose)


def _depthwise(op):
    """op is a fused_conv2d of an NCHW depthwise conv (groups = x's channels > 1) with
    neither a residual nor pooling."""
    x, a = op.inputs["x"], op.attrs
    return (a["data_layout"] == "NCHW" and a["pool"] == "none"
            and op.inputs["residual"] is None and x.shape is not None and len(x.shape) == 4
            and 1 < a["groups"] == x.shape[1])


def _pointwise(op, dw):
    """op is a fused_conv2d of a 1x1 conv of stride 1, no padding, one group and no
    pooling, in dw's layout, reading dw's output as its x only."""
    v, a, w = dw.outputs["out"], op.attrs, op.inputs["filter"]
    return (op.schema.has_role("fused_conv") and op.inputs["x"] is v
            and op.inputs["residual"] is not v and a["pool"] == "none"
            and a["data_layout"] == dw.attrs["data_layout"] and a["groups"] == 1
            and a["strides"] == (1, 1) and a["paddings"] == (0, 0)
            and a["dilations"] == (1, 1) and w.shape is not None
            and tuple(w.shape[2:]) == (1, 1))
