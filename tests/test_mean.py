"""mean."""
import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg


def mean_reference(x):
    return {"out": np.array(np.mean(x, dtype=np.float64))}


def test_mean_forward_and_grad():
    x = np.random.default_rng(0).standard_normal((3, 4, 2))
    got = helper_test_op("mean", {"x": x}, {}, mean_reference, grad_wrt=("x",))
    assert got["out"].shape == ()


def test_mean_accumulates_float32_in_float64():
    # a float32 running sum of 2**20 values near 1e4 drifts far from the mean
    x = (1e4 + np.random.default_rng(1).standard_normal(1 << 20)).astype(np.float32)
    got = helper_test_op("mean", {"x": x}, {}, mean_reference, atol=0, rtol=1e-7)
    assert got["out"].dtype == np.float32


def test_mean_rejects_int_input():
    scope = mg.Scope()
    x = scope.new_var("x")
    x.set(np.arange(4))
    with pytest.raises(mg.OpError, match="mean: input 'x' must be a float tensor"):
        mg.Operator("mean", x=x, out=scope.new_var("out"))


def test_the_mean_of_an_empty_batch_is_zero_with_an_empty_gradient():
    got = helper_test_op("mean", {"x": np.ones((0, 3))}, {},
                         lambda x: {"out": np.array(0.0)}, grad_wrt=("x",))
    assert got["out"].shape == ()
