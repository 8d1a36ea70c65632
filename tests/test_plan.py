"""Compiled plans' memory of checked signatures (Compiled.recall / remember)."""
import numpy as np

import minigraph as mg
from minigraph import plan


def _compiled():
    scope = mg.Scope()
    x, y = scope.new_var("x"), scope.new_var("y")
    x.declare((-1, 3), "float32")
    op = mg.Operator("relu", x=x, out=y)
    return plan.Plan([op]).compiled(mg.CPUPlace())


def test_recall_puts_back_the_kernels_and_rooms_of_a_checked_signature():
    c = _compiled()
    assert not c.recall("a")
    c.kernels[:] = ["kernel of a"]
    c.roomy = ("rooms of a",)
    c.remember("a")
    c.kernels[:] = ["kernel of b"]
    c.roomy = None
    c.bound = "forms made for b's kernels"
    c.remember("b")
    assert c.recall("a")
    assert c.kernels == ["kernel of a"] and c.roomy == ("rooms of a",)
    assert c.bound is None                      # made for other kernels: made again
    c.bound = "forms made for a's kernels"
    c.kernels[:] = ["kernel of a"]
    assert c.recall("a") and c.bound == "forms made for a's kernels"   # same kernels: kept


def test_the_kernels_in_use_stay_until_another_signature_runs():
    c = _compiled()
    c.kernels[:] = ["kernel of a"]
    c.remember("a")
    c.kernels[:] = ["a profiler's timer around a's kernel"]
    assert c.recall("a") and c.kernels == ["a profiler's timer around a's kernel"]
    assert not c.recall("c")                    # its checked run picks anew, and fails:
    c.kernels[:] = ["kernel of c"]
    assert c.recall("a") and c.kernels == ["kernel of a"]


def test_remember_keeps_the_last_signatures():
    c = _compiled()
    for i in range(plan.CHECKED_SIGNATURES + 1):
        c.remember(i)
    assert not c.recall(0)
    assert all(c.recall(i) for i in range(1, plan.CHECKED_SIGNATURES + 1))
    c.remember(1)                               # remembered again: now the newest
    c.remember("new")
    assert c.recall(1) and not c.recall(2)


def test_a_run_of_a_remembered_signature_gives_the_same_values():
    scope = mg.Scope()
    x, y = scope.new_var("x"), scope.new_var("y")
    x.declare((-1, 3), "float32")
    op = mg.Operator("relu", x=x, out=y)
    ex = mg.Executor()
    a = np.arange(-3, 3, dtype=np.float32).reshape(2, 3)
    b = np.arange(-6, 6, dtype=np.float32).reshape(4, 3)
    for _ in range(2):
        (ya,) = ex.run([op], scope, feed={"x": a}, fetch=[y])
        (yb,) = ex.run([op], scope, feed={"x": b}, fetch=[y])
        np.testing.assert_array_equal(ya, np.maximum(a, 0))
        np.testing.assert_array_equal(yb, np.maximum(b, 0))
