"""add_inplace and fill_inplace: a persistable's running sum and its reset, written in
place (the same array, or on the CPU the training step's spare), with sum's bits."""
import numpy as np
import pytest
from helpers import helper_test_op, spying

import minigraph as mg
from minigraph.schema import OpError

rng = np.random.default_rng(0)


def add_reference(x, y):
    return {"x_out": x + y}


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (64, 1031)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_add_inplace(shape, dtype):
    helper_test_op("add_inplace", {"x": rng.standard_normal(shape).astype(dtype),
                                   "y": rng.standard_normal(shape).astype(dtype)},
                   {}, add_reference)


@pytest.mark.parametrize("dtype,value", [(np.float32, 0.0), (np.float64, -2.5),
                                         (np.int64, 7.9), (np.bool_, 0.5)])
def test_fill_inplace(dtype, value):
    x = (rng.standard_normal((4, 6)) * 5).astype(dtype)
    helper_test_op("fill_inplace", {"x": x}, {"value": value},
                   lambda x, value: {"x_out": np.full(x.shape, value, dtype=dtype)})


def test_both_write_x_itself_and_add_as_sum_does():
    scope = mg.Scope()
    x, y, total = scope.new_var("x"), scope.new_var("y"), scope.new_var("total")
    start = rng.standard_normal((64, 1031)).astype(np.float32)     # the threaded add's size
    step = rng.standard_normal((64, 1031)).astype(np.float32)
    x.set(start.copy())
    y.set(step)
    array = x.value
    mg.Executor().run([mg.Operator("add_inplace", x=x, y=y, x_out=x),
                       mg.Operator("sum", x=[x, y], out=total)], scope)
    assert x.value is array
    np.testing.assert_array_equal(array, start + step)
    np.testing.assert_array_equal(total.value, array + step)    # sum of the new x: same bits
    mg.Executor().run([mg.Operator("fill_inplace", x=x, x_out=x, value=0.0)], scope)
    assert x.value is array and not array.any()


def test_a_training_step_writes_the_spare_and_a_failed_step_changes_nothing():
    failing = []

    def fails_when_told(fn):
        def spy(op, ins, ctx):
            out = fn(op, ins, ctx)
            if failing:
                raise RuntimeError("injected")
            return out
        return spy

    with spying("fill_inplace", fails_when_told):
        net = mg.Net(seed=0)
        x = mg.layers.data(net, "x", (-1, 3), "float64")
        loss = mg.layers.mean(net, mg.layers.fc(net, x, 2, name="fc"))
        opt = mg.optimizer.GradientMerge(mg.optimizer.SGD(0.1), 2)
        opt.minimize(net, loss)
        total = opt.merged[0]
        feed = {"x": rng.standard_normal((4, 3))}
        net.train(feed=feed)
        first = total.value
        before = first.copy()
        assert before.any()
        net.train(feed=feed)                    # the update step: summed, used, zeroed
        assert not total.value.any()
        np.testing.assert_array_equal(first, before)   # written into a spare, not into x
        net.train(feed=feed)
        kept = {v.name: v.get().copy() for v in net.parameters() + opt.merged}
        failing.append(True)
        with pytest.raises(RuntimeError, match="injected"):
            net.train(feed=feed)                # fails after the sums were added and used
    for v in net.parameters() + opt.merged:
        np.testing.assert_array_equal(v.get(), kept[v.name], err_msg=v.name)


def test_bad_inputs_name_the_op_and_the_slot():
    scope = mg.Scope()
    x, y = scope.new_var("x"), scope.new_var("y")
    x.set(np.zeros((2, 3), np.float32))
    for value, want in ((np.zeros((3, 2), np.float32), "add_inplace: input 'y'.*shape"),
                        (np.zeros((2, 3), np.float64), "add_inplace: input 'y'.*dtype")):
        y.set(value)
        with pytest.raises(OpError, match=want):
            mg.Executor().run([mg.Operator("add_inplace", x=x, y=y, x_out=x)], scope)
    with pytest.raises(OpError, match="add_inplace: output 'x_out' must be the same Variable"):
        mg.Operator("add_inplace", x=x, y=y, x_out=y)
    x.set(np.zeros((2, 3), np.int64))
    y.set(np.zeros((2, 3), np.int64))
    with pytest.raises(OpError, match="add_inplace: input 'x' must be a float"):
        mg.Executor().run([mg.Operator("add_inplace", x=x, y=y, x_out=x)], scope)
    x.set(np.array(["a"]))
    with pytest.raises(OpError, match="fill_inplace: input 'x' must be a bool, int or float"):
        mg.Executor().run([mg.Operator("fill_inplace", x=x, x_out=x)], scope)
    assert mg.schema.get_schema("add_inplace").grad is None
