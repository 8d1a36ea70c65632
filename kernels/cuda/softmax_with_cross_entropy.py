"""Launchers for kernels/cuda/softmax_with_cross_entropy.cu on device arrays.

Labels outside [0, K) cannot raise at launch time without a host round
trip: their loss is NaN and a `LabelStatus` on the device counts them;
`LabelStatus.check()` (a synchronising read, meant for fetch time) raises.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cuda import launch, loader

MODULE = "softmax_with_cross_entropy"
SIGNATURES = {**{f"swce_forward_{t}": "PPPPqiPd" for t in ("f32", "f64")},
              **{f"swce_grad_{t}": "PPPPPqiPd" for t in ("f32", "f64")}}


class LabelStatus:
    """Device counters of out-of-range labels: [count, 1 + some flagged row]."""

    def __init__(self):
        from minigraph.kernels.cuda import fill

        self.array = fill.full((2,), 0, np.uint32)

    def check(self, what="softmax_with_cross_entropy"):
        """Raise ValueError if any launch since the last check saw a bad label
        (reads two words from the device: synchronises), then reset."""
        count, row = (int(v) for v in self.array.get())
        if count:
            from minigraph.kernels.cuda import fill

            fill.fill_constant(self.array, 0)
            raise ValueError(f"{what}: input 'label' had {count} value(s) outside [0, K), "
                             f"e.g. at row {row - 1}; their loss is NaN")


def default_status():
    """The LabelStatus shared by launches that are not given one (per device)."""
    return loader.cached("softmax_with_cross_entropy.default_status", LabelStatus)


def _rows_launch(name, rows, k_classes, *args):
    loader.rows_go(MODULE, name, SIGNATURES[name], rows, k_classes)(*args)


def forward(logits, label, status=None, label_smoothing=0.0):
    """(softmax (N, K), loss (N,)) of logits (N, K) and int64 labels (N,),
    computed in double from the max-shifted logits; with label_smoothing eps,
    loss = (1 - eps) (-log softmax[label]) + eps mean_k(-log softmax[k]) (eps = 0:
    exactly the unsmoothed loss). Bad labels: see LabelStatus."""
    rows, classes = (int(d) for d in logits.shape)
    launch.check_contiguous("softmax_with_cross_entropy: logits", logits)
    launch.check_array("softmax_with_cross_entropy: label", label, (rows,), np.int64)
    status = default_status() if status is None else status
    softmax = loader.empty((rows, classes), logits.dtype)
    loss = loader.empty((rows,), logits.dtype)
    if rows and classes:
        _rows_launch(f"swce_forward_{loader.suffix(logits.dtype)}", rows, classes,
                     loader.ptr(logits), loader.ptr(label), loader.address(softmax),
                     loader.address(loss), rows, classes, loader.address(status.array),
                     float(label_smoothing))
    return softmax, loss


def grad(label, softmax, dloss=None, dsoftmax=None, status=None, label_smoothing=0.0):
    """dlogits = (softmax - target) * dloss[:, None]
    + softmax * (dsoftmax - sum(dsoftmax * softmax, axis=1)), target the smoothed
    onehot (1 - eps) onehot(label) + eps / K (eps = label_smoothing); either term is
    left out when its input is None."""
    rows, classes = (int(d) for d in softmax.shape)
    launch.check_contiguous("softmax_with_cross_entropy_grad: softmax", softmax)
    launch.check_array("softmax_with_cross_entropy_grad: label", label, (rows,), np.int64)
    if dloss is not None:
        launch.check_array("softmax_with_cross_entropy_grad: dloss", dloss, (rows,),
                           softmax.dtype)
    if dsoftmax is not None:
        launch.check_array("softmax_with_cross_entropy_grad: dsoftmax", dsoftmax,
                           (rows, classes), softmax.dtype)
    status = default_status() if status is None else status
    dlogits = loader.empty((rows, classes), softmax.dtype)
    if rows and classes:
        _rows_launch(f"swce_grad_{loader.suffix(softmax.dtype)}", rows, classes,
                     loader.ptr(label), loader.ptr(softmax), loader.ptr(dloss),
                     loader.ptr(dsoftmax), loader.address(dlogits), rows, classes,
                     loader.address(status.array), float(label_smoothing))
    return dlogits


# ---- op kernels -------------------------------------------------------------------

def label_status(what):
    """The device-side record of out-of-range labels met by the `what` kernels;
    the place's check_errors() (at fetch time) raises for them."""
    return loader.error_flag(what, LabelStatus)


def softmax_with_cross_entropy_gpu(op, ins, ctx):
    """softmax and loss (label-smoothed by the attribute) on the device, from the
    max-shifted logits in double. A label outside [0, K) gets loss NaN and is
    flagged on the device; the error raises at the next fetch (see
    minigraph.place), not here."""
    logits, label = ins["logits"], ins["label"]
    softmax, loss = forward(logits, label, label_status("softmax_with_cross_entropy"),
                            op.attrs["label_smoothing"])
    return {"softmax": softmax, "loss": loss}


def softmax_with_cross_entropy_grad_gpu(op, ins, ctx):
    """dlogits on the device (the smoothed target of the attribute), from the terms
    whose incoming gradient is bound; nothing when dlogits is unbound."""
    sm, label = ins["softmax"], ins["label"]
    dloss, dsoftmax = ins["dloss"], ins["dsoftmax"]
    if not op.wants("dlogits"):
        return {}
    return {"dlogits": grad(label, sm, dloss, dsoftmax, label_status(op.type),
                            op.attrs["label_smoothing"])}
