"""batch_norm_relu and sync_batch_norm_relu (ops/batch_norm_relu.py): y = max(batch
norm, 0) against the float64 reference, gradients against finite differences, the
same values as the unfused pair batch_norm + relu (forward, backward, running
estimates and counter, the all-or-nothing step), on both CPU engines; the schema keeps
every batch_norm attribute; ONNX export; and the native kernels' relu and mask."""
from __future__ import annotations

import numpy as np
import pytest
from helpers import helper_test_op
from references import batch_norm, batch_norm_grad, batch_stats, bn_normalize

import minigraph as mg
from minigraph import OpError
from minigraph.kernels.cpu import batch_norm_stats, bn_native
from minigraph.schema import get_schema

rng = np.random.default_rng(7)


def relu_reference(x, scale, bias, estimated_mean=None, estimated_var=None, num_batches=None,
                   data_layout="NCHW", **attrs):
    """references.batch_norm's y through max(., 0); without estimates, both modes take
    the batch's statistics."""
    if estimated_mean is None:
        mean, var, _ = batch_stats(x, data_layout)
        y = bn_normalize(x, scale, bias, mean, var, attrs.get("epsilon", 1e-5), data_layout)
        return {"y": np.maximum(y, 0)}
    out = batch_norm(x, estimated_mean, estimated_var, scale, bias, num_batches, data_layout,
                     **attrs)
    return {"y": np.maximum(out["y"], 0)}


def bn_inputs(shape, layout, counter=True, dtype=np.float64):
    c = shape[1] if layout == "NCHW" else shape[-1]
    ins = {"x": (0.3 + 2.0 * rng.standard_normal(shape)).astype(dtype),
           "estimated_mean": rng.standard_normal(c).astype(dtype),
           "estimated_var": rng.uniform(0.5, 2.0, c).astype(dtype),
           "scale": rng.uniform(0.5, 1.5, c).astype(dtype),
           "bias": rng.standard_normal(c).astype(dtype)}
    if counter:
        ins["num_batches"] = np.array(3, dtype=np.int64)
    return ins


@pytest.fixture(params=["native", "numpy"])
def engine(request, monkeypatch):
    """The CPU engine: the native kernels (skipped where they cannot be built) or numpy."""
    if request.param == "numpy":
        monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    elif not bn_native.available():
        pytest.skip("native kernels not built")
    return request.param


def test_the_schema_is_batch_norms_with_the_grad_reading_y():
    bn, fused = get_schema("batch_norm"), get_schema("batch_norm_relu")
    for other in (fused, get_schema("sync_batch_norm_relu")):
        assert [s.name for s in other.inputs] == [s.name for s in bn.inputs]
        assert [s.name for s in other.outputs] == [s.name for s in bn.outputs]
        assert [(a.name, a.default) for a in other.attrs] == [(a.name, a.default)
                                                              for a in bn.attrs]
        assert other.inplace == bn.inplace and other.mode_attr == "is_infer"
        assert set(other.roles) == {"batch_norm", "batch_norm_relu"}
    grad = get_schema("batch_norm_relu_grad")
    assert [s.name for s in grad.inputs] == ["x", "scale", "mean", "var", "dy", "y"]
    assert grad.reuse == {"dx": ("dy",)}
    assert fused.sync_variant == "sync_batch_norm_relu"
    assert grad.sync_variant == "sync_batch_norm_relu_grad"
    assert get_schema("sync_batch_norm_relu_grad").presummed_average == "average_ranks"


@pytest.mark.parametrize("shape, layout", [((3, 2, 3, 2), "NCHW"), ((3, 2, 3, 2), "NHWC"),
                                           ((6, 3), "NCHW"), ((2, 2, 2, 3, 2), "NCHW")])
@pytest.mark.parametrize("use_global_est", [False, True])
def test_forward_and_gradients(shape, layout, use_global_est, engine):
    """Against the float64 reference, and d/dx, d/dscale, d/dbias against central
    differences (the kink at 0 is never within eps of these values)."""
    attrs = {"data_layout": layout, "use_global_est": use_global_est, "epsilon": 1e-3}
    helper_test_op("batch_norm_relu", bn_inputs(shape, layout, counter=not use_global_est),
                   attrs, relu_reference, grad_wrt=("x", "scale", "bias"), outputs=("y",),
                   grad_atol=1e-6, grad_rtol=1e-5)


def test_inference_and_no_running_estimates(engine):
    x = bn_inputs((4, 3, 5), "NCHW")
    helper_test_op("batch_norm_relu", x, {"is_infer": True}, relu_reference)
    untracked = {k: x[k] for k in ("x", "scale", "bias")}
    helper_test_op("batch_norm_relu", untracked, {"is_infer": True}, relu_reference,
                   grad_wrt=("x", "scale"), outputs=("y",))


class Pair:
    """A scope with x, dy and one batch norm's state; runs it as batch_norm_relu or as
    batch_norm + relu, forward and backward, with the ops the grad makers build."""

    def __init__(self, x, dy, layout, fused, counter=0, **attrs):
        c = x.shape[1] if layout == "NCHW" else x.shape[-1]
        s = self.scope = mg.Scope()

        def var(name, value=None, persistable=False):
            v = s.new_var(name, persistable=persistable)
            if value is not None:
                v.set(value)
            return v

        dt = x.dtype
        self.state = [var("m", np.linspace(-1, 1, c).astype(dt), True),
                      var("v", np.linspace(0.5, 2, c).astype(dt), True),
                      var("n", np.array(counter, np.int64), True)]
        m, v, n = self.state
        slots = dict(x=var("x", x), scale=var("scale", np.linspace(.5, 1.5, c).astype(dt), True),
                     bias=var("bias", np.linspace(-.5, .5, c).astype(dt), True),
                     estimated_mean=m, estimated_var=v, num_batches=n, saved_mean=m,
                     saved_var=v, saved_num_batches=n, batch_mean=var("bm"),
                     batch_var=var("bv"))
        dout, out = var("dout", dy), var("out")
        grads = {id(slots[k]): var(f"d{k}") for k in ("x", "scale", "bias")}
        attrs["data_layout"] = layout
        if fused:
            op = mg.Operator("batch_norm_relu", y=out, **slots, **attrs)
            self.forward = [op]
            descs = op.schema.grad(op, {"y": dout}, lambda v: grads.get(id(v)))
        else:
            bn = mg.Operator("batch_norm", y=var("t"), **slots, **attrs)
            relu = mg.Operator("relu", x=bn.outputs["y"], out=out)
            self.forward = [bn, relu]
            grads[id(bn.outputs["y"])] = var("dt")
            descs = relu.schema.grad(relu, {"out": dout}, lambda v: grads.get(id(v)))
            descs += bn.schema.grad(bn, {"y": grads[id(bn.outputs["y"])]},
                                    lambda v: grads.get(id(v)))
        self.backward = [mg.Operator(d.type, **d.kwargs) for d in descs]
        self.fetch = ["out", "dx", "dscale", "dbias", "m", "v", "n"]

    def run(self, backward=True):
        ops = self.forward + (self.backward if backward else [])
        return mg.Executor().run(ops, self.scope, fetch=self.fetch if backward else
                                 ["out", "m", "v", "n"])


@pytest.mark.parametrize("layout, shape", [("NCHW", (8, 5, 7, 7)), ("NCHW", (300, 70, 3)),
                                           ("NHWC", (6, 5, 5, 16)), ("NCHW", (64, 3, 40, 40)),
                                           ("NHWC", (512, 33))])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("attrs", [{}, {"use_global_est": True}, {"momentum": None}],
                         ids=["train", "global", "cumulative"])
def test_equal_to_the_unfused_pair(layout, shape, dtype, attrs, engine):
    """Output, gradients, estimates and counter, over two steps, within float rounding
    of batch_norm + relu (the same numerics, one pass fewer)."""
    x = (rng.standard_normal(shape) * 2 + 0.2).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    fused, pair = Pair(x, dy, layout, True, **attrs), Pair(x, dy, layout, False, **attrs)
    for _ in range(2):
        for a, b in zip(fused.run(), pair.run(), strict=True):
            scale = max(float(np.max(np.abs(b))), 1.0)
            assert np.max(np.abs(a - b)) <= scale * (1e-6 if dtype == np.float32 else 1e-13)


def test_the_mask_is_the_outputs_sign():
    """dy counts where the forward's y > 0: a value normalised to exactly 0 (or below)
    passes no gradient, like relu's; NaN in y masks too, and a NaN y is kept in forward."""
    x = np.array([[1.0, -1.0], [3.0, 1.0], [2.0, 0.0]])    # channel 0 normalises to -1.22, 1.22, 0
    pair = Pair(x, np.ones_like(x), "NCHW", True, use_global_est=False)
    out, dx, *_ = pair.run()
    assert out[2, 0] == 0.0 and out[0, 0] == 0.0 and out[1, 0] > 0
    bn_out = batch_norm_stats.relu_masked(np.ones((3, 2, 1)), out.reshape(3, 2, 1))
    assert bn_out[:, 0, 0].tolist() == [0.0, 1.0, 0.0]
    nan = Pair(np.array([[np.nan, 1.0], [1.0, 2.0]]), np.ones((2, 2)), "NCHW", True,
               use_global_est=True)
    out, *_ = nan.run(backward=False)
    assert np.isnan(out[0, 0])


def test_a_non_finite_batch_commits_nothing_as_batch_norm():
    x = rng.standard_normal((4, 3, 2, 2))
    x[1, 2, 0, 1] = np.inf
    fused = Pair(x, x, "NCHW", True)
    before = [v.get().copy() for v in fused.state]
    with pytest.raises(OpError, match="batch_norm_relu: the batch statistics are not finite"):
        fused.run()
    for v, want in zip(fused.state, before, strict=True):
        np.testing.assert_array_equal(v.get(), want)


def test_sync_form_in_a_world_of_one_is_the_fused_op(one_rank):
    ins = bn_inputs((5, 3, 4), "NCHW", dtype=np.float32)
    results = [helper_test_op(op_type, ins, {}, relu_reference)["y"]
               for op_type in ("batch_norm_relu", "sync_batch_norm_relu")]
    np.testing.assert_array_equal(*results)
    assert one_rank.calls == 0


# ---- the native kernels: relu and the mask ------------------------------------------------

@pytest.mark.skipif(not bn_native.available(), reason="native kernels not built")
@pytest.mark.parametrize("layout, shape", [("NCHW", (5, 3, 7)), ("NCHW", (3, 2, 1500)),
                                           ("NCHW", (30, 40, 2, 2)), ("NHWC", (7, 5, 4, 3)),
                                           ("NCHW", (33, 70))])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_native_relu_and_mask_match_numpy(layout, shape, dtype, monkeypatch):
    """bn_native's relu (forward, fused and not) and mask (gradient sums, fused and not,
    and the input gradient) against the numpy engine's."""
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    y = rng.standard_normal(shape).astype(dtype)
    x3, dy3, y3 = (batch_norm_stats.as_3d(a, layout) for a in (x, dy, y))
    c = x3.shape[1]
    scale, bias = rng.uniform(0.5, 2.0, c), rng.standard_normal(c)
    mean, var, n = batch_stats(x, layout)
    invstd = 1 / np.sqrt(var + 1e-5)
    out = np.empty_like(x3)
    bn_native.local_stats(x3, 1e-5, scale, bias, out, relu=True)
    want = np.maximum((x3 - mean[:, None]) * (invstd * scale)[:, None] + bias[:, None], 0)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol)
    assert bn_native.normalize(x3, mean, invstd * scale, bias, out, relu=True)
    np.testing.assert_allclose(out, want, rtol=tol, atol=tol)
    masked = np.where(y3 > 0, dy3, 0)
    want_dx, want_ds, want_db = batch_norm_grad(x, masked.reshape(x.shape), scale, mean, var,
                                                1e-5, layout, False)
    got_n, s_dy, s_dyx = bn_native.grad_sums(x3, dy3, mean, mask3=y3)
    np.testing.assert_allclose(s_dy, want_db, rtol=tol * 10, atol=tol * 10)
    dx = np.empty_like(x3)
    fused = bn_native.grad_sums(x3, dy3, mean, invstd, scale, dx, mask3=y3)
    np.testing.assert_array_equal(fused[1], s_dy)
    np.testing.assert_allclose(dx.reshape(x.shape), want_dx, rtol=tol * 100, atol=tol * 100)
    k_x, k_c = -scale * invstd ** 3 * s_dyx / n, -scale * invstd * s_dy / n
    into = dy3.copy()
    assert bn_native.input_grad(x3, into, mean, scale * invstd, k_x, k_c, into, mask3=y3)
    np.testing.assert_allclose(into.reshape(x.shape), want_dx, rtol=tol * 100, atol=tol * 100)
    assert bn_native.input_grad(x3, dy3, mean, scale * invstd, None, None, dx, mask3=y3)
    np.testing.assert_allclose(dx, masked * (scale * invstd)[:, None], rtol=tol, atol=tol)


# ---- ONNX ---------------------------------------------------------------------------------

def test_onnx_export_is_batch_normalization_then_relu(tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from minigraph import layers

    net = mg.Net(seed=0)
    img = layers.data(net, "image", shape=(-1, 3, 5, 5))
    h = layers.relu(net, layers.batch_norm(net, img, name="bn1"))
    nhwc = layers.transpose(net, h, (0, 2, 3, 1))
    h2 = layers.relu(net, layers.batch_norm(net, nhwc, name="bn2", data_layout="NHWC"))
    h3 = layers.relu(net, layers.batch_norm(net, h2, name="bn3", data_layout="NHWC",
                                            track_running_stats=False))
    mg.passes.fuse_batch_norm_relu(net)
    assert [op.type for op in net.ops("infer")].count("batch_norm_relu") == 3
    for v in net.persistables():                       # estimates that are not 0 and 1
        if v.name.endswith(("estimated_mean", "estimated_var", "bias")):
            v.set(np.linspace(0.5, 1.5, v.shape[0]).astype(np.float32))
    x = rng.standard_normal((2, 3, 5, 5)).astype(np.float32)
    (want,) = net.infer(feed={"image": x}, fetch=[h3])
    path = mg.onnx.export(net, tmp_path / "m.onnx", feeds=["image"], fetches=[h3])
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    kinds = [n.op_type for n in model.graph.node]
    assert kinds.count("BatchNormalization") == 2 and kinds.count("Relu") == 3
    (got,) = ort.InferenceSession(str(path)).run(None, {"image": x})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
