import math

import numpy as np
import pytest

import minigraph as mg
from minigraph import initializer as init


def _init(initializer, shape, seed=3, fan_in=None, fan_out=None):
    scope = mg.Scope()
    var = scope.new_var("w", persistable=True)
    var.declare(shape, "float32")
    desc = initializer.op(var, seed=seed, fan_in=fan_in, fan_out=fan_out)
    mg.Executor().run([mg.Operator(desc.type, **desc.kwargs)], scope)
    return var.get()


def test_constant_uniform_normal():
    np.testing.assert_array_equal(_init(init.Constant(2.5), (3, 2)), np.full((3, 2), 2.5))
    u = _init(init.Uniform(-0.5, 2.0), (200, 100))
    assert u.dtype == np.float32 and u.min() >= -0.5 and u.max() <= 2.0
    assert abs(u.mean() - 0.75) < 0.02
    g = _init(init.Normal(1.0, 3.0), (200, 100))
    assert abs(g.mean() - 1.0) < 0.05 and abs(g.std() - 3.0) < 0.05


def test_xavier_uses_fan_in_plus_fan_out():
    w = _init(init.Xavier(), (300, 100))                     # fc weight: (in, out)
    bound = math.sqrt(6.0 / (300 + 100))
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.98 * bound
    conv = _init(init.Xavier(uniform=False), (64, 32, 3, 3))  # conv: (out, in, kh, kw)
    assert abs(conv.std() - math.sqrt(2.0 / (32 * 9 + 64 * 9))) < 0.002


def test_kaiming_uses_fan_in_and_relu_gain():
    w = _init(init.Kaiming(), (64, 32, 3, 3))
    assert abs(w.std() - math.sqrt(2.0 / (32 * 9))) < 0.003
    u = _init(init.Kaiming(uniform=True), (500, 10), fan_in=500)
    assert np.abs(u).max() <= math.sqrt(6.0 / 500)
    explicit = _init(init.Kaiming(), (10, 10), fan_in=1000)
    assert explicit.std() < 0.1


def test_same_seed_same_values_other_seed_other_values():
    a = _init(init.Xavier(), (20, 30), seed=7)
    b = _init(init.Xavier(), (20, 30), seed=7)
    c = _init(init.Xavier(), (20, 30), seed=8)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_layers_initialise_as_pytorch_and_bn_to_identity():
    """fc and conv2d: weights and biases U(+-1/sqrt(fan_in)) (nn.Linear's and nn.Conv2d's
    kaiming_uniform(a=sqrt(5)) and bias init); batch norm the identity."""
    net = mg.Net(seed=0)
    x = mg.layers.data(net, "x", shape=(-1, 3, 8, 8))
    h = mg.layers.conv2d(net, x, num_filters=64, filter_size=3, name="c")
    mg.layers.batch_norm(net, h, name="bn")
    f = mg.layers.fc(net, h, 300, name="f")
    assert f.shape == (-1, 300)
    for name, fan_in in (("c", 27), ("f", 64 * 36)):
        bound = 1 / np.sqrt(fan_in)
        for part in ("w", "b"):
            v = net.var(f"{name}.{part}").get().astype(np.float64)
            assert np.abs(v).max() <= bound and np.abs(v).max() > 0.95 * bound, (name, part)
            assert abs(v.std() - bound / np.sqrt(3)) < 0.2 * bound, (name, part)
    np.testing.assert_array_equal(net.var("bn.scale").get(), np.ones(64))
    np.testing.assert_array_equal(net.var("bn.estimated_var").get(), np.ones(64))
    assert net.var("bn.num_batches").get() == 0 and net.var("bn.num_batches").dtype == np.int64


def test_bad_fill_op_attributes_are_op_errors():
    """The fill ops check their attributes too (an op built without an initializer)."""
    scope = mg.Scope()
    var = scope.new_var("w", persistable=True)
    with pytest.raises(mg.OpError, match="gaussian_random: attribute 'std' must be >= 0"):
        mg.Operator("gaussian_random", out=var, shape=(2, 2), dtype="float32", mean=0.0,
                    std=-1.0, seed=0, zero_row=-1)


@pytest.mark.parametrize("make, error, message", [
    (lambda: init.Constant(float("nan")), ValueError, "Constant: argument 'value' must be a "
                                                      "finite number"),
    (lambda: init.Constant(float("inf")), ValueError, "Constant: argument 'value'"),
    (lambda: init.Constant("1"), ValueError, "Constant: argument 'value' must be a number"),
    (lambda: init.Uniform(0, float("nan")), ValueError, "Uniform: argument 'high'"),
    (lambda: init.Uniform(1.0, -1.0), ValueError, "Uniform: argument 'high' \\(-1.0\\) must be "
                                                  ">= 'low' \\(1.0\\)"),
    (lambda: init.Uniform(-1e308, 1e308), ValueError, "Uniform: the range high - low"),
    (lambda: init.Normal(float("inf"), 1.0), ValueError, "Normal: argument 'mean'"),
    (lambda: init.Normal(0.0, -1.0), ValueError, "Normal: argument 'std' must be a finite "
                                                 "number in \\[0"),
    (lambda: init.Normal(0.0, 1.0, zero_row=1.5), TypeError, "Normal: argument 'zero_row'"),
    (lambda: init.Xavier(gain=-1), ValueError, "Xavier: argument 'gain' must be a finite "
                                               "number in \\[0"),
    (lambda: init.Xavier(uniform="yes"), TypeError, "Xavier: argument 'uniform' must be True "
                                                    "or False"),
    (lambda: init.Kaiming(gain=float("nan")), ValueError, "Kaiming: argument 'gain'"),
    (lambda: init.KaimingUniform(a=float("inf")), ValueError, "KaimingUniform: argument 'a'"),
])
def test_initializers_check_their_arguments_when_made(make, error, message):
    with pytest.raises(error, match=message):
        make()


@pytest.mark.parametrize("initializer, message", [
    (init.Uniform(0, 1e39), "Uniform: argument 'high' gives 1e\\+39, beyond the range of the "
                            "float32 parameter 'w'"),
    (init.Constant(-1e39), "Constant: argument 'value' gives -1e\\+39"),
    (init.Normal(0.0, 1e38), "Normal: argument 'std' gives"),
    (init.Xavier(gain=1e39), "Xavier: argument 'gain' gives"),
])
def test_values_the_parameters_dtype_cannot_hold_are_refused(initializer, message):
    """A float32 parameter filled with inf (Uniform(0, 1e39)) trained into NaN with no
    error; the same initializers are fine for float64."""
    with pytest.raises(ValueError, match=message):
        _init(initializer, (4, 4))
    scope = mg.Scope()
    var = scope.new_var("w64", persistable=True)
    var.declare((4, 4), "float64")
    initializer.op(var)


@pytest.mark.parametrize("initializer, fan_out, which", [
    (init.Xavier(), 0, "fan_in \\+ fan_out 0"), (init.Kaiming(), 3, "fan_in 0"),
    (init.KaimingUniform(), 3, "fan_in 0")])
def test_a_fan_of_zero_is_an_error_naming_the_parameter(initializer, fan_out, which):
    with pytest.raises(ValueError, match=f"{type(initializer).__name__}: parameter 'w' of "
                                         f"shape \\(0, 3\\) has {which}"):
        _init(initializer, (0, 3), fan_in=0, fan_out=fan_out)
