"""CPU kernels of argmax and accuracy (ops/metrics.py).
"""
from __future__ import annotations

import numpy as np

from minigraph.schema import OpError


def argmax_cpu(op, ins, ctx):
    """out = np.argmax(x, axis) as int64."""
    return {"out": np.argmax(ins["x"], axis=op.attrs["axis"]).astype(np.int64)}


def accuracy_cpu(op, ins, ctx):
    """out = mean(argmax(logits, 1) == label) as a float32 scalar; NaN for no rows."""
    logits, label = ins["logits"], ins["label"]
    classes = logits.shape[1]
    bad = np.flatnonzero((label < 0) | (label >= classes))
    if bad.size:
        i = int(bad[0])
        raise OpError(f"accuracy: input 'label' has value {int(label[i])} at row {i}, outside "
                      f"[0, {classes}) for logits with {classes} classes")
    if label.size == 0:
        return {"out": np.array(np.nan, dtype=np.float32)}
    hits = np.count_nonzero(np.argmax(logits, axis=1) == label)
    return {"out": np.array(hits / label.size, dtype=np.float32)}
