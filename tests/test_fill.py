"""fill_constant, uniform_random, gaussian_random."""
import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg


def build(op_type, **attrs):
    return mg.Operator(op_type, out=mg.Scope().new_var("out"), **attrs)


def test_fill_constant_float32_by_default():
    got = helper_test_op("fill_constant", {}, {"shape": (2, 3), "value": 1.5},
                         lambda shape, value: {"out": np.full(shape, value)})
    assert got["out"].dtype == np.float32


def test_fill_constant_int64_scalar():
    got = helper_test_op("fill_constant", {}, {"shape": [], "dtype": "int64", "value": 7},
                         lambda shape, dtype, value: {"out": np.array(7)})
    assert got["out"].dtype == np.int64 and got["out"].shape == ()


def test_fill_attrs_are_canonical():
    op = build("fill_constant", shape=[np.int64(2), 3], dtype="float")
    assert op.attrs["shape"] == (2, 3) and all(type(d) is int for d in op.attrs["shape"])
    assert op.attrs["dtype"] == "float64"
    assert op.outputs["out"].decl_shape == (2, 3)


def uniform_reference(shape, seed, min=-1.0, max=1.0, dtype="float32"):
    return {"out": np.random.default_rng(seed).uniform(min, max, shape).astype(dtype)}


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_uniform_random_is_seeded(dtype):
    attrs = {"shape": (50, 40), "min": -2.0, "max": 3.0, "seed": 5, "dtype": dtype}
    a = helper_test_op("uniform_random", {}, attrs, uniform_reference)["out"]
    b = helper_test_op("uniform_random", {}, attrs, uniform_reference)["out"]
    c = helper_test_op("uniform_random", {}, {**attrs, "seed": 6})["out"]
    assert a.dtype == dtype
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a.min() >= -2.0 and a.max() < 3.0
    assert abs(a.mean() - 0.5) < 0.1 and abs(a.std() - 5 / 12 ** 0.5) < 0.1


def test_gaussian_random_is_seeded_with_mean_and_std():
    attrs = {"shape": (20000,), "mean": 3.0, "std": 0.5, "seed": 1}
    a = helper_test_op("gaussian_random", {}, attrs, lambda shape, mean, std, seed: {
        "out": np.random.default_rng(seed).normal(mean, std, shape)})["out"]
    assert a.dtype == np.float32
    assert abs(a.mean() - 3.0) < 0.02 and abs(a.std() - 0.5) < 0.02
    np.testing.assert_array_equal(a, helper_test_op("gaussian_random", {}, attrs)["out"])


def test_fill_ops_have_no_grad():
    for op_type in ("fill_constant", "uniform_random", "gaussian_random"):
        assert mg.Operator(op_type, out=mg.Scope().new_var("o"), shape=(1,)).schema.grad is None


@pytest.mark.parametrize("op_type, attrs, match", [
    ("fill_constant", {}, "fill_constant: missing attribute 'shape'"),
    ("fill_constant", {"shape": (2, -1)}, r"attribute 'shape' must be a tuple of ints >= 0"),
    ("fill_constant", {"shape": (2,), "dtype": "nonsense"}, "'dtype' must name a numpy dtype"),
    ("uniform_random", {"shape": (2,), "dtype": "int64"}, "'dtype' must be a float dtype"),
    ("uniform_random", {"shape": (2,), "min": 1.0, "max": 0.0}, "'min' .* must be <= "),
    ("uniform_random", {"shape": (2,), "seed": -1}, "'seed' must be >= 0"),
    ("gaussian_random", {"shape": (2,), "std": -1.0}, "'std' must be >= 0"),
])
def test_bad_attrs(op_type, attrs, match):
    with pytest.raises(mg.OpError, match=match):
        build(op_type, **attrs)
