"""The inputs and worlds the GPU batch-norm tests share: a batch_norm op's inputs
(bn_inputs) and a second rank that holds no rows (LoneRankComm)."""
from __future__ import annotations

import numpy as np

from minigraph.distributed.comm import LocalComm

F32, F64 = np.float32, np.float64


def bn_inputs(shape, layout, dtype, seed=0, offset=0.0, counter=0):
    """The inputs of a batch_norm op; counter None leaves num_batches out."""
    channels = shape[1] if layout == "NCHW" else shape[-1]
    rng = np.random.default_rng(seed + 100)
    ins = dict(x=(rng.standard_normal(shape) * 2 + offset).astype(dtype),
               estimated_mean=rng.normal(0, 1, channels).astype(dtype),
               estimated_var=rng.uniform(0.5, 2, channels).astype(dtype),
               scale=rng.uniform(0.5, 1.5, channels).astype(dtype),
               bias=rng.normal(0, 1, channels).astype(dtype))
    if counter is not None:
        ins["num_batches"] = np.array(counter, np.int64)
    return ins



class LoneRankComm(LocalComm):
    """Two ranks as this process sees them when the other holds no rows: every
    vector it contributes is zero, so the sum is this rank's vector."""

    def __init__(self, place):
        super().__init__(place)
        self.size = 2

