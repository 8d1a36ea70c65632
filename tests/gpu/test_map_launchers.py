"""The one-line elementwise kernels (kernels/cuda/map.cuh, launched by kernels/cuda/map.py)
against float64 numpy references: relu, sigmoid, tanh, gelu, leaky_relu and
their gradients, on the emulator and (marked gpu) a real GPU; packed and
unpacked paths (aligned and offset data, sizes that are not a multiple of the
pack width), extreme values, and the launcher's checks; kernels/cuda/activation.py's
relu and relu_grad (map kernels with their own launcher). Their signature table:
test_kernel_build.py."""
from __future__ import annotations

import math

import numpy as np
import pytest
from launcher_harness import TOL, rel_err, rng

from minigraph.kernels.cuda import map as maps

SHAPES = [(1,), (7,), (4, 9), (3, 5, 17)]
erf = np.vectorize(math.erf, otypes=[np.float64])
erfc = np.vectorize(math.erfc, otypes=[np.float64])


def phi_cdf(x):
    return 0.5 * erfc(-x / math.sqrt(2.0))


def sigmoid(x):
    return np.where(x >= 0, 1.0, np.exp(-np.abs(x))) / (1.0 + np.exp(-np.abs(x)))


UNARY = {  # map module, name, scalars, reference(x)
    "sigmoid": ("sigmoid", "sigmoid", (), sigmoid),
    "tanh": ("tanh", "tanh", (), np.tanh),
    "gelu": ("gelu", "gelu", (), lambda x: x * phi_cdf(x)),
    "leaky_relu": ("leaky_relu", "leaky_relu", (0.2,), lambda x: np.where(x > 0, x, 0.2 * x)),
    "relu": ("activation", "relu", (), lambda x: np.maximum(x, 0)),
}
BINARY = {  # module, name, scalars, operand that comes from the forward, reference(a, d)
    "sigmoid_grad": ("sigmoid", "sigmoid_grad", (), "out", lambda o, d: d * o * (1 - o)),
    "tanh_grad": ("tanh", "tanh_grad", (), "out", lambda o, d: d * (1 - o * o)),
    "gelu_grad": ("gelu", "gelu_grad", (), "x",
                  lambda x, d: d * (phi_cdf(x) + x * np.exp(-0.5 * x * x) / math.sqrt(2 * math.pi))),
    "leaky_relu_grad": ("leaky_relu", "leaky_relu_grad", (0.2,), "x",
                        lambda x, d: np.where(x > 0, d, 0.2 * d)),
    "relu_grad": ("activation", "relu_grad", (), "out", lambda o, d: np.where(o > 0, d, 0)),
}


def data(shape, dtype, seed=0):
    return (rng(seed).normal(size=shape) * 3).astype(dtype)


@pytest.mark.parametrize("case", sorted(UNARY))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
def test_unary_maps(device, case, shape, dtype, offset):
    module, name, scalars, ref = UNARY[case]
    x = data(shape, dtype)
    got = device.get(maps.unary(module, name, device.put(x, offset), *scalars))
    assert got.dtype == dtype and got.shape == shape
    assert rel_err(got, ref(x.astype(np.float64))) < TOL[dtype]


@pytest.mark.parametrize("case", sorted(BINARY))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
def test_binary_maps(device, case, shape, dtype, offset):
    module, name, scalars, first, ref = BINARY[case]
    a = data(shape, dtype, 1)
    if first == "out":                               # a value the forward can produce
        a = {"sigmoid_grad": sigmoid, "tanh_grad": np.tanh,
             "relu_grad": lambda v: np.maximum(v, 0)}[case](a.astype(np.float64)).astype(dtype)
    d = data(shape, dtype, 2)
    got = device.get(maps.binary(module, name, device.put(a, offset), device.put(d, offset),
                                 *scalars))
    assert got.dtype == dtype and got.shape == shape
    assert rel_err(got, ref(a.astype(np.float64), d.astype(np.float64))) < TOL[dtype]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_extreme_values_stay_finite_and_accurate(device, dtype):
    x = np.array([-1000.0, -80.0, -30.0, -1e-30, 0.0, 1e-30, 30.0, 80.0, 1000.0], dtype)
    s = device.get(maps.unary("sigmoid", "sigmoid", device.put(x)))
    assert np.isfinite(s).all() and s[0] == 0 and s[-1] == 1 and s[4] == 0.5
    want = sigmoid(x.astype(np.float64))
    tiny = np.finfo(dtype).tiny
    np.testing.assert_allclose(s[want > tiny], want[want > tiny], rtol=10 * TOL[dtype])
    g = device.get(maps.unary("gelu", "gelu", device.put(x)))
    assert np.isfinite(g).all() and g[0] == 0 and g[-1] == 1000 and g[4] == 0
    assert g[2] < 0 or dtype == np.float32       # x Phi(x) at -30: -1.5e-197 in double
    dg = device.get(maps.binary("gelu", "gelu_grad", device.put(x), device.put(np.ones_like(x))))
    assert np.isfinite(dg).all() and dg[0] == 0 and dg[-1] == 1 and dg[4] == 0.5
    t = device.get(maps.unary("tanh", "tanh", device.put(x)))
    assert t[0] == -1 and t[-1] == 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nan_propagates_like_numpy(device, dtype):
    x = np.array([np.nan, -1.0, 2.0], dtype)
    d = np.array([3.0, 4.0, 5.0], dtype)
    for case, (module, name, scalars, ref) in UNARY.items():
        got = device.get(maps.unary(module, name, device.put(x), *scalars))
        np.testing.assert_allclose(got, ref(x.astype(np.float64)), rtol=TOL[dtype], err_msg=case)
    got = device.get(maps.binary("leaky_relu", "leaky_relu_grad", device.put(x), device.put(d),
                                 0.2))
    np.testing.assert_array_equal(got, np.where(x > 0, d, dtype(0.2) * d))


def test_out_and_empty_arrays(device):
    x = data((5, 3), np.float32)
    out = device.put(np.zeros((5, 3), np.float32))
    assert maps.unary("tanh", "tanh", device.put(x), out=out) is out
    np.testing.assert_allclose(device.get(out), np.tanh(x), rtol=1e-6)
    empty = device.put(np.zeros((0, 4), np.float64))
    assert device.get(maps.unary("sigmoid", "sigmoid", empty)).shape == (0, 4)
    assert device.get(maps.binary("tanh", "tanh_grad", empty, empty)).shape == (0, 4)


def test_launcher_checks(device):
    x = device.put(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"declares no map 'softsign'"):
        maps.unary("sigmoid", "softsign", x)
    with pytest.raises(TypeError, match=r"leaky_relu.leaky_relu takes 1 scalar\(s\), got 0"):
        maps.unary("leaky_relu", "leaky_relu", x)
    with pytest.raises(ValueError, match=r"tanh.tanh_grad: second operand must be float32 of "
                                         r"shape \(2, 3\)"):
        maps.binary("tanh", "tanh_grad", x, device.put(np.ones((3, 2), np.float32)))
    with pytest.raises(ValueError, match=r"gelu.gelu: out must be float32 of shape \(2, 3\)"):
        maps.unary("gelu", "gelu", x, out=device.put(np.ones((2, 3), np.float64)))
    with pytest.raises(TypeError, match="float32 or float64"):
        maps.unary("tanh", "tanh", device.put(np.ones(3, np.float16)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [0, 1])
def test_relu_and_grad(device, dtype, offset):
    from minigraph.kernels.cuda import activation

    x = rng(4).normal(size=(7, 19)).astype(dtype)
    x[0, 0] = np.nan
    out = activation.relu(device.put(x, offset))
    np.testing.assert_array_equal(device.get(out), np.maximum(x, 0))
    d = rng(5).normal(size=x.shape).astype(dtype)
    dx = activation.relu_grad(out, device.put(d, offset))
    np.testing.assert_array_equal(device.get(dx), np.where(np.maximum(x, 0) > 0, d, 0))
