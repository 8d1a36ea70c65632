"""group_norm, instance_norm and layer_norm on PyTorch's terms: channels last, ranks 3 and 5,
affine=False and scale without shift, epsilon 0 (a zero variance names where it is), an
empty batch, one value per group, against the float64 references; gradients against
finite differences; the layers' arguments checked when they are built."""
import numpy as np
import pytest
from helpers import helper_test_op
from references_norms import group_norm as gn_reference
from references_norms import instance_norm as in_reference
from references_norms import layer_norm as ln_reference

import minigraph as mg
from minigraph import layers as L

rng = np.random.default_rng(7)


def affine_inputs(x, c, which):
    """x and the scale and/or bias of `which` ("both", "scale", "bias", "none")."""
    ins = {"x": x}
    if which in ("both", "scale"):
        ins["scale"] = rng.standard_normal(c)
    if which in ("both", "bias"):
        ins["bias"] = rng.standard_normal(c)
    return ins


def grads_of(ins):
    return tuple(k for k in ("x", "scale", "bias") if k in ins)


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("shape, groups", [((3, 6), 3), ((4, 6, 4), 2), ((2, 3, 4, 6), 3),
                                           ((2, 2, 3, 2, 4), 2), ((1, 4, 3, 4), 4)])
@pytest.mark.parametrize("which", ["both", "scale", "bias", "none"])
def test_group_norm_layouts_ranks_and_affine_parts(layout, shape, groups, which):
    c = shape[1] if layout == "NCHW" else shape[-1]
    ins = affine_inputs(rng.standard_normal(shape) * 2 + 1, c, which)
    helper_test_op("group_norm", ins, {"groups": groups, "data_layout": layout},
                   gn_reference, grad_wrt=grads_of(ins), outputs=["y"])


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("shape", [(3, 4, 7), (2, 3, 4, 5), (2, 3, 2, 3, 4)])
@pytest.mark.parametrize("which", ["both", "scale", "none"])
def test_instance_norm_layouts_ranks_and_affine_parts(layout, shape, which):
    c = shape[1] if layout == "NCHW" else shape[-1]
    ins = affine_inputs(rng.standard_normal(shape) - 2, c, which)
    helper_test_op("instance_norm", ins, {"data_layout": layout, "epsilon": 1e-3},
                   in_reference, grad_wrt=grads_of(ins), outputs=["y"])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_channels_last_keeps_the_dtype(dtype):
    x = (rng.standard_normal((3, 5, 4, 6)) * 3).astype(dtype)
    helper_test_op("group_norm", {"x": x, "scale": np.ones(6, dtype)},
                   {"groups": 2, "data_layout": "NHWC"}, gn_reference)


def test_channels_last_offset_data_keeps_its_variance():
    x = (1e4 + rng.standard_normal((2, 32, 32, 4))).astype(np.float32)
    got = helper_test_op("group_norm", {"x": x}, {"groups": 2, "data_layout": "NHWC"}, None)
    want = np.moveaxis(x.astype(np.float64), -1, 1).reshape(2, 2, -1).var(axis=2)
    np.testing.assert_allclose(got["variance"], want, rtol=1e-3)


@pytest.mark.parametrize("shape, begin", [((3, 4, 5), 2), ((2, 3, 2, 2, 5), 3),
                                          ((2, 3, 2, 2, 5), 1)])
@pytest.mark.parametrize("scale, shift", [(True, False), (False, True), (False, False),
                                          (True, True)])
def test_layer_norm_every_affine_combination_on_ranks_3_and_5(shape, begin, scale, shift):
    length = int(np.prod(shape[begin:]))
    ins = {"x": rng.standard_normal(shape) + 3}
    if scale:
        ins["scale"] = rng.standard_normal(length)
    if shift:
        ins["bias"] = rng.standard_normal(length)
    helper_test_op("layer_norm", ins, {"begin_norm_axis": begin}, ln_reference,
                   grad_wrt=grads_of(ins), outputs=["y"])


# ---- epsilon 0 -------------------------------------------------------------------------

def test_epsilon_zero_normalises_with_the_variance_alone():
    x = rng.standard_normal((3, 4, 5))
    helper_test_op("group_norm", {"x": x}, {"groups": 2, "epsilon": 0.0}, gn_reference,
                   grad_wrt=("x",), outputs=["y"])
    helper_test_op("instance_norm", {"x": x}, {"epsilon": 0.0}, in_reference, grad_wrt=("x",),
                   outputs=["y"])
    helper_test_op("layer_norm", {"x": x}, {"epsilon": 0.0}, ln_reference, grad_wrt=("x",),
                   outputs=["y"])


@pytest.mark.parametrize("op_type, attrs, where", [
    ("group_norm", {"groups": 2}, "sample 1, group 1"),
    ("group_norm", {"groups": 2, "data_layout": "NHWC"}, "sample 1, group 1"),
    ("instance_norm", {}, "sample 1, channel 2"),
    ("instance_norm", {"data_layout": "NHWC"}, "sample 1, channel 2"),
    ("layer_norm", {"begin_norm_axis": 2}, r"row \(1, 2\)"),
])
def test_epsilon_zero_and_a_zero_variance_name_where(op_type, attrs, where):
    x = rng.standard_normal((2, 4, 3, 3))
    if attrs.get("data_layout") == "NHWC":
        x = rng.standard_normal((2, 3, 3, 4))
        x[1, :, :, 2:] = 5.0
    elif op_type == "layer_norm":
        x[1, 2] = 5.0
    else:
        x[1, 2:] = 5.0
    with pytest.raises(mg.OpError, match=f"{op_type}: epsilon is 0 and {where} .*variance 0"):
        helper_test_op(op_type, {"x": x}, {**attrs, "epsilon": 0.0}, None)
    helper_test_op(op_type, {"x": x}, {**attrs, "epsilon": 1e-5}, None)   # fine with eps


def test_negative_epsilon_is_rejected_by_the_ops_and_the_layers():
    scope = mg.Scope()
    vs = {n: scope.new_var(n) for n in ("x", "y", "mean", "variance")}
    vs["x"].declare((2, 4, 3), "float32")
    with pytest.raises(mg.OpError, match="instance_norm: attribute 'epsilon'.*>= 0"):
        mg.Operator("instance_norm", epsilon=-1e-5, **vs)
    net = mg.Net()
    x = L.data(net, "x", shape=(-1, 4, 3))
    for build in (lambda: L.group_norm(net, x, 2, epsilon=-1.0),
                  lambda: L.instance_norm(net, x, epsilon=-1.0),
                  lambda: L.layer_norm(net, x, epsilon=-1.0)):
        with pytest.raises(ValueError, match=r"_norm: argument 'epsilon'"):
            build()


# ---- empty batches and one value per group ------------------------------------------------

@pytest.mark.parametrize("op_type, attrs, shape", [
    ("group_norm", {"groups": 2}, (0, 4, 3, 3)),
    ("group_norm", {"groups": 2, "data_layout": "NHWC"}, (0, 3, 3, 4)),
    ("instance_norm", {}, (0, 4, 5)),
    ("instance_norm", {"data_layout": "NHWC"}, (0, 5, 4)),
    ("layer_norm", {}, (0, 5)),
])
def test_an_empty_batch_gives_an_empty_output_and_zero_parameter_gradients(op_type, attrs,
                                                                           shape):
    c = shape[-1] if attrs.get("data_layout") == "NHWC" or op_type == "layer_norm" else shape[1]
    ins = {"x": np.zeros(shape), "scale": np.ones(c), "bias": np.zeros(c)}
    got = helper_test_op(op_type, ins, attrs, None)
    assert got["y"].shape == shape
    from minigraph.schema import get_schema
    grads = helper_grads(op_type, ins, attrs, got)
    assert grads["dx"].shape == shape
    np.testing.assert_array_equal(grads["dscale"], np.zeros(c))
    np.testing.assert_array_equal(grads["dbias"], np.zeros(c))
    assert get_schema(op_type).mode_attr is None


def helper_grads(op_type, ins, attrs, outs):
    """The grad op's outputs for dy = ones, from the forward's statistics."""
    scope = mg.Scope()
    v = {}
    for name, value in {"x": ins["x"], "scale": ins["scale"], "mean": outs["mean"],
                        "variance": outs["variance"], "dy": np.ones_like(outs["y"])}.items():
        v[name] = scope.new_var(name)
        v[name].set(np.asarray(value))
    got = {s: scope.new_var(s) for s in ("dx", "dscale", "dbias")}
    op = mg.Operator(op_type + "_grad", **v, **got, **attrs)
    values = mg.Executor(mg.CPUPlace()).run([op], scope, fetch=list(got.values()))
    return dict(zip(got, values))


def test_one_value_per_group_is_an_error_for_a_single_sample_only():
    x = rng.standard_normal((1, 10, 1))
    with pytest.raises(mg.OpError, match="group_norm: input 'x' needs more than one value per "
                                         "group"):
        helper_test_op("group_norm", {"x": x}, {"groups": 10}, None)
    net = mg.Net()
    d = L.data(net, "x", shape=(-1, 10, 1))
    y = L.group_norm(net, d, 10, affine=False)     # the batch size is not known yet
    with pytest.raises(mg.OpError, match="group_norm: input 'x' needs more than one value per "
                                         "group"):
        net.infer(feed={"x": x.astype(np.float32)}, fetch=[y])
    (two,) = net.infer(feed={"x": np.ones((2, 10, 1), np.float32)}, fetch=[y])
    np.testing.assert_array_equal(two, 0.0)        # two samples: PyTorch's zeros too


# ---- the layers -------------------------------------------------------------------------

def test_the_layers_take_pytorchs_argument_names():
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 5, 4, 6))
    L.group_norm(net, x, 3, affine=False, data_layout="NHWC", name="g0")
    L.group_norm(net, x, 3, bias=False, data_layout="NHWC", name="g1")
    L.instance_norm(net, x, affine=False, data_layout="NHWC", name="i0")
    L.instance_norm(net, x, bias=False, name="i1")
    L.instance_norm(net, x, name="i2")                       # ours: affine by default
    assert [v.name for v in net.persistables()] == ["g1.scale", "i1.scale", "i2.scale",
                                                    "i2.bias"]
    assert not net.forked
    ops = {op.outputs["y"].name: op for op in net.ops("train")}
    assert ops["g0.y"].attrs["data_layout"] == "NHWC" and ops["g0.y"].inputs["scale"] is None
    assert ops["i2.y"].attrs["data_layout"] == "NCHW"


@pytest.mark.parametrize("build, match", [
    (lambda n, x: L.group_norm(n, x, 2, affine=1), "group_norm: argument 'affine'"),
    (lambda n, x: L.group_norm(n, x, 2, bias="no"), "group_norm: argument 'bias'"),
    (lambda n, x: L.group_norm(n, x, 2, data_layout="NWC"), "group_norm: argument 'data_layout'"),
    (lambda n, x: L.group_norm(n, x, 4, data_layout="NHWC"),
     r"group_norm: argument 'groups' \(4\) must divide the 6 channels"),
    (lambda n, x: L.instance_norm(n, x, affine=None), "instance_norm: argument 'affine'"),
    (lambda n, x: L.instance_norm(n, x, track_running_stats=1),
     "instance_norm: argument 'track_running_stats'"),
    (lambda n, x: L.instance_norm(n, x, momentum=1.5), "instance_norm: argument 'momentum'"),
    (lambda n, x: L.instance_norm(n, x, first_batch_sets_estimates=0),
     "instance_norm: argument 'first_batch_sets_estimates'"),
    (lambda n, x: L.instance_norm(n, x, spatial_dims=4), "instance_norm: argument 'spatial_dims'"),
    (lambda n, x: L.instance_norm(n, x, spatial_dims=1),
     r"instance_norm: argument 'x' .* must have rank 2 \(no batch axis\) or 3"),
    (lambda n, x: L.instance_norm(n, x, data_layout="CHW"),
     "instance_norm: argument 'data_layout'"),
    (lambda n, x: L.layer_norm(n, x, shift=None), "layer_norm: argument 'shift'"),
])
def test_every_new_option_is_checked_when_the_layer_is_built(build, match):
    net = mg.Net()
    x = L.data(net, "x", shape=(-1, 6, 4, 6))
    with pytest.raises(ValueError, match=match):
        build(net, x)
    assert not net.persistables()


@pytest.mark.parametrize("kind", ["group_norm", "instance_norm"])
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_the_layers_train_channels_last_and_match_the_reference(kind, layout):
    net = mg.Net(seed=1)
    shape = (-1, 4, 5, 6) if layout == "NCHW" else (-1, 5, 6, 4)
    x = L.data(net, "x", shape=shape)
    y = (L.group_norm(net, x, 2, data_layout=layout, name="n") if kind == "group_norm" else
         L.instance_norm(net, x, data_layout=layout, name="n"))
    w = L.data(net, "w", shape=shape)
    loss = L.mean(net, L.multiply(net, y, w))
    mg.optimizer.SGD(0.5).minimize(net, loss)
    feed = {"x": rng.standard_normal((3, *shape[1:])).astype(np.float32),
            "w": rng.standard_normal((3, *shape[1:])).astype(np.float32)}
    for _ in range(2):
        net.train(feed=feed, fetch=[loss])
    scale, bias = net.var("n.scale").get(), net.var("n.bias").get()
    assert np.abs(scale - 1).max() > 0
    (out,) = net.infer(feed={"x": feed["x"]}, fetch=[y])
    ref = (gn_reference(feed["x"], scale, bias, 2, data_layout=layout) if kind == "group_norm"
           else in_reference(feed["x"], scale, bias, data_layout=layout))
    np.testing.assert_allclose(out, ref["y"], rtol=1e-5, atol=1e-5)
