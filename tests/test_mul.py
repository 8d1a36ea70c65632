"""mul."""
import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg

rng = np.random.default_rng(0)


def mul_reference(x, y, x_num_col_dims=1):
    lead = x.shape[:x_num_col_dims]
    rows, k = int(np.prod(lead)), int(np.prod(x.shape[x_num_col_dims:]))
    x2 = x.reshape(rows, k)
    out = np.zeros((rows, y.shape[1]))
    for i in range(rows):
        for j in range(y.shape[1]):
            out[i, j] = sum(x2[i, t] * y[t, j] for t in range(k))
    return {"out": out.reshape(lead + (y.shape[1],))}


@pytest.mark.parametrize("x_shape, n, y_shape", [
    ((4, 3), 1, (3, 5)),
    ((2, 3, 4), 1, (12, 5)),
    ((2, 3, 4), 2, (4, 5)),
])
def test_mul_forward_and_grads(x_shape, n, y_shape):
    x, y = rng.standard_normal(x_shape), rng.standard_normal(y_shape)
    got = helper_test_op("mul", {"x": x, "y": y}, {"x_num_col_dims": n}, mul_reference,
                         grad_wrt=("x", "y"))
    assert got["out"].shape == x_shape[:n] + (y_shape[1],)


def test_mul_keeps_float32():
    x, y = rng.standard_normal((3, 4)).astype("f4"), rng.standard_normal((4, 2)).astype("f4")
    helper_test_op("mul", {"x": x, "y": y}, {}, mul_reference)


def build_mul(x_shape, y_shape, **attrs):
    scope = mg.Scope()
    x, y = scope.new_var("x"), scope.new_var("y")
    x.declare(x_shape, "float32")
    y.declare(y_shape, "float32")
    return mg.Operator("mul", x=x, y=y, out=scope.new_var("out"), **attrs)


def test_mul_unknown_batch():
    op = build_mul((-1, 2, 3), (6, 4))
    assert op.outputs["out"].decl_shape == (-1, 4)


@pytest.mark.parametrize("x_shape, y_shape, attrs, match", [
    ((8, 2, 3), (5, 4), {}, r"mul: input 'y' must have 6 rows .*got shape \(5, 4\)"),
    ((8, 2, 3), (3, 4), {"x_num_col_dims": 1}, r"input 'y' must have 6 rows"),
    ((8, 6), (6, 4, 1), {}, "input 'y' must have rank 2"),
    ((8, 6), (6, 4), {"x_num_col_dims": 2}, "input 'x' must have more than x_num_col_dims=2"),
    ((8, 6), (6, 4), {"x_num_col_dims": 0}, "attribute 'x_num_col_dims' must be > 0"),
])
def test_mul_bad_shapes(x_shape, y_shape, attrs, match):
    with pytest.raises(mg.OpError, match=match):
        build_mul(x_shape, y_shape, **attrs)
