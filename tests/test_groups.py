"""Parameter groups and ParamAttr settings (minigraph.optimizer.groups, param_attr):
per-parameter learning-rate multipliers and weight decays against a numpy AdamW and
SGD run alongside, every bad element of `parameters` named, the second-optimizer
message, and ParamAttr's sharing, freezing and initialiser."""
import math
import warnings

import numpy as np
import pytest

import minigraph as mg
from minigraph import layers as L

rng = np.random.default_rng(0)
X = rng.standard_normal((6, 4))
Y = rng.integers(0, 3, 6)
FEED = {"x": X, "y": Y}


def build(seed=0, head_attr=None):
    net = mg.Net(seed=seed)
    x = L.data(net, "x", (-1, 4), "float64")
    y = L.data(net, "y", (-1,), "int64")
    h = L.relu(net, L.fc(net, x, 5, name="fc1"))
    out = L.fc(net, h, 3, name="head", param_attr=head_attr)
    loss = L.mean(net, L.softmax_with_cross_entropy(net, out, y))
    return net, loss


def run_against(opt, parameters, settings, rule, steps=5, head_attr=None):
    """Train with `opt` and `parameters`; a twin net without updates gives the raw
    gradients at the numpy-updated parameters; `rule(p, g, state, t, lr, wd)` updates
    one of them with settings[name] = (lr, wd). Returns the largest relative gap."""
    net, loss = build(head_attr=head_attr)
    opt.minimize(net, loss, parameters=parameters(net) if callable(parameters) else parameters)
    twin, tloss = build(head_attr=head_attr)
    mg.append_backward(twin, tloss)
    params = {p.name: p.get().copy() for p in net.parameters()}
    state = {n: {} for n in params}
    worst = 0.0
    for t in range(steps):
        for n, v in params.items():
            twin.var(n).set(v)
        grads = dict(zip(params, twin.train(feed=FEED, fetch=[twin.grad(n) for n in params])))
        net.train(feed=FEED)
        for n in params:
            lr, wd = settings[n]
            params[n] = rule(params[n], grads[n], state[n], t, lr, wd)
            got = net.var(n).get()
            worst = max(worst, float(np.max(np.abs(got - params[n]) /
                                            (np.abs(params[n]) + 1e-12))))
    return worst


def adamw(p, g, s, t, lr, wd, b1=0.9, b2=0.999, eps=1e-8):
    p = p * (1 - lr * wd)
    s["m"] = b1 * s.get("m", 0) + (1 - b1) * g
    s["v"] = b2 * s.get("v", 0) + (1 - b2) * g * g
    return p - lr / (1 - b1 ** (t + 1)) * s["m"] / (np.sqrt(s["v"]) /
                                                       math.sqrt(1 - b2 ** (t + 1)) + eps)


def sgd(p, g, s, t, lr, wd):
    return p - lr * (g + wd * p)


def test_groups_scale_the_rate_and_replace_the_decay():
    def groups(net):
        return [{"params": [net.var("fc1.w"), net.var("head.w")]},
                {"params": [net.var("fc1.b"), net.var("head.b")], "weight_decay": 0.0},
                ]
    settings = {"fc1.w": (0.01, 0.1), "head.w": (0.01, 0.1),
                "fc1.b": (0.01, 0.0), "head.b": (0.01, 0.0)}
    assert run_against(mg.optimizer.AdamW(0.01, weight_decay=0.1), groups, settings,
                       adamw) < 1e-10

    def head_fast(net):
        return [{"params": [net.var("fc1.w"), net.var("fc1.b")]},
                {"params": [net.var("head.w"), net.var("head.b")], "learning_rate": 10.0,
                 "weight_decay": 0.05}]
    settings = {"fc1.w": (0.01, 0.1), "fc1.b": (0.01, 0.1),
                "head.w": (0.1, 0.05), "head.b": (0.1, 0.05)}
    assert run_against(mg.optimizer.AdamW(0.01, weight_decay=0.1), head_fast, settings,
                       adamw) < 1e-10


def test_a_group_multiplies_the_schedule_and_param_attr_multiplies_the_group():
    schedule = mg.optimizer.lr.StepDecay(0.2, step_size=2, gamma=0.5)
    head = mg.ParamAttr(learning_rate=0.5, weight_decay=0.3)

    def groups(net):
        return [{"params": [net.var("fc1.w"), net.var("fc1.b")], "weight_decay": 0.0},
                {"params": [net.var("head.w"), net.var("head.b")], "learning_rate": 4.0}]
    def rule(p, g, s, t, lr, wd):
        return sgd(p, g, s, t, 0.2 * 0.5 ** (t // 2) * lr, wd)
    settings = {"fc1.w": (1.0, 0.0), "fc1.b": (1.0, 0.0), "head.w": (2.0, 0.3),
                "head.b": (4.0, 0.01)}
    assert run_against(mg.optimizer.SGD(schedule, weight_decay=0.01), groups, settings, rule,
                       head_attr=head) < 1e-12


def test_plain_variables_and_groups_mix_and_leaving_one_out_freezes_it():
    """A parameter left out is not trained, and a warning names it."""
    net, loss = build()
    before = net.var("head.b").get().copy()
    with pytest.warns(UserWarning, match="the trainable parameter 'head.b' is in no element "
                                         "of parameters and will not be trained") as seen:
        mg.optimizer.SGD(0.1).minimize(net, loss, parameters=[
            net.var("fc1.w"), {"params": net.var("fc1.b")}, net.var("head.w")])
    assert len(seen) == 1 and seen[0].filename == __file__      # points at the caller
    net.train(feed=FEED)
    np.testing.assert_array_equal(net.var("head.b").get(), before)
    assert [op.inputs["param"].name for op in net.section("update")] == \
        ["fc1.w", "fc1.b", "head.w"]


@pytest.mark.parametrize("make, error, message", [
    (lambda net: [], ValueError, "SGD.minimize: parameters is empty; nothing would be "
                                 "trained"),
    (lambda net: {"params": [net.var("fc1.w")]}, TypeError, "SGD.minimize: parameters must be "
                                                             "None or a list"),
    (lambda net: [{"params": [net.var("fc1.w")], "lr": 0.1}], ValueError,
     "SGD.minimize: parameters\\[0\\] has unknown keys \\['lr'\\]; a group's keys are params, "
     "learning_rate, weight_decay"),
    (lambda net: [{"params": []}], ValueError, "parameters\\[0\\]\\['params'\\] must be a "
                                               "non-empty list"),
    (lambda net: [net.var("fc1.w"), "fc1.b"], TypeError, "parameters\\[1\\] must be a "
                                                         "parameter Variable, got str"),
    (lambda net: [{"params": [net.var("fc1.w"), net.var("fc1.out", "train")]}], ValueError,
     "parameters\\[0\\]\\['params'\\]\\[1\\] \\('fc1.out'\\) is not a parameter of this net"),
    (lambda net: [net.var("fc1.w"), {"params": [net.var("fc1.w")]}], ValueError,
     "parameters\\[1\\]\\['params'\\]\\[0\\] \\('fc1.w'\\) is also parameters\\[0\\]"),
    (lambda net: [{"params": [net.var("fc1.w")], "learning_rate": -1}], ValueError,
     "parameters\\[0\\]\\['learning_rate'\\] must be a finite number"),
    (lambda net: [{"params": [net.var("fc1.w")], "weight_decay": float("nan")}], ValueError,
     "parameters\\[0\\]\\['weight_decay'\\] must be a finite number"),
    (lambda net: [build()[0].var("fc1.w")], ValueError, "is not a parameter of this net"),
])
def test_every_bad_element_is_named_and_nothing_is_built(make, error, message):
    net, loss = build()
    sizes = {s: len(net.section(s)) for s in ("backward", "update")}
    opt = mg.optimizer.SGD(0.1)
    with pytest.raises(error, match=message):
        opt.minimize(net, loss, parameters=make(net))
    assert {s: len(net.section(s)) for s in sizes} == sizes
    assert net.optimizer is None and net.loss is None
    opt.minimize(net, loss)                   # the same optimizer still works after


def test_a_frozen_parameter_in_a_group_is_an_error():
    net, loss = build(head_attr=mg.ParamAttr(trainable=False))
    with pytest.raises(ValueError, match="parameters\\[0\\] \\('head.w'\\) is frozen"):
        mg.optimizer.SGD(0.1).minimize(net, loss, parameters=[net.var("head.w")])


def test_a_second_optimizer_is_told_to_use_groups():
    net, loss = build()
    with pytest.warns(UserWarning, match="'fc1.b', 'head.w', 'head.b' are in no element"):
        mg.optimizer.SGD(0.1).minimize(net, loss, parameters=[net.var("fc1.w")])
    with pytest.raises(ValueError, match=r"Adam.minimize: this net is already minimised \(by "
                                         r"SGD\); a net has one optimizer: give it parameter "
                                         "groups instead"):
        mg.optimizer.Adam().minimize(net, loss, parameters=[net.var("head.w")])


# ---- ParamAttr ---------------------------------------------------------------------

def test_the_same_name_twice_is_one_shared_parameter_whose_gradients_add():
    net = mg.Net(seed=0)
    a = L.data(net, "a", (-1, 3), "float64")
    b = L.data(net, "b", (-1, 3), "float64")
    ya = L.fc(net, a, 2, param_attr="enc.w", bias_attr="enc.b", name="left")
    yb = L.fc(net, b, 2, param_attr="enc.w", bias_attr=mg.ParamAttr(name="enc.b"),
              name="right")
    loss = L.mean(net, L.add(net, L.square(net, ya), yb))
    assert [p.name for p in net.parameters()] == ["enc.w", "enc.b"]
    mg.append_backward(net, loss)
    fa, fb = rng.standard_normal((4, 3)), rng.standard_normal((4, 3))
    w, bias = net.var("enc.w").get(), net.var("enc.b").get()
    (gw, gb) = net.train(feed={"a": fa, "b": fb}, fetch=[net.grad("enc.w"), net.grad("enc.b")])
    za = fa @ w + bias
    d = 1.0 / za.size
    np.testing.assert_allclose(gw, fa.T @ (2 * za * d) + fb.T @ np.full_like(za, d), rtol=1e-12)
    np.testing.assert_allclose(gb, (2 * za * d).sum(0) + za.shape[0] * d, rtol=1e-12)
    assert "left (fc)" in net.summary() and "enc.w" not in [r.name for r in net.layers]


@pytest.mark.parametrize("second, message", [
    (dict(size=3), "fc: argument 'param_attr' names the shared parameter 'enc.w' of shape "
                   "\\(3, 2\\) and dtype float64; this layer needs shape \\(3, 3\\)"),
    (dict(size=2, param_attr=mg.ParamAttr(name="enc.w", learning_rate=2.0)),
     "fc: argument 'param_attr' shares 'enc.w' with other settings"),
])
def test_sharing_checks_shape_and_settings(second, message):
    net = mg.Net(seed=0)
    a = L.data(net, "a", (-1, 3), "float64")
    L.fc(net, a, 2, param_attr="enc.w")
    kwargs = {"param_attr": "enc.w", **second}
    with pytest.raises(ValueError, match=message):
        L.fc(net, a, **kwargs)
    assert [p.name for p in net.parameters()] == ["enc.w", "fc_0.b"]


def test_a_name_that_is_no_layer_parameter_is_refused():
    net = mg.Net(seed=0)
    a = L.data(net, "a", (-1, 3), "float64")
    L.batch_norm(net, a, name="bn")
    with pytest.raises(ValueError, match="fc: argument 'param_attr' names 'bn.estimated_mean', "
                                         "which is not a parameter made by a layer"):
        L.fc(net, a, 3, param_attr="bn.estimated_mean")


def test_freezing_by_param_attr_and_by_flag_shows_in_summary_and_training():
    net, loss = build(head_attr=mg.ParamAttr(trainable=False))
    net.var("fc1.b").trainable = False             # frozen after the build, before minimize
    text = net.summary()
    assert "trainable parameters:     23" in text           # fc1.w 4x5, head.b 3
    assert "non-trainable values:     20" in text           # fc1.b 5, head.w 5x3
    before = {p.name: p.get().copy() for p in net.persistables()}
    mg.optimizer.SGD(0.5).minimize(net, loss)
    net.train(feed=FEED)
    for name in ("head.w", "fc1.b"):
        np.testing.assert_array_equal(net.var(name).get(), before[name])
    assert not np.array_equal(net.var("fc1.w").get(), before["fc1.w"])


def test_bias_false_and_a_chosen_initializer():
    net = mg.Net(seed=0)
    x = L.data(net, "x", (-1, 2, 5, 5))
    L.conv2d(net, x, 4, 3, bias_attr=False, name="c",
             param_attr=mg.ParamAttr(initializer=mg.initializer.Constant(0.5)))
    L.fc(net, x, 3, bias=False, name="f")
    names = [p.name for p in net.parameters()]
    assert names == ["c.w", "f.w"]
    np.testing.assert_array_equal(net.var("c.w").get(), 0.5)


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(learning_rate=-1.0), ValueError, "ParamAttr: learning_rate must be a finite number "
                                           ">= 0"),
    (dict(weight_decay=float("inf")), ValueError, "ParamAttr: weight_decay must be a finite "
                                                  "number >= 0 or None"),
    (dict(name=""), TypeError, "ParamAttr: name must be a non-empty str"),
    (dict(initializer="xavier"), TypeError, "ParamAttr: initializer must be a "
                                            "minigraph.initializer"),
    (dict(trainable=1), TypeError, "ParamAttr: trainable must be True or False"),
])
def test_bad_param_attrs(kwargs, error, message):
    with pytest.raises(error, match=message):
        mg.ParamAttr(**kwargs)


def test_param_attr_arguments_are_checked_by_the_layer():
    net = mg.Net(seed=0)
    x = L.data(net, "x", (-1, 3))
    with pytest.raises(TypeError, match="fc: argument 'bias_attr' must be a ParamAttr, a str "
                                        "\\(the parameter's name\\) or None, got int"):
        L.fc(net, x, 2, bias_attr=3)
    assert net.parameters() == []


@pytest.mark.parametrize("first, second", [
    (mg.ParamAttr(name="enc.w", initializer=mg.initializer.Constant(0.5)),
     mg.ParamAttr(name="enc.w", initializer=mg.initializer.Constant(2.0))),
    (mg.ParamAttr(name="enc.w"),                     # the layer's default, KaimingUniform
     mg.ParamAttr(name="enc.w", initializer=mg.initializer.Xavier())),
])
def test_sharing_with_another_initializer_is_an_error_naming_both(first, second):
    """The second use of a shared name used to keep the first initializer silently."""
    net = mg.Net(seed=0)
    a = L.data(net, "a", (-1, 3), "float64")
    L.fc(net, a, 2, param_attr=first, name="left")
    before = net.var("enc.w").get().copy()
    with pytest.raises(ValueError, match=r"fc: argument 'param_attr' shares 'enc.w' with the "
                                         r"initializer .*, but its first use initialised it "
                                         r"with .*; a shared parameter has one initializer"):
        L.fc(net, a, 2, param_attr=second, name="right")
    np.testing.assert_array_equal(net.var("enc.w").get(), before)
    assert [r.name for r in net.layers] == ["left"]


def test_sharing_with_the_same_initializer_or_none_shares():
    net = mg.Net(seed=0)
    a = L.data(net, "a", (-1, 3), "float64")
    same = mg.ParamAttr(name="enc.w", initializer=mg.initializer.Constant(0.5))
    L.fc(net, a, 2, param_attr=same, name="left")
    L.fc(net, a, 2, param_attr=mg.ParamAttr(name="enc.w",
                                            initializer=mg.initializer.Constant(0.5)))
    L.fc(net, a, 2, param_attr="enc.w")                 # no initializer given: shares
    assert [p.name for p in net.parameters()].count("enc.w") == 1
    np.testing.assert_array_equal(net.var("enc.w").get(), np.full((3, 2), 0.5))


def test_every_parameter_listed_or_frozen_warns_nothing():
    net, loss = build(head_attr=mg.ParamAttr(trainable=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        mg.optimizer.SGD(0.1).minimize(net, loss, parameters=[
            {"params": [net.var("fc1.w"), net.var("fc1.b")]}, net.var("head.b")])
