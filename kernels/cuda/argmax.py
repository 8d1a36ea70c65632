"""Launchers for kernels/cuda/argmax.cu: argmax along an axis (int64) and accuracy.

accuracy cannot raise for a label outside [0, K) without a host round trip:
such a row counts as wrong and a `LabelStatus` on the device records it;
`LabelStatus.check()` (a synchronising read, meant for fetch time) raises.
"""
from __future__ import annotations

import numpy as np

from minigraph.kernels.cuda import launch, loader
from minigraph.kernels.cuda.softmax import axis_view

MODULE = "argmax"
SIGNATURES = {}
for _t in ("f32", "f64"):
    SIGNATURES.update({f"argmax_rows_{_t}": "PPqi", f"argmax_columns_{_t}": "PPqqq",
                       f"accuracy_{_t}": "PPqiPPPP"})


class LabelStatus:
    """Device counters of out-of-range labels: [count, 1 + some flagged row]."""

    def __init__(self):
        from minigraph.kernels.cuda import fill

        self.array = fill.full((2,), 0, np.uint32)

    def check(self, what="accuracy"):
        """Raise ValueError if any launch since the last check saw a bad label
        (reads two words from the device: synchronises), then reset."""
        count, row = (int(v) for v in self.array.get())
        if count:
            from minigraph.kernels.cuda import fill

            fill.fill_constant(self.array, 0)
            raise ValueError(f"{what}: input 'label' had {count} value(s) outside [0, K), "
                             f"e.g. at row {row - 1}; those rows counted as wrong")


def _check_classes(what, k_len):
    if k_len == 0:
        raise ValueError(f"{what}: the axis has no values; argmax of nothing is undefined")
    if k_len >= 2**31:
        raise ValueError(f"{what}: {k_len} values along the axis; at most 2**31 - 1")


def argmax(x, axis=-1, out=None):
    """The index of the first maximum along `axis` (a NaN counts as the maximum),
    int64 of x's shape without the axis. Returns out (new unless given)."""
    pre, k_len, post = axis_view("argmax", x.shape, axis)
    a = axis % len(x.shape)
    shape = tuple(x.shape[:a]) + tuple(x.shape[a + 1:])
    out = loader.empty(shape, np.int64) if out is None else out
    launch.check_array("argmax: out", out, shape, np.int64)
    if out.size == 0:
        return out
    _check_classes("argmax", k_len)
    sfx = loader.suffix(x.dtype)
    dev = loader.device()
    if post == 1:
        name = f"argmax_rows_{sfx}"
        k = loader.kernel(MODULE, name, SIGNATURES[name])
        threads = launch.row_block_threads(k_len, dev)
        k.launch((launch.rows_grid(pre, threads, dev, k.resources), 1, 1), (threads, 1, 1),
                 loader.ptr(x, "argmax: x"), loader.ptr(out), pre, k_len)
    else:
        name = f"argmax_columns_{sfx}"
        k = loader.kernel(MODULE, name, SIGNATURES[name])
        threads = launch.block_threads(dev)
        k.launch((launch.flat_grid(pre * post, dev, threads, k.resources), 1, 1),
                 (threads, 1, 1), loader.ptr(x, "argmax: x"), loader.ptr(out), pre, k_len, post)
    return out


def accuracy(logits, label, status):
    """The fraction (float32, shape ()) of rows of logits (N, K) whose first
    maximum is at label (int64, (N,)); NaN when N == 0. Labels outside [0, K)
    count as wrong and are recorded in `status` (a LabelStatus)."""
    if len(logits.shape) != 2:
        raise ValueError(f"accuracy: logits must be (N, K), got shape {tuple(logits.shape)}")
    rows, k_len = (int(n) for n in logits.shape)
    launch.check_array("accuracy: label", label, (rows,), np.int64)
    out = loader.empty((), np.float32)
    if rows == 0:
        from minigraph.kernels.cuda import fill

        return fill.fill_constant(out, np.nan)
    _check_classes("accuracy", k_len)
    name = f"accuracy_{loader.suffix(logits.dtype)}"
    k = loader.kernel(MODULE, name, SIGNATURES[name])
    dev = loader.device()
    threads = launch.row_block_threads(k_len, dev)
    grid = launch.rows_grid(rows, threads, dev, k.resources)
    partial = loader.empty((grid,), np.float64)
    k.launch((grid, 1, 1), (threads, 1, 1), loader.ptr(logits, "accuracy: logits"),
             loader.ptr(label), rows, k_len, loader.ptr(partial), loader.ptr(loader.tickets(1)),
             loader.ptr(out), loader.ptr(status.array))
    return out


# ---- op kernels -------------------------------------------------------------------

def argmax_gpu(op, ins, ctx):
    """out = the first maximum's index along axis (int64), on the device."""
    return {"out": argmax(ins["x"], op.attrs["axis"])}


def accuracy_gpu(op, ins, ctx):
    """out = the fraction of rows whose argmax is the label (float32), on the device.
    A label outside [0, K) is flagged there and raises at the next fetch."""
    status = loader.error_flag("accuracy", LabelStatus)
    return {"out": accuracy(ins["logits"], ins["label"], status)}
