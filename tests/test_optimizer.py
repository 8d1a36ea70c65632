import numpy as np
import pytest

import minigraph as mg
from minigraph import layers


def _net(opt, seed=0):
    net = mg.Net(seed=seed)
    x = layers.data(net, "x", shape=(-1, 4), dtype="float64")
    loss = layers.mean(net, layers.fc(net, x, size=3, name="fc"))
    opt.minimize(net, loss)
    return net, loss


def test_sgd_step_is_param_minus_lr_times_grad():
    net, loss = _net(mg.optimizer.SGD(learning_rate=0.5))
    xb = np.arange(8.0).reshape(2, 4)
    net.initialize()
    w0 = net.var("fc.w").get().copy()
    net.train(feed={"x": xb})
    grad_w = np.repeat(xb.sum(axis=0)[:, None] / 6, 3, axis=1)
    np.testing.assert_allclose(net.var("fc.w").get(), w0 - 0.5 * grad_w)
    assert all(op.type == "sgd" for op in net.section("update")) and len(net.section("update")) == 2


def test_momentum_follows_pytorch_convention():
    net, loss = _net(mg.optimizer.Momentum(learning_rate=0.1, momentum=0.9))
    xb = np.ones((2, 4))
    net.initialize()
    b0 = net.var("fc.b").get().copy()
    g = np.full(3, 1 / 3)
    net.train(feed={"x": xb})
    net.train(feed={"x": xb})
    v1 = g
    v2 = 0.9 * v1 + g
    np.testing.assert_allclose(net.var("fc.b").get(), b0 - 0.1 * v1 - 0.1 * v2)
    np.testing.assert_allclose(net.var("fc.b.velocity").get(), v2)


def test_learning_rate_can_change_and_bad_values_are_rejected():
    opt = mg.optimizer.SGD(learning_rate=0.5)
    with pytest.raises(ValueError, match="call minimize"):
        opt.set_learning_rate(0.1)
    net, loss = _net(opt)
    net.initialize()
    opt.set_learning_rate(0.0)
    w0 = net.var("fc.w").get().copy()
    net.train(feed={"x": np.ones((2, 4))})
    np.testing.assert_array_equal(net.var("fc.w").get(), w0)
    with pytest.raises(ValueError, match="learning_rate must be > 0"):
        mg.optimizer.SGD(learning_rate=0)
    with pytest.raises(ValueError, match="momentum must be in"):
        mg.optimizer.Momentum(0.1, momentum=1.5)
