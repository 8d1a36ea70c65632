"""Batch norm's PyTorch _NormBase options: affine=False (no scale or bias) and
track_running_stats=False (no estimates or counter; both modes normalise with the
batch's statistics), in the op, the layer, sync_batch_norm, folding, checkpoints and
the picture. (ONNX: tests/test_onnx_export.py.)"""
import numpy as np
import pytest
from helpers import helper_test_op
from references import batch_stats, bn_normalize

import minigraph as mg
from minigraph import layers as L

rng = np.random.default_rng(3)


def plain(x, scale=None, bias=None, layout="NCHW", epsilon=1e-5):
    """y of a batch norm with the batch's statistics (no estimates)."""
    c = x.shape[1] if layout == "NCHW" else x.shape[-1]
    mean, var, _ = batch_stats(x, layout)
    return bn_normalize(x, np.ones(c) if scale is None else scale,
                        np.zeros(c) if bias is None else bias, mean, var, epsilon, layout)


@pytest.mark.parametrize("op_type", ["batch_norm", "sync_batch_norm"])
@pytest.mark.parametrize("is_infer", [False, True])
@pytest.mark.parametrize("layout, shape", [("NCHW", (4, 3, 5, 2)), ("NHWC", (6, 4)),
                                           ("NHWC", (2, 3, 3, 5))])
def test_without_estimates_both_modes_use_the_batch_statistics(op_type, is_infer, layout,
                                                               shape):
    x = rng.standard_normal(shape) * 2 + 1
    c = shape[1] if layout == "NCHW" else shape[-1]
    scale, bias = rng.standard_normal(c), rng.standard_normal(c)

    def reference(x, scale, bias, **attrs):
        mean, var, _ = batch_stats(x, layout)
        return {"y": plain(x, scale, bias, layout), "batch_mean": mean, "batch_var": var}

    helper_test_op(op_type, {"x": x, "scale": scale, "bias": bias},
                   {"is_infer": is_infer, "data_layout": layout}, reference,
                   grad_wrt=("x", "scale", "bias"), outputs=["y"])


@pytest.mark.parametrize("tracked", [True, False])
def test_without_scale_and_bias(tracked):
    x = rng.standard_normal((5, 3, 4))
    ins = {"x": x}
    if tracked:
        ins.update(estimated_mean=np.zeros(3), estimated_var=np.ones(3))

    def reference(x, **kw):
        mean, var, _ = batch_stats(x, "NCHW")
        return {"y": plain(x), "batch_mean": mean, "batch_var": var}

    helper_test_op("batch_norm", ins, {"momentum": 0.5}, reference, grad_wrt=("x",),
                   outputs=["y"])


def test_the_op_says_which_parts_go_together():
    scope = mg.Scope()
    v = {n: scope.new_var(n) for n in ("x", "y", "bm", "bv", "m", "var", "s", "b", "nb")}
    v["x"].declare((4, 3), "float32")
    base = dict(x=v["x"], y=v["y"], batch_mean=v["bm"], batch_var=v["bv"])
    cases = [
        (dict(estimated_mean=v["m"], saved_mean=v["m"]),
         r"'estimated_mean' and 'estimated_var' go together \(the running estimates\)"),
        (dict(estimated_mean=v["m"], estimated_var=v["var"]),
         r"output 'saved_mean' must be the same Variable as input 'estimated_mean'"),
        (dict(use_global_est=True), "use_global_est=True needs the running estimates"),
        (dict(num_batches=v["nb"], saved_num_batches=v["nb"]),
         "the 'num_batches' counter needs the running estimates"),
    ]
    for extra, match in cases:
        with pytest.raises(mg.OpError, match=match):
            mg.Operator("batch_norm", **base, **extra)
    mg.Operator("batch_norm", **base, momentum=None)   # nothing to average without estimates


def tiny_net(**options):
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 3, 4, 4))
    y = L.batch_norm(net, L.conv2d(net, x, 3, 1, name="c"), name="bn", **options)
    loss = L.mean(net, L.multiply(net, y, y))
    mg.optimizer.SGD(0.1).minimize(net, loss)
    return net, y, loss


def test_the_layers_persistables_follow_the_options():
    def bn_persistables(**options):
        net = tiny_net(**options)[0]
        return sorted(v.name for v in net.persistables() if v.name.startswith("bn."))

    assert bn_persistables() == ["bn.bias", "bn.estimated_mean", "bn.estimated_var",
                                 "bn.num_batches", "bn.scale"]
    assert bn_persistables(affine=False) == ["bn.estimated_mean", "bn.estimated_var",
                                             "bn.num_batches"]
    assert bn_persistables(track_running_stats=False) == ["bn.bias", "bn.scale"]
    assert bn_persistables(bias=False) == ["bn.estimated_mean", "bn.estimated_var",
                                           "bn.num_batches", "bn.scale"]
    assert bn_persistables(affine=False, bias=False) == bn_persistables(affine=False)
    with pytest.raises(ValueError, match="batch_norm: use_global_est=True needs the running "
                                         "estimates"):
        tiny_net(track_running_stats=False, use_global_est=True)
    with pytest.raises(ValueError, match="batch_norm: argument 'affine' must be True or False"):
        tiny_net(affine=1)


def test_untracked_inference_uses_the_batch_and_writes_nothing():
    net, y, loss = tiny_net(track_running_stats=False)
    xb = rng.standard_normal((6, 3, 4, 4)).astype(np.float32)
    net.train(feed={"x": xb}, fetch=[loss])
    before = {v.name: v.get().copy() for v in net.persistables()}
    (got,) = net.infer(feed={"x": xb}, fetch=[y])
    conv = net.var("c.w").get().reshape(3, 3).astype(np.float64)
    h = np.einsum("oc,nchw->nohw", conv, xb) + net.var("c.b").get()[None, :, None, None]
    want = plain(h, net.var("bn.scale").get(), net.var("bn.bias").get())
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    for v in net.persistables():
        np.testing.assert_array_equal(v.get(), before[v.name])
    net = mg.Net()
    x = L.data(net, "x", shape=(-1, 3))
    y = L.batch_norm(net, x, track_running_stats=False)
    with pytest.raises(mg.OpError, match="training needs more than one value per channel"):
        net.infer(feed={"x": np.ones((1, 3), np.float32)}, fetch=[y])   # as torch's eval


def test_folding_keeps_an_untracked_batch_norm_and_folds_an_unscaled_one():
    net, y, _ = tiny_net(track_running_stats=False)
    (note,) = mg.passes.fold_batch_norm(net).reports["fold_batch_norm"]
    assert not note.folded and "track_running_stats=False" in note.reason
    net, y, loss = tiny_net(affine=False)
    xb = rng.standard_normal((6, 3, 4, 4)).astype(np.float32)
    for _ in range(3):
        net.train(feed={"x": xb}, fetch=[loss])
    folded = mg.passes.fold_batch_norm(net)
    assert [n.folded for n in folded.reports["fold_batch_norm"]] == [True]
    (want,) = net.infer(feed={"x": xb}, fetch=[y])
    (got,) = folded.infer(feed={"x": xb}, fetch=[y.name])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("options", [{"affine": False}, {"track_running_stats": False},
                                     {"bias": False},
                                     {"first_batch_sets_estimates": False, "momentum": None}])
def test_checkpoints_and_pictures_handle_the_options(options, tmp_path):
    net, y, loss = tiny_net(**options)
    xb = rng.standard_normal((4, 3, 4, 4)).astype(np.float32)
    net.train(feed={"x": xb}, fetch=[loss])
    mg.io.save(net, tmp_path / "ckpt.npz")
    other, y2, _ = tiny_net(**options)
    mg.io.load(other, tmp_path / "ckpt.npz")
    np.testing.assert_array_equal(other.infer(feed={"x": xb}, fetch=[y2])[0],
                                  net.infer(feed={"x": xb}, fetch=[y])[0])
    dot = net.to_dot(backward=True)
    assert "bn" in dot
    mg.io.save_inference(net, tmp_path / "model", feeds=["x"], fetches=[y])
    (loaded,) = mg.io.load_inference(tmp_path / "model").infer(feed={"x": xb})
    np.testing.assert_allclose(loaded, net.infer(feed={"x": xb}, fetch=[y])[0], rtol=1e-6)
