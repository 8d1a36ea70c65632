"""The errors a user can run into with batch_norm: ranks, shapes and dtypes of its
inputs, one value per channel in training, batch statistics that are not finite,
unknown and missing slots or attributes, immutable attributes, in-place pairs and
attribute values. Each names the op, the slot or attribute and what was expected; a
batch whose statistics are not finite leaves the estimates and the counter as they
were. (Split from test_batch_norm.py, whose BN and data build the cases.)"""
import numpy as np
import pytest
from test_batch_norm import BN, data

import minigraph as mg
from minigraph import OpError


def build(x, layout=None, **kw):
    """Build (and run) a batch_norm op on x with 3-channel float32 parameters overridden by kw."""
    scope = mg.Scope()
    vals = {"x": x, "estimated_mean": np.zeros(3, np.float32),
            "estimated_var": np.ones(3, np.float32), "scale": np.ones(3, np.float32),
            "bias": np.zeros(3, np.float32)}
    slots = {}
    for name, value in vals.items():
        slots[name] = scope.new_var(name)
        slots[name].set(kw.pop(name, value))
    for name in ("y", "batch_mean", "batch_var"):
        slots[name] = scope.new_var(name)
    slots["saved_mean"] = kw.pop("saved_mean", slots["estimated_mean"])
    slots["saved_var"] = slots["estimated_var"]
    if layout is not None:
        kw["data_layout"] = layout
    op = mg.Operator("batch_norm", **slots, **kw)
    mg.Executor(mg.CPUPlace()).run([op], scope)
    return op, scope


@pytest.mark.parametrize("shape", [(3,), (2, 3, 1, 1, 1, 1)])
def test_wrong_rank(shape):
    with pytest.raises(OpError, match=rf"batch_norm: input 'x' must have rank 2 to 5, "
                                      rf"got rank {len(shape)}"):
        build(np.ones(shape, np.float32))


def test_channel_mismatch():
    with pytest.raises(OpError, match=r"batch_norm: input 'scale' must have shape \(3,\) to "
                                      r"match the 3 channels of input 'x'.*got \(4,\)"):
        build(np.ones((4, 3), np.float32), scale=np.ones(4, np.float32))


def test_channel_mismatch_nhwc_names_the_layout():
    with pytest.raises(OpError, match=r"input 'bias' must have shape \(5,\) .*NHWC"):
        build(np.ones((4, 2, 5), np.float32), "NHWC",
              **{k: np.ones(5, np.float32) for k in ("estimated_mean", "estimated_var",
                                                     "scale")})


def test_dtype_mismatch():
    with pytest.raises(OpError, match=r"batch_norm: input 'scale' has dtype float64 but input "
                                      r"'x' has float32"):
        build(np.ones((4, 3), np.float32), scale=np.ones(3, np.float64))


@pytest.mark.parametrize("shape", [(1, 3), (1, 3, 1, 1)])
def test_one_value_per_channel_in_training(shape):
    with pytest.raises(OpError, match=r"batch_norm: training needs more than one value per "
                                      r"channel, got n=1"):
        build(np.ones(shape, np.float32))


def test_one_value_per_channel_is_fine_for_inference():
    op, scope = build(np.full((1, 3), 2.0, np.float32), is_infer=True)
    np.testing.assert_allclose(scope.find_var("y").get(), np.full((1, 3), 2.0 / np.sqrt(1 + 1e-5)),
                               rtol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_batch_leaves_estimates_and_counter(bad):
    x = data((6, 3, 4), np.float32)
    x[2, 1, 3] = bad
    bn = BN(x, counter=3)
    before = bn.state()
    with pytest.raises(OpError, match=r"^batch_norm: the batch statistics are not finite"):
        bn.run()
    assert bn.state() == before


def test_huge_batch_variance_does_not_overflow_the_estimates():
    x = np.array([[-3e38, 3e38], [3e38, -3e38]], np.float32)
    bn = BN(x, "NCHW", counter=0, est=([0.0, 0.0], [1.0, 1.0]), params=([1, 1], [0, 0]))
    before = bn.state()
    with pytest.raises(OpError, match=r"^batch_norm: .*not finite"):
        bn.run()
    assert bn.state() == before


def test_unknown_slot_lists_valid_names():
    with pytest.raises(OpError, match=r"batch_norm: unknown slot or attribute 'X'; valid names: "
                                      r"x, estimated_mean, .*saved_num_batches, is_infer, "
                                      r"use_global_est, epsilon, momentum, data_layout"):
        build(np.ones((4, 3), np.float32), X=mg.Scope().new_var("other"))


def test_unknown_attribute_lists_valid_names():
    with pytest.raises(OpError, match=r"unknown slot or attribute 'eps'; valid names: .*epsilon"):
        build(np.ones((4, 3), np.float32), eps=1e-3)


def test_missing_slot_lists_valid_names():
    scope = mg.Scope()
    x = scope.new_var("x")          # the estimates, scale and bias are optional; y is not
    with pytest.raises(OpError, match=r"batch_norm: missing slot 'y'; valid names: x, "
                                      r"estimated_mean"):
        mg.Operator("batch_norm", x=x)


def test_attributes_are_immutable():
    op, _ = build(np.ones((4, 3), np.float32))
    with pytest.raises(TypeError, match=r"batch_norm: attributes are immutable .*'is_infer'"):
        op.attrs["is_infer"] = True
    assert op.attrs["is_infer"] is False


def test_bad_inplace_pair():
    other = mg.Scope().new_var("elsewhere")
    with pytest.raises(OpError, match=r"batch_norm: output 'saved_mean' must be the same Variable "
                                      r"as input 'estimated_mean'.*elsewhere"):
        build(np.ones((4, 3), np.float32), saved_mean=other)


@pytest.mark.parametrize("attrs, message", [
    ({"epsilon": 0.0}, r"attribute 'epsilon' must be > 0, got 0.0"),
    ({"epsilon": -1e-5}, r"attribute 'epsilon' must be > 0"),
    ({"momentum": 1.5}, r"attribute 'momentum' must be in \[0, 1\] .*or None .*got 1.5"),
    ({"momentum": -0.1}, r"attribute 'momentum' must be in \[0, 1\]"),
    ({"momentum": "fast"}, r"attribute 'momentum' must be float or int or None, got str"),
    ({"data_layout": "NCWH"}, r"attribute 'data_layout' must be one of 'NCHW', 'NHWC', "
                              r"got 'NCWH'"),
    ({"epsilon": "a"}, r"attribute 'epsilon' must be float .*got str 'a'"),
    ({"is_infer": 1}, r"attribute 'is_infer' must be bool, got int 1"),
])
def test_bad_attribute_values(attrs, message):
    with pytest.raises(OpError, match=r"^batch_norm: " + message):
        build(np.ones((4, 3), np.float32), **attrs)
