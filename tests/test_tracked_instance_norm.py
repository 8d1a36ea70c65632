"""instance_norm with running estimates (tracked_instance_norm, PyTorch's
track_running_stats=True) against the float64 reference: training updates the estimates
from the instances' statistics (the first-batch rule or PyTorch's), inference uses them;
gradients against finite differences; one spatial value, an empty batch, non-finite
batches; the layer forks the net, and inputs without a batch axis (spatial_dims)."""
import numpy as np
import pytest
from helpers import helper_test_op
from references_norms import instance_norm as in_reference
from references_norms import tracked_instance_norm as reference

import minigraph as mg
from minigraph import layers as L

rng = np.random.default_rng(11)


def tracked_inputs(x, layout="NCHW", counter=0, affine=True):
    c = x.shape[1] if layout == "NCHW" else x.shape[-1]
    ins = {"x": x, "estimated_mean": rng.standard_normal(c),
           "estimated_var": rng.uniform(0.5, 2.0, c)}
    if affine:
        ins.update(scale=rng.standard_normal(c), bias=rng.standard_normal(c))
    if counter is not None:
        ins["num_batches"] = np.array(counter, np.int64)
    return ins


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("shape", [(4, 3, 9), (3, 2, 4, 5), (2, 3, 2, 3, 2)])
@pytest.mark.parametrize("first_batch", [True, False])
@pytest.mark.parametrize("counter, momentum", [(0, 0.9), (3, 0.7), (2, None), (None, 0.2)])
def test_training_updates_the_estimates_as_the_reference(layout, shape, first_batch, counter,
                                                         momentum):
    x = rng.standard_normal(shape) * 2 + 1
    ins = tracked_inputs(x, layout, counter)
    helper_test_op("tracked_instance_norm", ins,
                   {"data_layout": layout, "momentum": momentum,
                    "first_batch_sets_estimates": first_batch}, reference,
                   grad_wrt=("x", "scale", "bias"), outputs=["y"])


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_inference_uses_the_estimates_and_writes_nothing(layout, dtype):
    ins = {k: (v.astype(dtype) if v.dtype.kind == "f" else v)
           for k, v in tracked_inputs(rng.standard_normal((3, 4, 5, 4)), layout, 2).items()}
    got = helper_test_op("tracked_instance_norm", ins,
                         {"data_layout": layout, "is_infer": True}, reference)
    np.testing.assert_array_equal(got["saved_mean"], ins["estimated_mean"])
    assert int(got["saved_num_batches"]) == 2


def test_one_spatial_value_trains_with_an_error_and_infers():
    ins = tracked_inputs(rng.standard_normal((5, 3, 1, 1)))
    with pytest.raises(mg.OpError, match="tracked_instance_norm: training needs more than one "
                                         "spatial value per channel"):
        helper_test_op("tracked_instance_norm", ins, {}, None)
    helper_test_op("tracked_instance_norm", ins, {"is_infer": True}, reference)


def test_an_empty_batch_changes_nothing():
    ins = tracked_inputs(np.zeros((0, 3, 4)), counter=4)
    got = helper_test_op("tracked_instance_norm", ins, {}, reference)
    assert got["y"].shape == (0, 3, 4)
    np.testing.assert_array_equal(got["saved_var"], ins["estimated_var"])
    assert int(got["saved_num_batches"]) == 4


def test_a_non_finite_batch_leaves_the_estimates_and_the_counter():
    scope = mg.Scope()
    ins = tracked_inputs(rng.standard_normal((2, 3, 4)), counter=1)
    ins["x"][1, 2, 0] = np.nan
    v = {k: scope.new_var(k) for k in (*ins, "y", "mean", "variance")}
    for k, a in ins.items():
        v[k].set(a.copy())
    op = mg.Operator("tracked_instance_norm", saved_mean=v["estimated_mean"],
                     saved_var=v["estimated_var"], saved_num_batches=v["num_batches"], **v)
    with pytest.raises(mg.OpError, match="tracked_instance_norm: the batch statistics are not "
                                         "finite"):
        mg.Executor(mg.CPUPlace()).run([op], scope)
    np.testing.assert_array_equal(v["estimated_mean"].get(), ins["estimated_mean"])
    assert int(v["num_batches"].get()) == 1


def test_epsilon_zero_in_inference_names_a_zero_estimated_variance():
    ins = tracked_inputs(rng.standard_normal((2, 3, 4)))
    ins["estimated_var"][1] = 0.0
    with pytest.raises(mg.OpError, match="epsilon is 0 and the estimated variance of channel 1"):
        helper_test_op("tracked_instance_norm", ins, {"is_infer": True, "epsilon": 0.0}, None)


def test_the_op_checks_its_inputs():
    scope = mg.Scope()
    v = {n: scope.new_var(n) for n in ("x", "m", "var", "y", "mean", "variance")}
    v["x"].declare((2, 3, 4), "float32")
    v["m"].declare((4,), "float32")
    v["var"].declare((3,), "float32")
    with pytest.raises(mg.OpError, match=r"tracked_instance_norm: input 'estimated_mean' must "
                                         r"have shape \(3,\)"):
        mg.Operator("tracked_instance_norm", x=v["x"], estimated_mean=v["m"],
                    estimated_var=v["var"], saved_mean=v["m"], saved_var=v["var"], y=v["y"],
                    mean=v["mean"], variance=v["variance"])
    with pytest.raises(mg.OpError, match="momentum=None .* needs the 'num_batches' counter"):
        mg.Operator("tracked_instance_norm", x=v["x"], estimated_mean=v["var"],
                    estimated_var=v["var"], saved_mean=v["var"], saved_var=v["var"], y=v["y"],
                    mean=v["mean"], variance=v["variance"], momentum=None)


# ---- the layer ---------------------------------------------------------------------------

def tracked_net(layout="NCHW", first_batch=True, momentum=0.9, shape=(-1, 3, 6, 5), **kw):
    net = mg.Net(seed=2)
    x = L.data(net, "x", shape=shape, dtype="float64")
    y = L.instance_norm(net, x, track_running_stats=True, momentum=momentum,
                        first_batch_sets_estimates=first_batch, data_layout=layout,
                        name="inn", **kw)
    return net, y


@pytest.mark.parametrize("first_batch", [True, False])
def test_the_layer_forks_keeps_estimates_and_infers_with_them(first_batch):
    net, y = tracked_net(first_batch=first_batch, momentum=0.6)
    assert net.forked
    assert [v.name for v in net.persistables()] == [
        "inn.scale", "inn.bias", "inn.estimated_mean", "inn.estimated_var", "inn.num_batches"]
    est = {"estimated_mean": np.zeros(3), "estimated_var": np.ones(3), "num_batches": 0}
    for step in range(3):
        x = rng.standard_normal((4, 3, 6, 5)) + step
        (got,) = net.train(feed={"x": x}, fetch=[y])
        want = reference(x, scale=np.ones(3), bias=np.zeros(3), momentum=0.6,
                         first_batch_sets_estimates=first_batch, **est)
        np.testing.assert_allclose(got, want["y"], rtol=1e-12, atol=1e-12)
        est = {"estimated_mean": want["saved_mean"], "estimated_var": want["saved_var"],
               "num_batches": want["saved_num_batches"]}
        np.testing.assert_allclose(net.var("inn.estimated_var").get(), est["estimated_var"],
                                   rtol=1e-12)
    (inferred,) = net.infer(feed={"x": x}, fetch=[y])
    want = reference(x, scale=np.ones(3), bias=np.zeros(3), is_infer=True, **est)
    np.testing.assert_allclose(inferred, want["y"], rtol=1e-12, atol=1e-12)
    assert int(net.var("inn.num_batches").get()) == 3


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("spatial, shape", [(1, (3, 15)), (2, (3, 6, 6)), (3, (3, 4, 4, 4))])
@pytest.mark.parametrize("tracked", [False, True])
def test_an_input_without_a_batch_axis_is_a_batch_of_one(layout, spatial, shape, tracked):
    if layout == "NHWC":
        shape = (*shape[1:], shape[0])
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=shape, dtype="float64")
    y = L.instance_norm(net, x, affine=False, track_running_stats=tracked, momentum=0.7,
                        spatial_dims=spatial, data_layout=layout, name="n")
    assert tuple(y.shape) == shape
    xv = rng.standard_normal(shape)
    (got,) = net.train(feed={"x": xv}, fetch=[y])
    np.testing.assert_allclose(got, in_reference(xv[None], data_layout=layout)["y"][0],
                               rtol=1e-12, atol=1e-12)
    if tracked:
        (inferred,) = net.infer(feed={"x": xv}, fetch=[y])
        est = reference(xv[None], np.zeros(3), np.ones(3), num_batches=0, momentum=0.7,
                        data_layout=layout)
        want = reference(xv[None], est["saved_mean"], est["saved_var"], is_infer=True,
                         data_layout=layout)["y"][0]
        np.testing.assert_allclose(inferred, want, rtol=1e-12, atol=1e-12)


def test_a_tracked_layer_trains_a_net_on_both_branches():
    net, y = tracked_net(layout="NHWC", shape=(-1, 6, 5, 3), first_batch=False)
    w = L.data(net, "w", shape=(-1, 6, 5, 3), dtype="float64")
    loss = L.mean(net, L.multiply(net, y, w))
    mg.optimizer.SGD(0.5).minimize(net, loss)
    feed = {"x": rng.standard_normal((2, 6, 5, 3)), "w": rng.standard_normal((2, 6, 5, 3))}
    before = net.var("inn.scale").get().copy()
    for _ in range(2):
        net.train(feed=feed, fetch=[loss])
    assert np.abs(net.var("inn.scale").get() - before).max() > 0
    assert int(net.var("inn.num_batches").get()) == 2
    kept = net.var("inn.estimated_mean").get().copy()
    net.infer(feed={"x": feed["x"]}, fetch=[y])
    np.testing.assert_array_equal(net.var("inn.estimated_mean").get(), kept)
