"""fused_conv2d's GPU binding (the conv2d launcher, then bias, residual and relu in
place) through the real Executor, against the CPU kernel: on the kernel emulator,
and (marked gpu) a real GPU."""
from __future__ import annotations

import numpy as np
import pytest
from op_harness import assert_close, r, run_op

import minigraph as mg

F64 = np.float64


@pytest.mark.parametrize("inputs, attrs", [
    ({"x": r(2, 3, 6, 6), "filter": r(4, 3, 3, 3), "bias": r(4)},
     dict(paddings=1, activation="relu")),
    ({"x": r(2, 4, 7, 7, dtype=F64), "filter": r(6, 2, 3, 3, dtype=F64),
      "bias": r(6, dtype=F64), "residual": r(2, 6, 4, 4, dtype=F64)},
     dict(strides=2, paddings=1, groups=2, activation="relu")),
    ({"x": r(1, 3, 5, 5), "filter": r(2, 3, 1, 1), "residual": r(1, 2, 5, 5)}, {}),
])
def test_fused_conv2d_matches_the_cpu(device_place, inputs, attrs):
    want, _ = run_op(mg.CPUPlace(), "fused_conv2d", inputs, attrs)
    got, _ = run_op(device_place, "fused_conv2d", inputs, attrs)
    assert_close(got["out"], want["out"], "fused_conv2d: output 'out'")
