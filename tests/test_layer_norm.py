"""layer_norm: against the float64 reference (torch's F.layer_norm), gradients against
finite differences, stable statistics, a batch of one, bad input, the layer."""
import numpy as np
import pytest
from helpers import helper_test_op
from references_norms import layer_norm as reference

import minigraph as mg
from minigraph import layers as L

rng = np.random.default_rng(0)
GRADS = ("x", "scale", "bias")


@pytest.mark.parametrize("shape, begin", [((5, 12), 1), ((3, 4, 5, 6), 1), ((3, 4, 5, 6), 2),
                                          ((2, 3, 4, 5), 3), ((1, 9), 1), ((1, 2, 3, 4), 1)])
def test_forward_and_gradients_against_the_reference(shape, begin):
    x = rng.standard_normal(shape) * 3 + 1
    length = int(np.prod(shape[begin:]))
    scale, bias = rng.standard_normal(length), rng.standard_normal(length)
    helper_test_op("layer_norm", {"x": x, "scale": scale, "bias": bias},
                   {"begin_norm_axis": begin, "epsilon": 1e-5}, reference, grad_wrt=GRADS,
                   outputs=["y"])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_float32_and_float16_keep_their_dtype(dtype):
    x = (rng.standard_normal((6, 40)) * 2).astype(dtype)
    helper_test_op("layer_norm", {"x": x, "scale": np.ones(40, dtype),
                                  "bias": np.zeros(40, dtype)}, {}, reference)


def test_without_scale_or_bias():
    x = rng.standard_normal((4, 7))
    helper_test_op("layer_norm", {"x": x}, {}, reference, grad_wrt=("x",), outputs=["y"])
    helper_test_op("layer_norm", {"x": x, "scale": rng.standard_normal(7)}, {}, reference,
                   grad_wrt=("x", "scale"), outputs=["y"])


def test_offset_data_keeps_its_variance():
    """|mean| / std = 1e4 in float32: the variance to 1e-3 relative (never E[x^2] - E[x]^2)."""
    x = (1e4 + rng.standard_normal((8, 5000))).astype(np.float32)
    got = helper_test_op("layer_norm", {"x": x}, {}, None)
    want = x.astype(np.float64).var(axis=1)
    np.testing.assert_allclose(got["variance"], want, rtol=1e-3)


def test_bad_input_names_the_op_and_the_slot():
    scope = mg.Scope()
    vs = {n: scope.new_var(n) for n in ("x", "scale", "y", "mean", "variance")}
    vs["x"].declare((4, 6), "float32")
    vs["scale"].declare((5,), "float32")
    with pytest.raises(mg.OpError, match=r"layer_norm: input 'scale' must have shape \(6,\)"):
        mg.Operator("layer_norm", **vs)
    del vs["scale"]
    with pytest.raises(mg.OpError, match=r"layer_norm: input 'x' of rank 2 .* attribute "
                                         r"'begin_norm_axis' 2: it must be in \[1, 2\)"):
        mg.Operator("layer_norm", begin_norm_axis=2, **vs)
    vs["x"].declare((4, 6), "int64")
    with pytest.raises(mg.OpError, match="layer_norm: input 'x' must be a float tensor"):
        mg.Operator("layer_norm", **vs)


def test_the_layer_trains_a_batch_of_one_without_forking():
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 3, 4))
    y = L.layer_norm(net, x, begin_norm_axis=1, name="ln")
    loss = L.mean(net, L.multiply(net, y, y))
    assert not net.forked
    assert {v.name: v.shape for v in net.parameters()} == {"ln.scale": (12,), "ln.bias": (12,)}
    mg.optimizer.SGD(0.5).minimize(net, loss)
    xb = rng.standard_normal((1, 3, 4)).astype(np.float32)
    net.train(feed={"x": xb}, fetch=[loss])
    (out,) = net.infer(feed={"x": xb}, fetch=[y])
    scale, bias = net.var("ln.scale").get(), net.var("ln.bias").get()
    assert np.abs(scale - 1).max() > 0                      # it trained
    want = reference(xb.astype(np.float64), scale, bias)["y"]
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_the_layer_checks_its_arguments():
    net = mg.Net()
    x = L.data(net, "x", shape=(-1, 6))
    with pytest.raises(ValueError, match=r"layer_norm: argument 'begin_norm_axis' must be in "
                                         r"\[1, 2\)"):
        L.layer_norm(net, x, begin_norm_axis=2)
    with pytest.raises(ValueError, match="layer_norm: argument 'scale' must be True or False"):
        L.layer_norm(net, x, scale="yes")
    y = L.layer_norm(net, x, scale=False, shift=False, name="bare")
    assert not net.parameters() and y.shape == (-1, 6)
