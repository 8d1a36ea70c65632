"""argmax (first maximum, int64) and accuracy (float32 fraction of argmax == label)."""
import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg
from minigraph.schema import get_schema

rng = np.random.default_rng(7)


def argmax_reference(x, axis=-1):
    moved = np.moveaxis(x, axis, -1)
    out = np.empty(moved.shape[:-1], dtype=np.int64)
    for idx in np.ndindex(moved.shape[:-1]):
        row = list(moved[idx])
        out[idx] = row.index(max(row))            # the first maximum
    return {"out": out}


@pytest.mark.parametrize("shape, axis", [((6,), -1), ((6,), 0), ((3, 5), -1), ((3, 5), 0),
                                         ((2, 3, 4), 1), ((2, 3, 4), -1), ((2, 3, 4), 0)])
def test_argmax(shape, axis):
    got = helper_test_op("argmax", {"x": rng.standard_normal(shape)}, {"axis": axis},
                         argmax_reference)
    assert got["out"].dtype == np.int64


def test_argmax_ties_take_the_first_max():
    x = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [-1.0, -5.0, -1.0, -2.0]],
                 dtype="float32")
    got = helper_test_op("argmax", {"x": x}, {}, argmax_reference)
    assert got["out"].tolist() == [1, 0, 0]
    assert helper_test_op("argmax", {"x": x}, {"axis": 0})["out"].tolist() == [1, 0, 0, 1]


def test_argmax_has_no_gradient_and_infers_shape():
    assert get_schema("argmax").grad is None
    scope = mg.Scope()
    x, out = scope.new_var("x"), scope.new_var("out")
    x.declare((-1, 3, 4), np.dtype("float32"))
    mg.Operator("argmax", x=x, out=out, axis=1)
    assert out.shape == (-1, 4) and out.dtype == np.int64


@pytest.mark.parametrize("shape, dtype, axis, match", [
    ((3, 4), "float32", 2, r"argmax: attribute 'axis' must be in \[-2, 2\) for input 'x'"),
    ((), "float32", -1, r"argmax: input 'x' must have rank >= 1"),
    ((3, 4), "int64", -1, r"argmax: input 'x' must be a float tensor"),
    ((3, 0), "float32", -1, r"argmax: input 'x' has no values along axis -1"),
])
def test_argmax_bad_inputs(shape, dtype, axis, match):
    scope = mg.Scope()
    x = scope.new_var("x")
    x.declare(shape, np.dtype(dtype))
    with pytest.raises(mg.OpError, match=match):
        mg.Operator("argmax", x=x, out=scope.new_var("out"), axis=axis)


def accuracy_reference(logits, label):
    hits = [argmax_reference(row)["out"] == lab for row, lab in zip(logits, label)]
    return {"out": np.array(sum(hits) / len(hits) if hits else np.nan)}


def test_accuracy():
    logits = rng.standard_normal((50, 7))
    label = rng.integers(0, 7, 50)
    label[:10] = logits[:10].argmax(axis=1)
    got = helper_test_op("accuracy", {"logits": logits.astype("float32"), "label": label}, {},
                         accuracy_reference)
    assert got["out"].dtype == np.float32 and got["out"].shape == ()
    assert got["out"] >= 0.2


def test_accuracy_ties_and_float64_logits():
    logits = np.array([[1.0, 1.0, 0.0], [0.0, 2.0, 2.0], [5.0, 5.0, 5.0], [0.0, 0.0, 1.0]])
    label = np.array([1, 1, 0, 2])
    assert accuracy_reference(logits, label)["out"] == 0.75
    # float64 logits still give a float32 score (so no reference: the helper wants x's dtype)
    got = helper_test_op("accuracy", {"logits": logits, "label": label})
    assert got["out"] == np.float32(0.75) and got["out"].dtype == np.float32
    got = helper_test_op("accuracy", {"logits": logits.astype("float32"), "label": label}, {},
                         accuracy_reference)


def test_accuracy_no_rows_is_nan():
    got = helper_test_op("accuracy", {"logits": np.zeros((0, 3), "float32"),
                                      "label": np.zeros(0, np.int64)})
    assert np.isnan(got["out"]) and got["out"].dtype == np.float32


@pytest.mark.parametrize("bad", [3, -1])
def test_accuracy_bad_label_value(bad):
    scope = mg.Scope()
    lg, lb, out = scope.new_var("logits"), scope.new_var("label"), scope.new_var("out")
    lg.set(np.zeros((4, 3), "float32"))
    lb.set(np.array([0, 1, bad, 2]))
    op = mg.Operator("accuracy", logits=lg, label=lb, out=out)
    with pytest.raises(mg.OpError, match=rf"accuracy: input 'label' has value {bad} at row 2, "
                                         r"outside \[0, 3\)"):
        mg.Executor().run([op], scope)


@pytest.mark.parametrize("lg_shape, lg_dtype, lb_shape, lb_dtype, match", [
    ((4, 3), "float32", (4,), "int32", r"accuracy: input 'label' must have dtype int64"),
    ((4, 3), "float32", (4,), "float32", r"accuracy: input 'label' must have dtype int64"),
    ((4, 3), "float32", (5,), "int64", r"accuracy: input 'label' must have shape \(4,\)"),
    ((4, 3), "float32", (4, 1), "int64", r"accuracy: input 'label' must have shape \(4,\)"),
    ((4,), "float32", (4,), "int64", r"accuracy: input 'logits' must have rank 2"),
    ((4, 3), "int64", (4,), "int64", r"accuracy: input 'logits' must be a float tensor"),
])
def test_accuracy_bad_inputs(lg_shape, lg_dtype, lb_shape, lb_dtype, match):
    scope = mg.Scope()
    lg, lb = scope.new_var("logits"), scope.new_var("label")
    lg.declare(lg_shape, np.dtype(lg_dtype))
    lb.declare(lb_shape, np.dtype(lb_dtype))
    with pytest.raises(mg.OpError, match=match):
        mg.Operator("accuracy", logits=lg, label=lb, out=scope.new_var("out"))


def test_accuracy_infers_with_unknown_batch():
    scope = mg.Scope()
    lg, lb, out = scope.new_var("logits"), scope.new_var("label"), scope.new_var("out")
    lg.declare((-1, 10), np.dtype("float32"))
    lb.declare((-1,), np.dtype("int64"))
    mg.Operator("accuracy", logits=lg, label=lb, out=out)
    assert out.shape == () and out.dtype == np.float32
    assert get_schema("accuracy").grad is None
