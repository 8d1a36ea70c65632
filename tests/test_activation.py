"""relu."""
import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg


def relu_reference(x):
    return {"out": np.where(x > 0, x, 0.0)}


def away_from_zero(shape, seed=0):
    rng = np.random.default_rng(seed)
    return rng.choice([-1.0, 1.0], shape) * rng.uniform(0.1, 2.0, shape)


def test_relu_forward_and_grad():
    helper_test_op("relu", {"x": away_from_zero((3, 4, 5))}, {}, relu_reference,
                   grad_wrt=("x",))


def test_relu_keeps_float32():
    got = helper_test_op("relu", {"x": away_from_zero((7,)).astype(np.float32)}, {},
                         relu_reference)
    assert got["out"].dtype == np.float32


def test_relu_rejects_int_input():
    scope = mg.Scope()
    x = scope.new_var("x")
    x.set(np.arange(3))
    with pytest.raises(mg.OpError, match="relu: input 'x' must be a float tensor"):
        mg.Operator("relu", x=x, out=scope.new_var("out"))
