"""The elementwise math maps of kernels/cuda/math.cu (exp, log, sqrt, square, abs, pow,
scale, clip and their gradients, launched by kernels/cuda/map.py, the two-scalar
maps included) and kernels/cuda/loss.py (sigmoid cross entropy with logits) against
float64 numpy references, on the emulator and (marked gpu) a real GPU: aligned and
offset data, scalars of shape (), NaN, infinite clip bounds and extreme logits."""
from __future__ import annotations

import numpy as np
import pytest
from launcher_harness import TOL, rel_err, rng

import minigraph as mg
from minigraph.kernels.cuda import loss
from minigraph.kernels.cuda import map as maps

UNARY = {  # name: (scalars, positive inputs, reference(x))
    "exp": ((), False, np.exp),
    "log": ((), True, np.log),
    "sqrt": ((), True, np.sqrt),
    "square": ((), False, np.square),
    "abs": ((), False, np.abs),
    "pow": ((2.5,), True, lambda x: x ** 2.5),
    "scale": ((-1.5, 0.25), False, lambda x: x * -1.5 + 0.25),
    "clip": ((-1.0, 2.0), False, lambda x: np.clip(x, -1.0, 2.0)),
}
BINARY = {  # name: (scalars, positive first operand, operand from the forward, reference)
    "exp_grad": ((), False, np.exp, lambda o, d: d * o),
    "log_grad": ((), True, None, lambda x, d: d / x),
    "sqrt_grad": ((), True, np.sqrt, lambda o, d: d * 0.5 / o),
    "square_grad": ((), False, None, lambda x, d: 2 * x * d),
    "abs_grad": ((), False, None, lambda x, d: np.sign(x) * d),
    "pow_grad": ((2.5,), True, None, lambda x, d: 2.5 * x ** 1.5 * d),
    "clip_grad": ((-1.0, 2.0), False, None, lambda x, d: ((x >= -1) & (x <= 2)) * d),
}


def data(shape, dtype, positive, seed=0):
    x = rng(seed).normal(size=shape) * 3
    return (np.abs(x) + 0.1 if positive else x).astype(dtype)


@pytest.mark.parametrize("name", sorted(UNARY))
@pytest.mark.parametrize("shape", [(), (7,), (4, 9)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
def test_unary_math_maps(device, name, shape, dtype, offset):
    scalars, positive, ref = UNARY[name]
    x = data(shape, dtype, positive)
    got = device.get(maps.unary("math", name, device.put(x, offset), *scalars))
    assert got.dtype == dtype and got.shape == shape
    assert rel_err(got, ref(x.astype(np.float64))) < TOL[dtype]


@pytest.mark.parametrize("name", sorted(BINARY))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
def test_math_grad_maps(device, name, dtype, offset):
    scalars, positive, forward, ref = BINARY[name]
    a = data((5, 11), dtype, positive, 1)
    if forward is not None:
        a = forward(a.astype(np.float64)).astype(dtype)
    d = data((5, 11), dtype, False, 2)
    got = device.get(maps.binary("math", name, device.put(a, offset), device.put(d, offset),
                                 *scalars))
    assert rel_err(got, ref(a.astype(np.float64), d.astype(np.float64))) < TOL[dtype]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_and_infinite_bounds_like_numpy(device, dtype):
    x = np.array([np.nan, -np.inf, -3.0, -0.0, 0.0, 1.0, 3.0, np.inf], dtype)
    ones = np.ones_like(x)
    for lo, hi in ((-1.0, 2.0), (-np.inf, 0.5), (0.5, np.inf), (1.0, 1.0)):
        got = device.get(maps.unary("math", "clip", device.put(x), lo, hi))
        np.testing.assert_array_equal(got, np.minimum(np.maximum(x, lo), hi))
        got = device.get(maps.binary("math", "clip_grad", device.put(x), device.put(ones), lo, hi))
        np.testing.assert_array_equal(got, ((x >= lo) & (x <= hi)).astype(dtype))
    got = device.get(maps.binary("math", "abs_grad", device.put(x), device.put(ones)))
    np.testing.assert_array_equal(got, np.sign(x))
    with np.errstate(invalid="ignore", divide="ignore"):
        np.testing.assert_array_equal(device.get(maps.unary("math", "log", device.put(x))),
                                      np.log(x))
        np.testing.assert_array_equal(device.get(maps.unary("math", "sqrt", device.put(x))),
                                      np.sqrt(x))


def test_scale_of_a_float64_scalar_is_the_cpus(device):
    """The learning-rate multipliers: float64 scalars of shape ()."""
    lr = device.put(np.array(0.1))
    got = maps.unary("math", "scale", lr, 0.3, 0.0)
    assert tuple(got.shape) == () and device.get(got) == np.float64(0.1) * 0.3 + 0.0


def test_two_scalar_maps_check_their_scalars(device):
    x = device.put(np.ones(3, np.float32))
    with pytest.raises(TypeError, match=r"math.clip takes 2 scalar\(s\), got 1"):
        maps.unary("math", "clip", x, 1.0)
    assert maps.signatures("math")["clip_grad_f64_w2"] == "PPPqdd"


# ---- sigmoid cross entropy with logits ------------------------------------------------


def sigmoid(x):
    return np.where(x >= 0, 1.0, np.exp(-np.abs(x))) / (1.0 + np.exp(-np.abs(x)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
def test_sigmoid_cross_entropy_and_grads(device, dtype, offset):
    r = rng(6)
    x = (r.normal(size=(9, 13)) * 20).astype(dtype)
    x[0, :4] = [-1000.0, 1000.0, 0.0, -80.0]
    y = r.uniform(size=x.shape).astype(dtype)
    d = r.normal(size=x.shape).astype(dtype)
    x64, y64, d64 = (a.astype(np.float64) for a in (x, y, d))
    out = device.get(loss.sigmoid_cross_entropy(device.put(x, offset), device.put(y, offset)))
    want = np.maximum(x64, 0) - x64 * y64 + np.log1p(np.exp(-np.abs(x64)))
    assert np.isfinite(out).all() and rel_err(out, want) < TOL[dtype]
    dx, dl = loss.sigmoid_cross_entropy_grad(device.put(x, offset), device.put(y, offset),
                                             device.put(d, offset))
    assert rel_err(device.get(dx), d64 * (sigmoid(x64) - y64)) < TOL[dtype]
    assert rel_err(device.get(dl), -d64 * x64) < TOL[dtype]
    none, only = loss.sigmoid_cross_entropy_grad(device.put(x), device.put(y), device.put(d),
                                                 need_dx=False)
    assert none is None and rel_err(device.get(only), -d64 * x64) < TOL[dtype]


def test_math_ops_through_the_executor_keep_scalars(device_place):
    scope = mg.Scope()
    x, out = scope.new_var("x"), scope.new_var("out")
    x.set(device_place.to_device(np.array(0.5)))
    ops = [mg.Operator("scale", x=x, out=out, scale=4.0, bias=-1.0)]
    (got,) = mg.Executor(device_place).run(ops, scope, fetch=[out])
    assert got.shape == () and got == 1.0
