"""group_norm and instance_norm: against the float64 references (torch's GroupNorm and
F.instance_norm), gradients against finite differences, stable statistics, a batch of
one, the errors naming `groups`, the layers."""
import numpy as np
import pytest
from helpers import helper_test_op
from references_norms import group_norm as gn_reference
from references_norms import instance_norm as in_reference

import minigraph as mg
from minigraph import layers as L

rng = np.random.default_rng(1)
GRADS = ("x", "scale", "bias")


@pytest.mark.parametrize("shape, groups", [((4, 6, 5, 3), 3), ((2, 6, 7), 6), ((3, 8), 2),
                                           ((1, 4, 3, 3), 2), ((2, 4, 2, 2, 2), 1)])
def test_group_norm_against_the_reference(shape, groups):
    x = rng.standard_normal(shape) * 2 - 1
    c = shape[1]
    helper_test_op("group_norm", {"x": x, "scale": rng.standard_normal(c),
                                  "bias": rng.standard_normal(c)},
                   {"groups": groups, "epsilon": 1e-5}, gn_reference, grad_wrt=GRADS,
                   outputs=["y"])


@pytest.mark.parametrize("shape", [(3, 4, 5, 6), (1, 3, 7), (2, 2, 3, 2, 2)])
def test_instance_norm_against_the_reference(shape):
    x = rng.standard_normal(shape) + 2
    c = shape[1]
    helper_test_op("instance_norm", {"x": x, "scale": rng.standard_normal(c),
                                     "bias": rng.standard_normal(c)}, {"epsilon": 1e-3},
                   in_reference, grad_wrt=GRADS, outputs=["y"])


def test_without_scale_and_bias_and_in_float32():
    x = rng.standard_normal((2, 4, 3, 3))
    helper_test_op("group_norm", {"x": x}, {"groups": 2}, gn_reference, grad_wrt=("x",),
                   outputs=["y"])
    helper_test_op("instance_norm", {"x": x.astype(np.float32)}, {}, in_reference)


def test_offset_data_keeps_its_variance():
    x = (1e4 + rng.standard_normal((2, 4, 64, 64))).astype(np.float32)
    got = helper_test_op("group_norm", {"x": x}, {"groups": 2}, None)
    want = x.astype(np.float64).reshape(2, 2, -1).var(axis=2)
    np.testing.assert_allclose(got["variance"], want, rtol=1e-3)


def test_groups_must_divide_the_channels():
    scope = mg.Scope()
    vs = {n: scope.new_var(n) for n in ("x", "y", "mean", "variance")}
    vs["x"].declare((2, 6, 4, 4), "float32")
    with pytest.raises(mg.OpError, match=r"group_norm: attribute 'groups' \(4\) must divide the "
                                         r"6 channels of input 'x'"):
        mg.Operator("group_norm", groups=4, **vs)
    with pytest.raises(mg.OpError, match="group_norm: missing attribute 'groups'"):
        mg.Operator("group_norm", **vs)
    net = mg.Net()
    x = L.data(net, "x", shape=(-1, 6, 4, 4))
    with pytest.raises(ValueError, match=r"group_norm: argument 'groups' \(4\) must divide the "
                                         r"6 channels"):
        L.group_norm(net, x, 4)
    assert not net.persistables()                      # the failed layer left nothing


def test_instance_norm_needs_more_than_one_spatial_value():
    net = mg.Net()
    x = L.data(net, "x", shape=(-1, 3, 1, 1))
    with pytest.raises(ValueError, match="instance_norm: argument 'x' .* more than one spatial "
                                         "value per channel"):
        L.instance_norm(net, x)


@pytest.mark.parametrize("kind", ["group_norm", "instance_norm"])
def test_the_layers_train_a_batch_of_one_without_forking(kind):
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 4, 5, 5))
    y = L.group_norm(net, x, 2, name="n") if kind == "group_norm" else \
        L.instance_norm(net, x, name="n")
    loss = L.mean(net, L.multiply(net, y, L.data(net, "w", shape=(-1, 4, 5, 5))))
    assert not net.forked
    assert [v.name for v in net.parameters()] == ["n.scale", "n.bias"]
    mg.optimizer.SGD(0.5).minimize(net, loss)
    feed = {"x": rng.standard_normal((1, 4, 5, 5)).astype(np.float32),
            "w": rng.standard_normal((1, 4, 5, 5)).astype(np.float32)}
    for _ in range(2):
        net.train(feed=feed, fetch=[loss])
    scale, bias = net.var("n.scale").get(), net.var("n.bias").get()
    assert np.abs(scale - 1).max() > 0
    (out,) = net.infer(feed={"x": feed["x"]}, fetch=[y])
    ref = gn_reference(feed["x"].astype(np.float64), scale, bias, 2) if kind == "group_norm" \
        else in_reference(feed["x"].astype(np.float64), scale, bias)
    np.testing.assert_allclose(out, ref["y"], rtol=1e-5, atol=1e-6)
