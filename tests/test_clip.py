"""clip_by_global_norm against torch.nn.utils.clip_grad_norm_'s rule."""
import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg

rng = np.random.default_rng(5)


def clip_reference(x, max_norm=1.0):
    total = np.sqrt(sum(float((a * a).sum()) for a in x))
    coef = min(max_norm / (total + 1e-6), 1.0)
    return {"out": [a * coef for a in x]}


@pytest.mark.parametrize("max_norm", [0.5, 1.0, 100.0])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_clip(max_norm, dtype):
    xs = [rng.standard_normal(s).astype(dtype) for s in ((3, 4), (5,), ())]
    got = helper_test_op("clip_by_global_norm", {"x": xs}, {"max_norm": max_norm},
                         clip_reference)
    norm = np.sqrt(sum(float((g.astype(np.float64) ** 2).sum()) for g in got["out"]))
    assert norm <= max_norm * (1 + 1e-5)
    if max_norm == 100.0:                      # below the limit: unchanged
        for a, b in zip(xs, got["out"]):
            np.testing.assert_array_equal(a, b)


def test_clip_bad_inputs():
    scope = mg.Scope()
    a, b = scope.new_var("a"), scope.new_var("b")
    a.set(np.ones(3))
    b.set(np.ones(3))
    with pytest.raises(mg.OpError, match="clip_by_global_norm: attribute 'max_norm' must be > 0"):
        mg.Operator("clip_by_global_norm", x=[a], out=[a], max_norm=0.0)
    with pytest.raises(mg.OpError, match="'x' has 2 Variables but 'out' has 1"):
        mg.Operator("clip_by_global_norm", x=[a, b], out=[a])
    b.set(np.ones(3, np.int64))
    with pytest.raises(mg.OpError, match=r"clip_by_global_norm: input 'x\[1\]' must be a float"):
        mg.Operator("clip_by_global_norm", x=[a, b], out=[a, b])


@pytest.mark.parametrize("native", ["1", "0"])
def test_clip_norm_native_and_numpy(monkeypatch, native):
    """The norm from the native sum of squares and from numpy's agree: the same
    factor to float64 rounding, and a factor of 1 passes the gradients on as they are."""
    monkeypatch.setenv("MINIGRAPH_NATIVE", native)
    xs = [rng.standard_normal(s).astype(np.float32) for s in ((300, 70), (513,), ())]
    total = np.sqrt(sum(float((a.astype(np.float64) ** 2).sum()) for a in xs))
    got = helper_test_op("clip_by_global_norm", {"x": xs}, {"max_norm": total / 2},
                         clip_reference)
    for a, b in zip(xs, got["out"]):
        np.testing.assert_allclose(b, a * np.float32(0.5), rtol=1e-6)
    kept = helper_test_op("clip_by_global_norm", {"x": xs}, {"max_norm": total * 2},
                          clip_reference)
    for a, b in zip(xs, kept["out"]):
        np.testing.assert_array_equal(a, b)
