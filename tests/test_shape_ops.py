"""reshape, flatten, transpose and their grads."""
import math

import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg

rng = np.random.default_rng(2)


def reshape_reference(x, shape):
    shape = list(shape)
    if -1 in shape:
        shape[shape.index(-1)] = x.size // -math.prod(shape)
    return {"out": np.array(x.ravel().tolist()).reshape(shape)}


@pytest.mark.parametrize("x_shape, shape", [
    ((2, 3, 4), (6, 4)), ((2, 3, 4), (-1, 4)), ((2, 3, 4), (4, -1)), ((2, 3, 4), (-1,)),
    ((2, 3, 4), (2, 3, 4)), ((6,), (1, 2, 1, 3)), ((1,), ()), ((2, 3, 4), (3, 2, -1)),
])
def test_reshape_forward_and_grad(x_shape, shape):
    helper_test_op("reshape", {"x": rng.standard_normal(x_shape)}, {"shape": shape},
                   reshape_reference, grad_wrt=("x",))


def test_reshape_float32_int64_and_no_view():
    x = rng.standard_normal((4, 6)).astype("float32")
    got = helper_test_op("reshape", {"x": x}, {"shape": [3, -1]}, reshape_reference)
    assert got["out"].dtype == np.float32
    i = np.arange(12)
    np.testing.assert_array_equal(helper_test_op("reshape", {"x": i}, {"shape": (3, 4)})["out"],
                                  i.reshape(3, 4))
    scope = mg.Scope()
    xv, out = scope.new_var("x"), scope.new_var("out")
    xv.set(x)
    mg.Executor().run([mg.Operator("reshape", x=xv, out=out, shape=(24,))], scope)
    assert not np.shares_memory(out.get(), x)


def flatten_reference(x, start_axis=1, stop_axis=-1):
    s, e = start_axis % x.ndim, stop_axis % x.ndim
    shape = x.shape[:s] + (math.prod(x.shape[s:e + 1]),) + x.shape[e + 1:]
    return {"out": np.array(x.ravel().tolist()).reshape(shape)}


@pytest.mark.parametrize("x_shape, attrs", [
    ((2, 3, 4, 5), {}), ((2, 3, 4, 5), {"start_axis": 0}), ((2, 3, 4, 5), {"stop_axis": 2}),
    ((2, 3, 4, 5), {"start_axis": 1, "stop_axis": 2}), ((2, 3, 4, 5), {"start_axis": -2}),
    ((2, 3, 4, 5), {"start_axis": 2, "stop_axis": 2}), ((7,), {"start_axis": 0}),
    ((2, 3), {"start_axis": -1, "stop_axis": -1}),
])
def test_flatten_forward_and_grad(x_shape, attrs):
    got = helper_test_op("flatten", {"x": rng.standard_normal(x_shape)}, attrs,
                         flatten_reference, grad_wrt=("x",))
    assert got["out"].shape == flatten_reference(np.zeros(x_shape), **attrs)["out"].shape


def transpose_reference(x, perm):
    out = np.empty(tuple(x.shape[p] for p in perm))
    for idx in np.ndindex(x.shape):
        out[tuple(idx[p] for p in perm)] = x[idx]
    return {"out": out}


def test_the_bound_form_copies_a_contiguous_x_and_leaves_the_rest_to_the_kernel():
    """reshape's and flatten's bound form (minigraph.bound_run): the kernel's copy into
    one kept array, new values of the same x read anew; None for a non-contiguous x
    (x.reshape would copy it when prepared, and later values would go unread)."""
    from minigraph.kernels.cpu import shape_ops

    scope = mg.Scope()
    op = mg.Operator("flatten", x=scope.new_var("x"), out=scope.new_var("out"))
    run = shape_ops.bind_reshape(op)
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    first = run({"x": x})["out"]
    x *= 2
    again = run({"x": x})["out"]
    assert again is first and np.array_equal(again, x.reshape(2, 12))
    assert run({"x": x.transpose(0, 2, 1)}) is None


@pytest.mark.parametrize("x_shape, perm", [
    ((2, 3, 4), (0, 1, 2)), ((2, 3, 4), (2, 0, 1)), ((2, 3, 4), (1, 0, 2)), ((3, 5), (1, 0)),
    ((2, 3, 4, 5), (0, 2, 3, 1)), ((4,), (0,)), ((), ()),
])
def test_transpose_forward_and_grad(x_shape, perm):
    got = helper_test_op("transpose", {"x": rng.standard_normal(x_shape)}, {"perm": perm},
                         transpose_reference, grad_wrt=("x",))
    assert got["out"].flags.c_contiguous


def test_transpose_identity_is_a_copy_float32():
    x = rng.standard_normal((3, 4)).astype("float32")
    scope = mg.Scope()
    xv, out = scope.new_var("x"), scope.new_var("out")
    xv.set(x)
    mg.Executor().run([mg.Operator("transpose", x=xv, out=out, perm=[0, 1])], scope)
    assert out.get().dtype == np.float32 and not np.shares_memory(out.get(), x)
    np.testing.assert_array_equal(out.get(), x)


def declared(shape, dtype="float32"):
    scope = mg.Scope()
    x = scope.new_var("x")
    x.declare(shape, np.dtype(dtype))
    return scope, x


def out_shape(op_type, x_shape, **attrs):
    scope, x = declared(x_shape)
    out = scope.new_var("out")
    mg.Operator(op_type, x=x, out=out, **attrs)
    return out.shape


@pytest.mark.parametrize("op_type, x_shape, attrs, want", [
    ("reshape", (-1, 3, 4), {"shape": (-1, 12)}, (-1, 12)),
    ("reshape", (-1, 3, 4), {"shape": (-1,)}, (-1,)),
    ("reshape", (-1, 3, 4), {"shape": (2, 24)}, (2, 24)),
    ("reshape", (2, 3, 4), {"shape": (-1, 6)}, (4, 6)),
    ("flatten", (-1, 3, 4, 5), {}, (-1, 60)),
    ("flatten", (-1, 3, 4, 5), {"start_axis": 0, "stop_axis": 1}, (-1, 4, 5)),
    ("flatten", (2, -1, 4), {"start_axis": 2}, (2, -1, 4)),
    ("transpose", (-1, 3, 4), {"perm": (2, 0, 1)}, (4, -1, 3)),
])
def test_infer_with_unknown_dims(op_type, x_shape, attrs, want):
    assert out_shape(op_type, x_shape, **attrs) == want


@pytest.mark.parametrize("op_type, x_shape, attrs, match", [
    ("reshape", (2, 3), {"shape": (4,)}, r"reshape: input 'x' with shape \(2, 3\) cannot be "
                                         r"reshaped to attribute 'shape' \(4,\): 6 values vs 4"),
    ("reshape", (2, 3), {"shape": (4, -1)}, r"reshape: input 'x' with shape \(2, 3\) .* 6 values "
                                            r"are not a multiple of 4"),
    ("reshape", (-1, 3), {"shape": (4, 5)}, r"reshape: input 'x' with shape \(-1, 3\) cannot"),
    ("reshape", (2, 3), {"shape": (-1, -1)}, r"reshape: attribute 'shape' must be a tuple of "
                                             r"ints, each > 0 or -1, with at most one -1"),
    ("reshape", (2, 3), {"shape": (0, 6)}, r"reshape: attribute 'shape' must be"),
    ("reshape", (2, 3), {"shape": (2.0, 3)}, r"reshape: attribute 'shape' must be"),
    ("reshape", (2, 3), {}, r"reshape: missing attribute 'shape'"),
    ("flatten", (2, 3), {"start_axis": 2}, r"flatten: attribute 'start_axis' must be in "
                                           r"\[-2, 2\) for input 'x' of rank 2, got 2"),
    ("flatten", (2, 3), {"stop_axis": -3}, r"flatten: attribute 'stop_axis' must be in"),
    ("flatten", (2, 3, 4), {"start_axis": 2, "stop_axis": 1},
     r"flatten: attribute 'start_axis' \(2\) must not come after attribute 'stop_axis' \(1\)"),
    ("flatten", (), {}, r"flatten: input 'x' must have rank >= 1"),
    ("transpose", (2, 3), {"perm": (0, 2)}, r"transpose: attribute 'perm' must be a "
                                            r"permutation of range\(2\)"),
    ("transpose", (2, 3), {"perm": (0, 0)}, r"transpose: attribute 'perm' must be a permutation"),
    ("transpose", (2, 3), {"perm": (0, 1, 2)}, r"transpose: attribute 'perm' \(0, 1, 2\) must be "
                                               r"a permutation of range\(2\) for input 'x' of "
                                               r"rank 2"),
    ("transpose", (2, 3), {}, r"transpose: missing attribute 'perm'"),
])
def test_bad_inputs_name_the_op_and_attribute(op_type, x_shape, attrs, match):
    with pytest.raises(mg.OpError, match=match):
        out_shape(op_type, x_shape, **attrs)


def test_reshape_runtime_size_mismatch():
    scope, x = declared((-1, 4))
    out = scope.new_var("out")
    op = mg.Operator("reshape", x=x, out=out, shape=(-1, 3))
    x.set(np.zeros((2, 4), dtype="float32"))
    with pytest.raises(mg.OpError, match=r"reshape: input 'x' with shape \(2, 4\) .* 8 values "
                                         r"are not a multiple of 3"):
        mg.Executor().run([op], scope)


def test_flatten_and_reshape_share_reshape_grad():
    from minigraph.schema import get_schema

    for op_type in ("reshape", "flatten"):
        assert get_schema(op_type).grad.grad_type == "reshape_grad"
    assert get_schema("transpose").grad.grad_type == "transpose_grad"
