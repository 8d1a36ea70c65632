"""The tensor-math layers (minigraph.layers.math): each builds, infers what numpy
computes, trains through its gradient, and names the layer and the argument when
given something bad."""
import numpy as np
import pytest

import minigraph as mg
from minigraph import layers as L

rng = np.random.default_rng(0)
A = rng.uniform(0.5, 2.0, (3, 4))
B = rng.uniform(0.5, 2.0, (4,))

CASES = {
    "subtract": (lambda net, a, b: L.subtract(net, a, b), lambda a, b: a - b),
    "divide": (lambda net, a, b: L.divide(net, a, b), lambda a, b: a / b),
    "exp": (lambda net, a, b: L.exp(net, a), lambda a, b: np.exp(a)),
    "log": (lambda net, a, b: L.log(net, a), lambda a, b: np.log(a)),
    "sqrt": (lambda net, a, b: L.sqrt(net, a), lambda a, b: np.sqrt(a)),
    "square": (lambda net, a, b: L.square(net, a), lambda a, b: a * a),
    "abs": (lambda net, a, b: L.abs(net, L.subtract(net, a, b)), lambda a, b: np.abs(a - b)),
    "pow": (lambda net, a, b: L.pow(net, a, 1.5), lambda a, b: a ** 1.5),
    "clip": (lambda net, a, b: L.clip(net, a, 0.8, 1.5), lambda a, b: np.clip(a, 0.8, 1.5)),
    "clip-min-only": (lambda net, a, b: L.clip(net, a, min=1.0), lambda a, b: np.maximum(a, 1)),
    "scale": (lambda net, a, b: L.scale(net, a, 2.0, -1.0), lambda a, b: 2 * a - 1),
    "reduce_sum": (lambda net, a, b: L.reduce_sum(net, a, axis=1),
                   lambda a, b: a.sum(axis=1)),
    "reduce_mean": (lambda net, a, b: L.reduce_mean(net, a, axis=(0, 1), keepdim=True),
                    lambda a, b: a.mean(keepdims=True)),
    "reduce_max": (lambda net, a, b: L.reduce_max(net, a), lambda a, b: a.max()),
    "matmul": (lambda net, a, b: L.matmul(net, a, a, transpose_y=True), lambda a, b: a @ a.T),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_layer_infers_what_numpy_computes_and_trains(case):
    build, want = CASES[case]
    net = mg.Net(seed=0)
    a = L.data(net, "a", (3, 4), "float64")
    b = L.data(net, "b", (4,), "float64")
    w = net.create_parameter("w", (3, 4), "float64", mg.initializer.Constant(0.0))
    out = build(net, L.add(net, a, w), b)
    (got,) = net.infer(feed={"a": A, "b": B}, fetch=[out])
    np.testing.assert_allclose(got, want(A, B), rtol=1e-12)
    assert got.shape == tuple(d for d in out.shape)
    mg.optimizer.SGD(0.01).minimize(net, L.mean(net, out))
    (g,) = net.train(feed={"a": A, "b": B}, fetch=[net.grad(w)])
    assert g.shape == (3, 4) and np.isfinite(g).all()


@pytest.mark.parametrize("call, error, message", [
    (lambda net, x: L.pow(net, x, "2"), ValueError, "pow: argument 'factor' must be a number, "
                                                    "got str '2'"),
    (lambda net, x: L.pow(net, x, float("inf")), ValueError, "pow: argument 'factor' must be a "
                                                             "finite number"),
    (lambda net, x: L.clip(net, x, 2.0, 1.0), ValueError, "clip: argument 'min' \\(2.0\\) must "
                                                          "be <= argument 'max' \\(1.0\\)"),
    (lambda net, x: L.clip(net, x, float("nan")), ValueError, "clip: argument 'min' must be a "
                                                              "finite number"),
    (lambda net, x: L.clip(net, x, "low"), ValueError, "clip: argument 'min' must be"),
    (lambda net, x: L.scale(net, x, None), ValueError, "scale: argument 'scale' must be"),
    (lambda net, x: L.reduce_sum(net, x, axis=2), ValueError, "reduce_sum: argument 'axis' "
                                                              "must be None, an int or one or "
                                                              "more distinct ints in \\[-2, 2\\)"),
    (lambda net, x: L.reduce_max(net, x, axis=(0, -2)), ValueError, "reduce_max: argument "
                                                                    "'axis'"),
    (lambda net, x: L.reduce_mean(net, x, axis=()), ValueError, "reduce_mean: argument 'axis'"),
    (lambda net, x: L.matmul(net, x, L.reduce_sum(net, x, axis=0)), ValueError,
     "matmul: argument 'y' \\('reduce_sum_0.out'\\) must have rank >= 2"),
    (lambda net, x: L.matmul(net, x, x), mg.OpError, "matmul: input 'y' with shape \\(3, 4\\) "
                                                     "does not chain"),
    (lambda net, x: L.subtract(net, x, "y"), TypeError, "subtract: argument 'y'"),
    (lambda net, x: L.exp(net, L.data(net, "i", (3,), "int64")), TypeError,
     "exp: argument 'x'"),
])
def test_bad_arguments_name_the_layer_and_the_argument(call, error, message):
    net = mg.Net(seed=0)
    x = L.data(net, "x", (3, 4))
    with pytest.raises(error, match=message):
        call(net, x)
