"""batch_norm and sync_batch_norm on PyTorch's terms: first_batch_sets_estimates=False (the
estimates start at 0 / 1 and follow the momentum from the first batch, _NormBase's rule),
scale without shift (bias=False), an empty training batch (an empty y, nothing written),
epsilon > 0 as PyTorch's BatchNorm; against the float64 reference, gradients against finite
differences, in the op, the layer and folding."""
import numpy as np
import pytest
from helpers import helper_test_op
from references import batch_norm as reference

import minigraph as mg
from minigraph import layers as L

rng = np.random.default_rng(5)


def bn_ref(first_batch):
    """The op's reference for helper_test_op (its slot and attribute names)."""
    def ref(x, estimated_mean, estimated_var, scale=None, bias=None, num_batches=None,
            data_layout="NCHW", momentum=0.9, first_batch_sets_estimates=True, **attrs):
        c = x.shape[1] if data_layout == "NCHW" else x.shape[-1]
        got = reference(x, estimated_mean, estimated_var, np.ones(c) if scale is None else scale,
                        np.zeros(c) if bias is None else bias, num_batches, data_layout,
                        momentum=momentum, first_batch=first_batch_sets_estimates)
        assert first_batch_sets_estimates == first_batch
        out = {"y": got["y"], "batch_mean": got["batch_mean"], "batch_var": got["batch_var"],
               "saved_mean": got["estimated_mean"], "saved_var": got["estimated_var"]}
        if num_batches is not None:
            out["saved_num_batches"] = got["num_batches"]
        return out
    return ref


@pytest.mark.parametrize("op_type", ["batch_norm", "sync_batch_norm"])
@pytest.mark.parametrize("layout, shape", [("NCHW", (4, 3)), ("NCHW", (4, 3, 5)),
                                           ("NHWC", (3, 4, 5, 3)), ("NCHW", (2, 3, 2, 2, 3))])
@pytest.mark.parametrize("counter, momentum", [(0, 0.9), (0, 0.3), (4, 0.7), (0, None),
                                               (2, None), (None, 0.8)])
def test_pytorch_rule_blends_from_the_first_batch(op_type, layout, shape, counter, momentum):
    if counter is None and momentum is None:
        return
    c = shape[1] if layout == "NCHW" else shape[-1]
    ins = {"x": rng.standard_normal(shape) * 2 + 1, "estimated_mean": rng.standard_normal(c),
           "estimated_var": rng.uniform(0.5, 2.0, c), "scale": rng.standard_normal(c),
           "bias": rng.standard_normal(c)}
    if counter is not None:
        ins["num_batches"] = np.array(counter, np.int64)
    helper_test_op(op_type, ins, {"data_layout": layout, "momentum": momentum,
                                  "first_batch_sets_estimates": False}, bn_ref(False),
                   grad_wrt=("x", "scale", "bias"), outputs=["y"])


def test_the_rules_differ_on_the_first_batch_only():
    x = rng.standard_normal((6, 2))
    est = {"estimated_mean": np.zeros(2), "estimated_var": np.ones(2),
           "num_batches": np.array(0, np.int64)}
    ours = helper_test_op("batch_norm", {"x": x, **est}, {}, bn_ref(True))
    torchs = helper_test_op("batch_norm", {"x": x, **est},
                            {"first_batch_sets_estimates": False}, bn_ref(False))
    np.testing.assert_allclose(ours["saved_mean"], x.mean(axis=0))
    np.testing.assert_allclose(torchs["saved_mean"], 0.1 * x.mean(axis=0))
    np.testing.assert_allclose(torchs["saved_var"], 0.9 + 0.1 * x.var(axis=0, ddof=1))
    assert int(ours["saved_num_batches"]) == int(torchs["saved_num_batches"]) == 1
    later = {**est, "num_batches": np.array(3, np.int64)}
    a = helper_test_op("batch_norm", {"x": x, **later}, {}, bn_ref(True))
    b = helper_test_op("batch_norm", {"x": x, **later}, {"first_batch_sets_estimates": False},
                       bn_ref(False))
    np.testing.assert_array_equal(a["saved_var"], b["saved_var"])


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_scale_without_shift(layout):
    shape = (5, 3, 4) if layout == "NCHW" else (5, 4, 3)
    ins = {"x": rng.standard_normal(shape), "estimated_mean": np.zeros(3),
           "estimated_var": np.ones(3), "scale": rng.standard_normal(3)}
    helper_test_op("batch_norm", ins, {"data_layout": layout, "momentum": 0.5}, bn_ref(True),
                   grad_wrt=("x", "scale"), outputs=["y"])
    helper_test_op("batch_norm", {k: v for k, v in ins.items() if k != "scale"} |
                   {"bias": rng.standard_normal(3)}, {"data_layout": layout}, bn_ref(True),
                   grad_wrt=("x", "bias"), outputs=["y"])


@pytest.mark.parametrize("op_type", ["batch_norm", "sync_batch_norm"])
@pytest.mark.parametrize("tracked", [True, False])
@pytest.mark.parametrize("shape, layout", [((0, 3), "NCHW"), ((0, 3, 4, 4), "NCHW"),
                                           ((0, 5, 3), "NHWC")])
def test_an_empty_training_batch_gives_an_empty_output_and_writes_nothing(op_type, tracked,
                                                                          shape, layout):
    scope = mg.Scope()
    ins = {"x": np.zeros(shape, np.float32), "scale": np.ones(3, np.float32),
           "bias": np.zeros(3, np.float32)}
    if tracked:
        ins.update(estimated_mean=rng.standard_normal(3).astype(np.float32),
                   estimated_var=np.full(3, 2.0, np.float32), num_batches=np.array(5, np.int64))
    v = {k: scope.new_var(k) for k in ins}
    for k, a in ins.items():
        v[k].set(a.copy())
    outs = {k: scope.new_var(k) for k in ("y", "batch_mean", "batch_var")}
    inplace = {"saved_mean": v["estimated_mean"], "saved_var": v["estimated_var"],
               "saved_num_batches": v["num_batches"]} if tracked else {}
    op = mg.Operator(op_type, data_layout=layout, **v, **outs, **inplace)
    y, bm, bv = mg.Executor(mg.CPUPlace()).run([op], scope, fetch=list(outs.values()))
    assert y.shape == shape and y.dtype == np.float32
    if tracked:
        np.testing.assert_array_equal(v["estimated_mean"].get(), ins["estimated_mean"])
        np.testing.assert_array_equal(bv, ins["estimated_var"])
        assert int(v["num_batches"].get()) == 5
    dy = np.ones(shape, np.float32)
    grads = {k: scope.new_var(k) for k in ("dx", "dscale", "dbias")}
    dyv = scope.new_var("dy")
    dyv.set(dy)
    gop = mg.Operator(op_type + "_grad", x=v["x"], scale=v["scale"], mean=outs["batch_mean"],
                      var=outs["batch_var"], dy=dyv, data_layout=layout, **grads)
    gx, gs, gb = mg.Executor(mg.CPUPlace()).run([gop], scope, fetch=list(grads.values()))
    assert gx.shape == shape
    np.testing.assert_array_equal(gs, 0)
    np.testing.assert_array_equal(gb, 0)


def test_one_value_per_channel_is_still_an_error():
    x = rng.standard_normal((1, 3))
    with pytest.raises(mg.OpError, match="training needs more than one value per channel, got "
                                         "n=1"):
        helper_test_op("batch_norm", {"x": x}, {}, None)


def test_the_layer_passes_the_rule_and_checks_its_new_arguments():
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 3, 4), dtype="float64")
    y = L.batch_norm(net, x, momentum=0.75, first_batch_sets_estimates=False, bias=False,
                     name="bn")
    (op,) = [o for o in net.ops("train") if o.type == "batch_norm"]
    assert op.attrs["first_batch_sets_estimates"] is False and op.inputs["bias"] is None
    xs = [rng.standard_normal((5, 3, 4)) for _ in range(3)]
    mean, var = np.zeros(3), np.ones(3)
    for xb in xs:
        net.train(feed={"x": xb}, fetch=[y])
        mean = 0.75 * mean + 0.25 * xb.mean(axis=(0, 2))
        var = 0.75 * var + 0.25 * xb.var(axis=(0, 2), ddof=1)
    np.testing.assert_allclose(net.var("bn.estimated_mean").get(), mean, rtol=1e-12)
    np.testing.assert_allclose(net.var("bn.estimated_var").get(), var, rtol=1e-12)
    for kwargs, match in [({"first_batch_sets_estimates": "yes"},
                           "batch_norm: argument 'first_batch_sets_estimates'"),
                          ({"bias": 0}, "batch_norm: argument 'bias'"),
                          ({"epsilon": 0.0}, r"batch_norm: argument 'epsilon' must be > 0 \(as "
                                             "PyTorch's BatchNorm\\)"),
                          ({"momentum": -0.1}, "batch_norm: argument 'momentum'"),
                          ({"data_layout": "NWHC"}, "batch_norm: argument 'data_layout'")]:
        with pytest.raises(ValueError, match=match):
            L.batch_norm(net, x, **kwargs)


def test_folding_a_scale_only_batch_norm():
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 3, 4, 4))
    y = L.batch_norm(net, L.conv2d(net, x, 3, 1, name="c"), bias=False,
                     first_batch_sets_estimates=False, name="bn")
    loss = L.mean(net, L.multiply(net, y, y))
    mg.optimizer.SGD(0.1).minimize(net, loss)
    xb = rng.standard_normal((6, 3, 4, 4)).astype(np.float32)
    for _ in range(3):
        net.train(feed={"x": xb}, fetch=[loss])
    folded = mg.passes.fold_batch_norm(net)
    assert [n.folded for n in folded.reports["fold_batch_norm"]] == [True]
    (want,) = net.infer(feed={"x": xb}, fetch=[y])
    (got,) = folded.infer(feed={"x": xb}, fetch=[y.name])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
