"""matmul: batched products with numpy's broadcasting and transpose flags, against a
float64 reference that loops over the batch and output positions; gradients against
finite differences (including operands broadcast along batch axes); the checks."""
import itertools

import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg

rng = np.random.default_rng(0)


def matmul_reference(x, y, transpose_x=False, transpose_y=False):
    if transpose_x:
        x = np.swapaxes(x, -1, -2)
    if transpose_y:
        y = np.swapaxes(y, -1, -2)
    batch = np.broadcast_shapes(x.shape[:-2], y.shape[:-2])
    xb = np.broadcast_to(x, batch + x.shape[-2:])
    yb = np.broadcast_to(y, batch + y.shape[-2:])
    m, k, n = x.shape[-2], x.shape[-1], y.shape[-1]
    out = np.zeros(batch + (m, n))
    for b in itertools.product(*(range(d) for d in batch)):
        for i in range(m):
            for j in range(n):
                out[b + (i, j)] = sum(float(xb[b + (i, t)]) * float(yb[b + (t, j)])
                                      for t in range(k))
    return {"out": out}


CASES = [((3, 4), (4, 5), False, False),
         ((2, 3, 4), (2, 4, 5), False, False),
         ((2, 3, 4), (4, 5), False, False),           # y broadcast over the batch
         ((3, 4), (2, 2, 4, 5), False, False),        # x broadcast over two batch axes
         ((2, 1, 3, 4), (1, 3, 4, 2), False, False),  # both broadcast
         ((4, 3), (4, 5), True, False),
         ((2, 3, 4), (5, 4), False, True),
         ((2, 4, 3), (1, 5, 4), True, True),
         ((1, 1), (1, 1), False, False)]


@pytest.mark.parametrize("x_shape, y_shape, tx, ty", CASES)
def test_forward_and_grads(x_shape, y_shape, tx, ty):
    x, y = rng.standard_normal(x_shape), rng.standard_normal(y_shape)
    helper_test_op("matmul", {"x": x, "y": y}, {"transpose_x": tx, "transpose_y": ty},
                   matmul_reference, grad_wrt=("x", "y"))


def test_float32_keeps_its_dtype():
    x = rng.standard_normal((2, 3, 4)).astype(np.float32)
    y = rng.standard_normal((4, 6)).astype(np.float32)
    assert helper_test_op("matmul", {"x": x, "y": y}, {}, matmul_reference)["out"].dtype == \
        np.float32


def declared(scope, name, shape, dtype="float32"):
    v = scope.new_var(name)
    v.declare(shape, np.dtype(dtype))
    return v


@pytest.mark.parametrize("x_shape, y_shape, attrs, message", [
    ((3, 4), (5, 6), {}, "matmul: input 'y' with shape \\(5, 6\\) does not chain with input "
                         "'x' with shape \\(3, 4\\): 4 columns against 5 rows"),
    ((3, 4), (3, 6), {"transpose_y": True}, "\\(transposed\\) does not chain"),
    ((4,), (4, 2), {}, "matmul: input 'x' must have rank"),
    ((2, 3, 4), (3, 4, 5), {}, "matmul: .*does not broadcast"),
])
def test_bad_shapes_name_the_op_and_the_inputs(x_shape, y_shape, attrs, message):
    scope = mg.Scope()
    with pytest.raises(mg.OpError, match=message):
        mg.Operator("matmul", x=declared(scope, "x", x_shape), y=declared(scope, "y", y_shape),
                    out=scope.new_var("out"), **attrs)


def test_unknown_batch_and_row_sizes_infer_at_build_time():
    scope = mg.Scope()
    op = mg.Operator("matmul", x=declared(scope, "x", (-1, 7, 4)),
                     y=declared(scope, "y", (4, 3)), out=scope.new_var("out"))
    assert op.outputs["out"].shape == (-1, 7, 3)


def test_dtypes_must_agree():
    scope = mg.Scope()
    with pytest.raises(mg.OpError, match="matmul: input 'y' has dtype float64 but input 'x' "
                                         "has float32"):
        mg.Operator("matmul", x=declared(scope, "x", (2, 3)),
                    y=declared(scope, "y", (3, 2), "float64"), out=scope.new_var("out"))


def test_grad_checks_dout_shape():
    scope = mg.Scope()
    with pytest.raises(mg.OpError, match="matmul_grad: input 'dout' must have shape \\(2, 5\\)"):
        mg.Operator("matmul_grad", x=declared(scope, "x", (2, 3)),
                    y=declared(scope, "y", (3, 5)), dout=declared(scope, "d", (2, 4)),
                    dx=scope.new_var("dx"))
