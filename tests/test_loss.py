"""sigmoid_cross_entropy_with_logits (ops/loss.py) against a float64 reference with
Python's math, gradients by finite differences; and the loss layers (mse, l1, huber,
binary cross entropy with logits; reductions) against numpy formulas through a net."""
import math

import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg
from minigraph import layers as L

rng = np.random.default_rng(0)
OP = "sigmoid_cross_entropy_with_logits"


def bce_reference(x, label):
    def one(v, y):
        p = 1.0 / (1.0 + math.exp(-v)) if v >= 0 else math.exp(v) / (1.0 + math.exp(v))
        # -(y log p + (1 - y) log(1 - p)), with log p and log(1 - p) formed stably
        log_p = -math.log1p(math.exp(-v)) if v >= 0 else v - math.log1p(math.exp(v))
        log_q = log_p - v
        assert 0.0 <= p <= 1.0
        return -(y * log_p + (1.0 - y) * log_q)
    return {"out": np.vectorize(one)(x, label)}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_bce_forward_and_grads(dtype):
    x = rng.standard_normal((4, 5)) * 3
    x[0, :3] = (-60.0, 0.0, 60.0)
    label = rng.uniform(0, 1, (4, 5))
    helper_test_op(OP, {"x": x.astype(dtype), "label": label.astype(dtype)}, {},
                   bce_reference, grad_wrt=("x", "label") if dtype == np.float64 else ())


def test_bce_extreme_logits_stay_finite():
    x = np.array([-1000.0, 1000.0], np.float32)
    got = helper_test_op(OP, {"x": x, "label": np.array([1.0, 0.0], np.float32)}, {},
                         bce_reference, rtol=1e-6)
    np.testing.assert_allclose(got["out"], [1000.0, 1000.0])


def test_bce_label_must_match_x():
    scope = mg.Scope()
    x, y = scope.new_var("x"), scope.new_var("y")
    x.declare((3, 2), np.dtype("float32"))
    y.declare((3,), np.dtype("float32"))
    with pytest.raises(mg.OpError, match=f"{OP}: input 'label' must have shape \\(3, 2\\)"):
        mg.Operator(OP, x=x, label=y, out=scope.new_var("out"))


def loss_net(layer, shape=(6, 4), **kwargs):
    net = mg.Net(seed=0)
    x = L.data(net, "x", (-1,) + shape[1:])
    y = L.data(net, "y", (-1,) + shape[1:])
    out = layer(net, x, y, **kwargs)
    return net, x, out


def numpy_losses(d, delta=1.0):
    huber = np.where(np.abs(d) <= delta, 0.5 * d * d, delta * (np.abs(d) - 0.5 * delta))
    return {"mse_loss": d * d, "l1_loss": np.abs(d), "huber_loss": huber}


@pytest.mark.parametrize("name", ["mse_loss", "l1_loss", "huber_loss"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_regression_losses_equal_their_formulas(name, reduction):
    x, y = rng.standard_normal((6, 4)) * 2, rng.standard_normal((6, 4))
    kwargs = {"delta": 0.7} if name == "huber_loss" else {}
    net, _, out = loss_net(getattr(L, name), reduction=reduction, **kwargs)
    (got,) = net.infer(feed={"x": x.astype(np.float32), "y": y.astype(np.float32)},
                       fetch=[out])
    elementwise = numpy_losses(x - y, kwargs.get("delta", 1.0))[name]
    want = {"mean": elementwise.mean(), "sum": elementwise.sum(), "none": elementwise}[reduction]
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


def test_bce_layer_is_the_mean_of_the_op():
    x, y = rng.standard_normal((5, 3)) * 4, rng.uniform(0, 1, (5, 3))
    net, _, out = loss_net(L.binary_cross_entropy_with_logits, (5, 3))
    (got,) = net.infer(feed={"x": x.astype(np.float32), "y": y.astype(np.float32)},
                       fetch=[out])
    np.testing.assert_allclose(got, bce_reference(x, y)["out"].mean(), rtol=1e-6)


@pytest.mark.parametrize("name", ["mse_loss", "l1_loss", "huber_loss",
                                  "binary_cross_entropy_with_logits"])
def test_loss_gradients_against_finite_differences(name):
    """d(loss)/d(input) of each layer (sum reduction, float64) by central differences."""
    x = rng.standard_normal((3, 4)) * 2
    x[np.abs(x - 0.0) < 0.05] += 0.1
    y = rng.uniform(0, 1, (3, 4)) if name.startswith("binary") else rng.standard_normal((3, 4))
    net = mg.Net(seed=0)
    xv = L.data(net, "x", (3, 4), "float64")
    yv = L.data(net, "y", (3, 4), "float64")
    w = net.create_parameter("w", (3, 4), "float64", mg.initializer.Constant(0.0))
    z = L.add(net, xv, w)
    kwargs = {"delta": 0.8} if name == "huber_loss" else {}
    loss = getattr(L, name)(net, z, yv, reduction="sum", **kwargs)
    mg.optimizer.SGD(0.0).minimize(net, loss)
    feed = {"x": x, "y": y}
    (g,) = net.train(feed=feed, fetch=[net.grad(w)])
    eps = 1e-6
    num = np.zeros_like(x)
    for i in np.ndindex(*x.shape):
        for sign in (1, -1):
            xp = x.copy()
            xp[i] += sign * eps
            (v,) = net.infer(feed={"x": xp, "y": y}, fetch=[loss])
            num[i] += sign * v / (2 * eps)
    np.testing.assert_allclose(g, num, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"reduction": "avg"}, ValueError, "mse_loss: argument 'reduction' must be one of 'mean', "
                                       "'sum', 'none'"),
])
def test_bad_reduction(kwargs, error, message):
    with pytest.raises(error, match=message):
        loss_net(L.mse_loss, **kwargs)


def test_label_shape_must_match():
    net = mg.Net(seed=0)
    x = L.data(net, "x", (-1, 4))
    y = L.data(net, "y", (-1, 3))
    with pytest.raises(ValueError, match="l1_loss: argument 'label' \\('y', shape \\(-1, 3\\)\\) "
                                         "must have the shape of 'input'"):
        L.l1_loss(net, x, y)


def test_huber_delta_must_be_positive():
    with pytest.raises(ValueError, match="huber_loss: argument 'delta' must be > 0"):
        loss_net(L.huber_loss, delta=0.0)


@pytest.mark.parametrize("layer", [L.mse_loss, L.l1_loss, L.huber_loss])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_regression_losses_refuse_fed_shapes_that_would_broadcast(layer, reduction):
    """Declared (-1, -1) both: a (4, 1) input against a (1, 4) label broadcast silently to
    4 x 4; the fed shapes are checked as binary_cross_entropy_with_logits' are."""
    net = mg.Net(seed=0)
    x = L.data(net, "x", (-1, -1))
    y = L.data(net, "y", (-1, -1))
    out = layer(net, x, y, reduction=reduction)
    with pytest.raises(mg.OpError, match=r"subtract: input 'y' must have shape \(4, 1\) \(the "
                                         r"shape of input 'x': same_shape=True, no "
                                         r"broadcasting\), got \(1, 4\)"):
        net.train(feed={"x": np.ones((4, 1), np.float32), "y": np.ones((1, 4), np.float32)},
                  fetch=[out])
    (got,) = net.train(feed={"x": np.ones((4, 1), np.float32),
                             "y": np.zeros((4, 1), np.float32)}, fetch=[out])
    assert np.shape(got) == (() if reduction == "mean" else (4, 1))
