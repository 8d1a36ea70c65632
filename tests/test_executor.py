import numpy as np
import pytest

import minigraph as mg


def _bn_op(scope, C=3, **attrs):
    v = {}
    for name, value in dict(estimated_mean=np.zeros(C, np.float32),
                            estimated_var=np.ones(C, np.float32),
                            scale=np.ones(C, np.float32), bias=np.zeros(C, np.float32)).items():
        v[name] = scope.new_var(name, persistable=True)
        v[name].set(value)
    x = scope.new_var("x")
    x.declare((-1, C, 2, 2), "float32")
    y, bm, bv = (scope.new_var(n) for n in ("y", "batch_mean", "batch_var"))
    op = mg.Operator("batch_norm", x=x, y=y, batch_mean=bm, batch_var=bv,
                     saved_mean=v["estimated_mean"], saved_var=v["estimated_var"], **v, **attrs)
    return op, x, y


def test_run_feeds_fetches_numpy():
    scope = mg.Scope()
    op, x, y = _bn_op(scope)
    xb = np.random.default_rng(0).standard_normal((4, 3, 2, 2)).astype(np.float32)
    (out,) = mg.Executor(mg.CPUPlace()).run([op], scope, feed={"x": xb}, fetch=[y])
    assert isinstance(out, np.ndarray) and out.shape == xb.shape
    (same,) = mg.Executor().run([], scope, fetch=["y"])
    np.testing.assert_array_equal(out, same)


def test_feed_of_wrong_dtype_or_shape_is_a_clear_error():
    scope = mg.Scope()
    op, x, y = _bn_op(scope)
    ex = mg.Executor()
    with pytest.raises(TypeError, match=r"feed 'x': expected dtype float32, got float64"):
        ex.run([op], scope, feed={"x": np.zeros((4, 3, 2, 2))})
    with pytest.raises(ValueError, match=r"feed 'x': expected shape \(N, 3, 2, 2\), got \(4, 5, 2, 2\)"):
        ex.run([op], scope, feed={"x": np.zeros((4, 5, 2, 2), np.float32)})
    with pytest.raises(KeyError, match="feed 'nope'"):
        ex.run([op], scope, feed={"nope": np.zeros(1)})


def test_unset_input_names_the_op_slot_and_variable():
    scope = mg.Scope()
    op, x, y = _bn_op(scope)
    with pytest.raises(mg.OpError, match=r"batch_norm: input 'x' \(variable 'x'\) has no value"):
        mg.Executor().run([op], scope)


def test_fetch_of_unknown_or_empty_variable():
    scope = mg.Scope()
    scope.new_var("empty")
    with pytest.raises(KeyError, match="fetch 'ghost'"):
        mg.Executor().run([], scope, fetch=["ghost"])
    with pytest.raises(ValueError, match="'empty': the variable has no value"):
        mg.Executor().run([], scope, fetch=["empty"])


def test_runtime_shape_check_runs_when_input_shapes_change():
    scope = mg.Scope()
    op, x, y = _bn_op(scope)
    ex = mg.Executor()
    x.set(np.ones((4, 3, 2, 2), np.float32))
    ex.run([op], scope)
    for _ in range(2):              # a failed check is not remembered: it raises again
        x.value = np.ones((4, 3), np.float32)[:, :2]    # bypasses feed checks: the op checks
        with pytest.raises(mg.OpError,
                           match=r"batch_norm: input 'scale' must have shape \(2,\)"):
            ex.run([op], scope)
    x.value = np.ones((4, 3, 2, 2), np.float32)
    (out,) = ex.run([op], scope, fetch=[y])
    assert out.shape == (4, 3, 2, 2)


def test_signatures_run_before_skip_their_checks(monkeypatch):
    from minigraph import plan

    scope = mg.Scope()
    op, x, y = _bn_op(scope, is_infer=True, use_global_est=True)
    ex = mg.Executor()
    checks = []
    original = mg.Operator.check_inputs
    monkeypatch.setattr(mg.Operator, "check_inputs",
                        lambda self, arrays: (checks.append(arrays["x"].shape),
                                              original(self, arrays))[1])
    shapes = [(n, 3, 2, 2) for n in range(1, plan.CHECKED_SIGNATURES + 2)]
    for shape in shapes[:2] * 3:                        # alternating: each checked once
        ex.run([op], scope, feed={"x": np.ones(shape, np.float32)}, fetch=[y])
    assert checks == shapes[:2]
    for shape in shapes[2:]:                            # the oldest, (1, 3, 2, 2), forgotten
        ex.run([op], scope, feed={"x": np.ones(shape, np.float32)}, fetch=[y])
    checks.clear()
    for shape in (shapes[0], shapes[-1], shapes[0]):
        ex.run([op], scope, feed={"x": np.ones(shape, np.float32)}, fetch=[y])
    assert checks == shapes[:1]

