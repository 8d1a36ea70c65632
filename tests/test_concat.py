"""concat: np.concatenate along an axis; one concat_grad per input that needs a gradient."""
import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg

rng = np.random.default_rng(1)


def concat_reference(x, axis=0):
    ax = axis % x[0].ndim
    out = np.empty(x[0].shape[:ax] + (sum(a.shape[ax] for a in x),) + x[0].shape[ax + 1:])
    start = 0
    for a in x:
        idx = [slice(None)] * a.ndim
        idx[ax] = slice(start, start + a.shape[ax])
        out[tuple(idx)] = a
        start += a.shape[ax]
    return {"out": out}


def parts(n, axis, base=(2, 3, 4)):
    ax = axis % len(base)
    shapes = []
    for i in range(n):
        s = list(base)
        s[ax] = i + 1
        shapes.append(tuple(s))
    return [rng.standard_normal(s) for s in shapes]


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_concat_forward_and_grads(n, axis):
    helper_test_op("concat", {"x": parts(n, axis)}, {"axis": axis}, concat_reference,
                   grad_wrt=("x",))


def test_concat_default_axis_and_float32():
    xs = [a.astype("float32") for a in parts(3, 0)]
    got = helper_test_op("concat", {"x": xs}, {}, concat_reference)
    assert got["out"].dtype == np.float32 and got["out"].shape == (6, 3, 4)


def test_concat_int64_values():
    xs = [np.arange(6).reshape(2, 3), np.arange(3).reshape(1, 3)]
    got = helper_test_op("concat", {"x": xs}, {"axis": 0})
    np.testing.assert_array_equal(got["out"], np.concatenate(xs))


def grads_of(xs, axis, needs):
    """Run concat and the ops of its grad maker for the inputs flagged in `needs`."""
    scope = mg.Scope()
    vs = [scope.new_var(f"x{i}") for i in range(len(xs))]
    for v, a in zip(vs, xs):
        v.set(a)
    out = scope.new_var("out")
    op = mg.Operator("concat", x=vs, out=out, axis=axis)
    mg.Executor().run([op], scope)
    dout = scope.new_var("dout")
    d = rng.standard_normal(out.get().shape)
    dout.set(d)
    made = {}

    def make_grad(v):
        i = vs.index(v)
        if not needs[i]:
            return None
        made[i] = scope.new_var(f"dx{i}")
        return made[i]

    descs = op.schema.grad(op, {"out": dout}, make_grad)
    mg.Executor().run([mg.Operator(g.type, **g.kwargs) for g in descs], scope)
    return d, descs, {i: v.get() for i, v in made.items()}


def test_only_inputs_needing_grads_get_grad_ops():
    xs = parts(3, 1)
    d, descs, got = grads_of(xs, 1, [True, False, True])
    assert [g.type for g in descs] == ["concat_grad", "concat_grad"]
    assert [g.kwargs["index"] for g in descs] == [0, 2]
    np.testing.assert_array_equal(got[0], d[:, 0:1])
    np.testing.assert_array_equal(got[2], d[:, 3:6])
    assert got[2].flags.c_contiguous and not np.shares_memory(got[2], d)
    assert grads_of(xs, 1, [False, False, False])[1] == []


def test_infer_with_unknown_dims():
    scope = mg.Scope()
    a, b, out = scope.new_var("a"), scope.new_var("b"), scope.new_var("out")
    a.declare((-1, 3), np.dtype("float32"))
    b.declare((-1, 5), np.dtype("float32"))
    mg.Operator("concat", x=[a, b], out=out, axis=1)
    assert out.shape == (-1, 8)
    out0 = scope.new_var("out0")
    c = scope.new_var("c")
    c.declare((4, 3), np.dtype("float32"))
    mg.Operator("concat", x=[a, c], out=out0, axis=0)
    assert out0.shape == (-1, 3)


def build(shapes, axis=0, dtypes=None):
    scope = mg.Scope()
    vs = []
    for i, s in enumerate(shapes):
        v = scope.new_var(f"x{i}")
        v.declare(s, np.dtype((dtypes or ["float64"] * len(shapes))[i]))
        vs.append(v)
    return mg.Operator("concat", x=vs, out=scope.new_var("out"), axis=axis)


@pytest.mark.parametrize("shapes, axis, dtypes, match", [
    ([(2, 3), (2, 4)], 0, None,
     r"concat: input 'x\[1\]' must match input 'x\[0\]' in every dim but axis 0"),
    ([(2, 3), (2, 3, 1)], 0, None, r"concat: input 'x\[1\]' must have the rank of input 'x\[0\]'"),
    ([(2, 3), (2, 3)], 2, None, r"concat: attribute 'axis' must be in \[-2, 2\) .* got 2"),
    ([(2, 3), (2, 3)], -3, None, r"concat: attribute 'axis' must be in \[-2, 2\)"),
    ([(2, 3), (2, 3)], 0, ["float64", "float32"],
     r"concat: input 'x\[1\]' has dtype float32 but input 'x\[0\]' has float64"),
    ([()], 0, None, r"concat: input 'x\[0\]' must have rank >= 1"),
    ([], 0, None, r"concat: input 'x' must hold at least one tensor"),
])
def test_bad_inputs_name_the_op_and_slot(shapes, axis, dtypes, match):
    with pytest.raises(mg.OpError, match=match):
        build(shapes, axis, dtypes)


def test_grad_index_out_of_range():
    scope = mg.Scope()
    xs = [scope.new_var("a"), scope.new_var("b")]
    for v in xs:
        v.set(np.zeros((2, 2)))
    d = scope.new_var("d")
    d.set(np.zeros((4, 2)))
    with pytest.raises(mg.OpError, match=r"concat_grad: attribute 'index' must be < 2"):
        mg.Operator("concat_grad", x=xs, dout=d, dx=scope.new_var("dx"), axis=0, index=2)
