"""The shared checks (minigraph/validators.py): one rule each, used by schemas, layers
and optimizers."""
import math

import numpy as np
import pytest

import minigraph as mg
from minigraph.schema import Meta
from minigraph.validators import (
    as_pair,
    check_number,
    check_rank,
    is_int,
    normalized_axis,
    out_size,
    pair_attr,
)


def test_is_int_takes_integers_but_not_bools():
    assert is_int(3) and is_int(np.int64(-2))
    assert not any(is_int(v) for v in (True, 2.0, "3", None))


@pytest.mark.parametrize("value, kwargs, complaint", [
    (True, {}, "must be a number, got bool True"),
    ("1", {}, "must be a number, got str '1'"),
    (math.nan, {}, r"must be a finite number in \[0, inf\), got nan"),
    (-0.5, {}, r"must be a finite number in \[0, inf\), got -0.5"),
    (1.0, dict(high=1.0, high_open=True), r"must be a finite number in \[0, 1\), got 1.0"),
    (0.0, dict(low_open=True), r"must be a finite number in \(0, inf\), got 0.0"),
])
def test_check_number_names_what_and_the_range(value, kwargs, complaint):
    with pytest.raises(ValueError, match="lr " + complaint):
        check_number(value, "lr", **kwargs)


def test_check_number_gives_a_float():
    assert check_number(np.float32(0.25), "lr") == 0.25
    assert type(check_number(1, "lr")) is float


def test_the_layers_and_optimizers_use_the_same_rule():
    with pytest.raises(ValueError, match=r"SGD: learning_rate must be a finite number"):
        mg.optimizer.SGD(learning_rate=math.inf)
    net = mg.Net()
    x = mg.layers.data(net, "x", shape=(-1, 3))
    with pytest.raises(ValueError, match=r"dropout: argument 'p' must be a finite number in "
                                         r"\[0, 1\), got 1"):
        mg.layers.dropout(net, x, p=1)


def test_pairs_axes_and_window_sizes():
    assert as_pair(3) == (3, 3) and as_pair([1, 2]) == (1, 2) and as_pair(None) is None
    check = pair_attr("strides", 1, 1).check
    assert check((1, 2)) is None and check(2) is None
    assert check((1, 2, 3)) == "must be an int or a pair of ints" and check(0) == "must be >= 1"
    assert normalized_axis("op", -1, 3) == 2
    with pytest.raises(mg.OpError, match=r"op: attribute 'axis' must be in \[-3, 3\) for "
                                         r"input 'x' of rank 3, got 3"):
        normalized_axis("op", 3, 3)
    assert out_size(8, 3, 2, 1) == 4 and out_size(-1, 3, 1, 0) == -1
    assert out_size(7, 3, 1, 1, dilation=2) == 5


def test_shape_checks_name_the_op_and_the_slot():
    with pytest.raises(mg.OpError, match=r"conv: input 'x' must have rank 4, got rank 2"):
        check_rank("conv", "x", Meta((2, 3), np.dtype("float32")), (4,))
