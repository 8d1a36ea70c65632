"""fused_fc's GPU binding (the mul launcher, then the bias, a residual and relu in
place, then gelu's map) through the real Executor, against the CPU kernel: on the kernel emulator, and (marked gpu) a
real GPU."""
from __future__ import annotations

import numpy as np
import pytest
from op_harness import assert_close, r, run_op

import minigraph as mg

F64 = np.float64


@pytest.mark.parametrize("inputs, attrs", [
    ({"x": r(5, 7), "y": r(7, 9), "bias": r(9)}, dict(activation="relu")),
    ({"x": r(2, 3, 4, dtype=F64), "y": r(4, 6, dtype=F64), "bias": r(6, dtype=F64)},
     dict(x_num_col_dims=2, activation="relu")),
    ({"x": r(3, 2, 5), "y": r(10, 4)}, {}),
    ({"x": r(2, 3, 4), "y": r(4, 6), "bias": r(6), "residual": r(2, 3, 6)},
     dict(x_num_col_dims=2, activation="gelu")),
    ({"x": r(3, 4, dtype=F64), "y": r(4, 5, dtype=F64), "residual": r(2, 1, 5, dtype=F64)},
     dict(activation="relu")),
])
def test_fused_fc_matches_the_cpu(device_place, inputs, attrs):
    want, _ = run_op(mg.CPUPlace(), "fused_fc", inputs, attrs)
    got, _ = run_op(device_place, "fused_fc", inputs, attrs)
    assert_close(got["out"], want["out"], "fused_fc: output 'out'")
