"""add, multiply, subtract and divide: numpy broadcasting both ways, grads reduced back
to each shape."""
import numpy as np
import pytest
from helpers import call_kernel, helper_test_op

import minigraph as mg

rng = np.random.default_rng(0)

SHAPES = [
    ((4, 1, 3), (2, 3)),        # both broadcast
    ((2, 3), (4, 1, 3)),        # the other way round
    ((3, 4), (3, 4)),           # equal shapes
    ((3, 4), (1,)),             # scalar-like y
    ((1,), (2, 3)),             # scalar-like x
    ((2, 1, 4), (1, 5, 1)),
    ((5,), ()),                 # a true scalar
    ((), ()),
    ((2, 3, 1), (3, 4)),
]


def add_reference(x, y):
    shape = np.broadcast_shapes(x.shape, y.shape)
    return {"out": np.broadcast_to(x, shape) + np.broadcast_to(y, shape)}


def multiply_reference(x, y):
    shape = np.broadcast_shapes(x.shape, y.shape)
    return {"out": np.broadcast_to(x, shape) * np.broadcast_to(y, shape)}


def subtract_reference(x, y):
    shape = np.broadcast_shapes(x.shape, y.shape)
    return {"out": np.broadcast_to(x, shape) - np.broadcast_to(y, shape)}


def divide_reference(x, y):
    shape = np.broadcast_shapes(x.shape, y.shape)
    return {"out": np.broadcast_to(x, shape) / np.broadcast_to(y, shape)}


@pytest.mark.parametrize("x_shape, y_shape", SHAPES)
def test_subtract_forward_and_grads(x_shape, y_shape):
    x, y = rng.standard_normal(x_shape), rng.standard_normal(y_shape)
    helper_test_op("subtract", {"x": x, "y": y}, {}, subtract_reference, grad_wrt=("x", "y"))


@pytest.mark.parametrize("x_shape, y_shape", SHAPES)
def test_divide_forward_and_grads(x_shape, y_shape):
    x = rng.standard_normal(x_shape)
    y = rng.uniform(0.5, 2.0, y_shape) * rng.choice([-1.0, 1.0], y_shape)
    helper_test_op("divide", {"x": x, "y": y}, {}, divide_reference, grad_wrt=("x", "y"))


def test_divide_by_zero_is_inf_and_nan_as_in_numpy():
    scope = mg.Scope()
    x, y, out = scope.new_var("x"), scope.new_var("y"), scope.new_var("out")
    x.set(np.array([1.0, -1.0, 0.0]))
    y.set(np.zeros(3))
    (got,) = mg.Executor().run([mg.Operator("divide", x=x, y=y, out=out)], scope, fetch=[out])
    assert got[0] == np.inf and got[1] == -np.inf and np.isnan(got[2])


@pytest.mark.parametrize("x_shape, y_shape", SHAPES)
def test_add_forward_and_grads(x_shape, y_shape):
    x, y = rng.standard_normal(x_shape), rng.standard_normal(y_shape)
    helper_test_op("add", {"x": x, "y": y}, {}, add_reference, grad_wrt=("x", "y"))


@pytest.mark.parametrize("x_shape, y_shape", SHAPES)
def test_multiply_forward_and_grads(x_shape, y_shape):
    x, y = rng.standard_normal(x_shape), rng.standard_normal(y_shape)
    helper_test_op("multiply", {"x": x, "y": y}, {}, multiply_reference, grad_wrt=("x", "y"))


@pytest.mark.parametrize("op_type, reference", [("add", add_reference),
                                                ("multiply", multiply_reference),
                                                ("subtract", subtract_reference),
                                                ("divide", divide_reference)])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_keeps_float_dtype(op_type, reference, dtype):
    x = rng.standard_normal((4, 1, 3)).astype(dtype)
    y = rng.standard_normal((2, 3)).astype(dtype)
    got = helper_test_op(op_type, {"x": x, "y": y}, {}, reference)
    assert got["out"].dtype == dtype


def run_grad(op_type, x, y, dout, **bound):
    scope = mg.Scope()
    vs = {}
    for name, value in (("x", x), ("y", y), ("dout", dout)):
        vs[name] = scope.new_var(name)
        vs[name].set(value)
    outs = {k: scope.new_var(k) for k in bound}
    op = mg.Operator(op_type + "_grad", **vs, **outs)
    mg.Executor().run([op], scope)
    return {k: v.get() for k, v in outs.items()}


@pytest.mark.parametrize("op_type", ["add", "multiply", "subtract", "divide"])
def test_grad_kernels_by_hand_and_one_output_alone(op_type):
    x = rng.standard_normal((4, 1, 3)).astype("float32")
    y = rng.uniform(0.5, 2.0, (2, 3)).astype("float32")
    d = rng.standard_normal((4, 2, 3)).astype("float32")
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    fx, fy = {"add": (1.0, 1.0), "multiply": (y64, x64), "subtract": (1.0, -1.0),
              "divide": (1.0 / y64, -x64 / y64 ** 2)}[op_type]
    want_dx = (d.astype(np.float64) * fx).sum(axis=1, keepdims=True)
    want_dy = (d.astype(np.float64) * fy).sum(axis=0)
    both = run_grad(op_type, x, y, d, dx=True, dy=True)
    np.testing.assert_allclose(both["dx"], want_dx, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(both["dy"], want_dy, rtol=1e-5, atol=1e-6)
    assert both["dx"].dtype == both["dy"].dtype == np.float32
    only = run_grad(op_type, x, y, d, dy=True)
    np.testing.assert_array_equal(only["dy"], both["dy"])


def test_add_grad_passes_dout_through_where_nothing_is_summed():
    """An input of dout's shape and dtype gets dout itself (kernels never write their
    inputs, so no copy is needed: a residual block's backward holds one gradient, not
    three); a broadcast or other-dtype input gets a new, reduced array."""
    def kernel_outputs(x, y, d):
        scope = mg.Scope()
        vs = {name: scope.new_var(name) for name in ("x", "y", "dout", "dx", "dy")}
        for name, value in (("x", x), ("y", y), ("dout", d)):
            vs[name].set(value)
        op = mg.Operator("add_grad", **vs)
        return call_kernel(op, {"x": x, "y": y, "dout": d})

    x, y = rng.standard_normal((2, 3)), rng.standard_normal((2, 3))
    d = rng.standard_normal((2, 3))
    got = kernel_outputs(x, y, d)
    assert got["dx"] is d and got["dy"] is d
    got = kernel_outputs(x, rng.standard_normal((1, 3)), d)
    assert got["dx"] is d and not np.shares_memory(got["dy"], d)
    np.testing.assert_allclose(got["dy"], d.sum(axis=0, keepdims=True))
    got = kernel_outputs(x.astype(np.float32), y.astype(np.float32), d)
    assert got["dx"].dtype == np.float32 and not np.shares_memory(got["dx"], d)


def build(op_type, x_shape, y_shape, x_dtype="float64", y_dtype="float64"):
    scope = mg.Scope()
    x, y = scope.new_var("x"), scope.new_var("y")
    x.declare(x_shape, np.dtype(x_dtype))
    y.declare(y_shape, np.dtype(y_dtype))
    out = scope.new_var("out")
    mg.Operator(op_type, x=x, y=y, out=out)
    return out


@pytest.mark.parametrize("x_shape, y_shape, want", [
    ((-1, 1, 3), (2, 3), (-1, 2, 3)),
    ((-1, 3), (-1, 1), (-1, 3)),
    ((-1, 4), (1,), (-1, 4)),
    ((1, 4), (-1, 1), (-1, 4)),
    ((-1, 4), (5, 4), (5, 4)),
    ((4, 1, 3), (2, 3), (4, 2, 3)),
])
@pytest.mark.parametrize("op_type", ["add", "multiply", "subtract", "divide"])
def test_infer_broadcast_shape_with_unknown_dims(op_type, x_shape, y_shape, want):
    assert build(op_type, x_shape, y_shape).shape == want


@pytest.mark.parametrize("op_type", ["add", "multiply", "subtract", "divide"])
@pytest.mark.parametrize("x_shape, y_shape", [((2, 3), (4,)), ((4, 2, 3), (3, 3)),
                                              ((-1, 3), (-1, 2))])
def test_non_broadcastable_shapes_name_the_op_and_inputs(op_type, x_shape, y_shape):
    with pytest.raises(mg.OpError, match=rf"{op_type}: input 'y' with shape .* does not "
                                         r"broadcast with input 'x'"):
        build(op_type, x_shape, y_shape)


@pytest.mark.parametrize("op_type", ["add", "multiply", "subtract", "divide"])
def test_bad_dtypes(op_type):
    with pytest.raises(mg.OpError, match=rf"{op_type}: input 'x' must be a float tensor"):
        build(op_type, (2,), (2,), "int64", "int64")
    with pytest.raises(mg.OpError, match=rf"{op_type}: input 'y' has dtype float32 but input "
                                         r"'x' has float64"):
        build(op_type, (2,), (2,), "float64", "float32")


def test_runtime_shapes_are_checked_too():
    scope = mg.Scope()
    x, y, out = scope.new_var("x"), scope.new_var("y"), scope.new_var("out")
    x.declare((-1, 3), np.dtype("float64"))
    y.declare((3,), np.dtype("float64"))
    op = mg.Operator("add", x=x, y=y, out=out)
    x.set(np.zeros((2, 3)))
    y.set(np.zeros(4))
    with pytest.raises(mg.OpError, match="add: input 'y' with shape"):
        mg.Executor().run([op], scope)


def test_grad_op_checks_dout_shape():
    with pytest.raises(mg.OpError, match=r"add_grad: input 'dout' must have shape \(4, 2, 3\)"):
        run_grad("add", np.zeros((4, 1, 3)), np.zeros((2, 3)), np.zeros((4, 3)), dx=True)
