import numpy as np
import pytest

import minigraph as mg
from minigraph import layers


def _forward_loss(net, loss, feed):
    ex = net.executor
    for name, value in feed.items():
        net.data_vars[name].set(value)
    ex.run(net.section("trunk") + net.section("train"))
    return float(loss.get())


def _numeric_grad(net, loss, feed, param, eps=1e-6, samples=6, seed=0):
    """Central differences on a few entries of `param`."""
    rng = np.random.default_rng(seed)
    value = param.value                    # the live array (get() gives a copy)
    flat = value.reshape(-1)
    idx = rng.choice(flat.size, size=min(samples, flat.size), replace=False)
    out = []
    for i in idx:
        old = flat[i]
        flat[i] = old + eps
        up = _forward_loss(net, loss, feed)
        flat[i] = old - eps
        down = _forward_loss(net, loss, feed)
        flat[i] = old
        out.append((up - down) / (2 * eps))
    return idx, np.array(out)


def test_whole_net_gradients_match_finite_differences_float64():
    net = mg.Net(seed=0)
    img = layers.data(net, "image", shape=(-1, 2, 6, 6), dtype="float64")
    lbl = layers.data(net, "label", shape=(-1,), dtype="int64")
    h = layers.conv2d(net, img, num_filters=4, filter_size=3, padding=1, stride=1)
    h = layers.batch_norm(net, h)
    h = layers.relu(net, h)
    h = layers.pool2d(net, h, 2, pool_type="avg")
    h = layers.fc(net, h, size=6)
    h = layers.batch_norm(net, h)
    logits = layers.fc(net, layers.relu(net, h), size=3)
    loss = layers.mean(net, layers.softmax_with_cross_entropy(net, logits, lbl))
    params_grads = mg.append_backward(net, loss)
    rng = np.random.default_rng(1)
    feed = {"image": rng.standard_normal((5, 2, 6, 6)), "label": rng.integers(0, 3, 5)}
    net.initialize()
    for v in net.parameters():                       # move off the trivial BN init
        v.set(v.get() + 0.1 * rng.standard_normal(v.shape))
    net.train(feed=feed)                             # forward + backward (no optimizer)
    grads = {p.name: g.get().copy() for p, g in params_grads}
    assert set(grads) == {p.name for p in net.parameters()}
    for p in net.parameters():
        idx, num = _numeric_grad(net, loss, feed, p)
        np.testing.assert_allclose(grads[p.name].reshape(-1)[idx], num, rtol=1e-5, atol=1e-7,
                                   err_msg=p.name)


def test_a_variable_read_by_two_ops_gets_the_sum_of_their_gradients():
    net = mg.Net(seed=0)
    x = layers.data(net, "x", shape=(-1, 3), dtype="float64")
    h = layers.fc(net, x, size=3, name="fc1")
    a = layers.relu(net, h)
    s = net.append("elementwise_add", {"x": a, "y": h}, {"out": "s"})["out"]  # h read twice
    loss = layers.mean(net, s)
    mg.append_backward(net, loss)
    assert [op.type for op in net.section("backward")].count("sum") == 1
    xb = np.array([[1.0, -2.0, 0.5], [0.3, 0.2, -1.0]])
    hv, dh = net.train(feed={"x": xb}, fetch=[h, net.grad(h)])   # temporaries: fetch them
    expected_dh = (1.0 + (hv > 0)) / hv.size
    np.testing.assert_allclose(dh, expected_dh)
    np.testing.assert_allclose(net.grad("fc1.b").get(), expected_dh.sum(axis=0))
    np.testing.assert_allclose(net.grad("fc1.w").get(), xb.T @ expected_dh)


def test_backward_only_reaches_what_needs_it_and_errors():
    net = mg.Net(seed=0)
    x = layers.data(net, "x", shape=(-1, 3))
    loss = layers.mean(net, layers.fc(net, x, size=2))
    other = layers.data(net, "other", shape=(-1,))
    mg.append_backward(net, loss)
    with pytest.raises(KeyError, match="no gradient for 'x'"):
        net.grad(x)                                   # data needs no gradient
    with pytest.raises(ValueError, match="already has a backward pass"):
        mg.append_backward(net, loss)
    net2 = mg.Net()
    layers.data(net2, "y", shape=(-1,))
    with pytest.raises(ValueError, match="is not computed by the train path"):
        mg.append_backward(net2, other)
