"""The native float32 kernels of leaky_relu, sigmoid, tanh and silu
(kernels/cpu/activation_native.c) against float64 references: values from 1e-6 to
100 in magnitude, infinities, NaN, signed zeros, lengths around a vector's 16, the
thread counts; leaky_relu to the numpy kernel's bits."""
import numpy as np
import pytest

from minigraph.kernels.cpu import activation_native, blocks, native

pytestmark = pytest.mark.skipif(
    not activation_native.available(),
    reason=f"native kernels not built: {native.reason('activation_native')}")

rng = np.random.default_rng(5)
SPECIAL = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 88.0, -88.0, 0.625,
                    -0.625, 0.62, 200.0, -200.0], np.float32)


def values(n=None):
    spread = np.concatenate([rng.standard_normal(4000) * s
                             for s in (1e-6, 1e-3, 0.1, 1.0, 5.0, 30.0, 100.0)])
    x = np.concatenate([spread.astype(np.float32), SPECIAL])
    return x if n is None else x[:n]


def sigmoid64(x):
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1.0, e) / (1.0 + e)


def forward64(kind, x):
    x = x.astype(np.float64)
    with np.errstate(invalid="ignore"):                  # silu(-inf) = -inf * 0: NaN
        return {"sigmoid": sigmoid64, "tanh": np.tanh,
                "silu": lambda v: v * sigmoid64(v)}[kind](x)


def backward64(kind, v, d):
    v, d = v.astype(np.float64), d.astype(np.float64)
    if kind == "sigmoid":
        return d * v * (1.0 - v)
    if kind == "tanh":
        return d * (1.0 - v * v)
    s = sigmoid64(v)
    return d * s * (1.0 + v * (1.0 - s))


def within_ulps(got, want, ulps):
    """got (float32) within `ulps` float32 ulps of want (float64), or within 1e-35 (exp
    is 0 below -87.3: silu(-90) is -0.0, not -8e-38), NaN where want is."""
    assert got.dtype == np.float32
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    got, want = got[ok].astype(np.float64), want[ok]
    assert np.array_equal(got[np.isinf(want)], want[np.isinf(want)])
    finite = np.isfinite(want)
    got, want = got[finite], want[finite]
    spacing = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    assert (np.abs(got - want) <= np.maximum(ulps * spacing, 1e-35)).all()


@pytest.mark.parametrize("kind", ["sigmoid", "tanh", "silu"])
def test_forward_within_a_few_ulps_of_float64(kind):
    x = values()
    within_ulps(activation_native.forward(kind, x), forward64(kind, x), 4)


@pytest.mark.parametrize("kind", ["sigmoid", "tanh", "silu"])
def test_gradients_against_float64(kind):
    x = values()
    x = x[np.isfinite(x)]
    d = rng.standard_normal(x.size).astype(np.float32)
    v = activation_native.forward(kind, x) if kind != "silu" else x
    got = activation_native.backward(kind, v, d)
    want = backward64(kind, v, d)
    # silu's 1 + x (1 - s) cancels near x = -1.28: an absolute bound there
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=2e-6 * np.abs(d).max())


def test_tanh_keeps_its_relative_accuracy_near_zero():
    x = np.array([1e-30, -3e-8, 1e-4, -0.3, 0.6249], np.float32)
    within_ulps(activation_native.forward("tanh", x), np.tanh(x.astype(np.float64)), 2)


def test_leaky_relu_gives_the_numpy_kernels_bits():
    x, alpha = values(), 0.01
    d = rng.standard_normal(x.size).astype(np.float32)
    x64 = x.astype(np.float64)
    want = np.where(x64 > 0, x64, alpha * x64).astype(np.float32)
    assert activation_native.forward("leaky_relu", x, alpha).tobytes() == want.tobytes()
    d64 = d.astype(np.float64)
    want = np.where(x > 0, d64, alpha * d64).astype(np.float32)
    assert activation_native.backward("leaky_relu", x, d, alpha).tobytes() == want.tobytes()


@pytest.mark.parametrize("n", [1, 15, 16, 17, 33])
@pytest.mark.parametrize("kind", sorted(activation_native.KINDS))
def test_short_lengths_and_thread_counts_give_the_same_bits(kind, n, monkeypatch):
    x = np.ascontiguousarray(values()[::7][:n * 40])
    d = rng.standard_normal(x.size).astype(np.float32)
    runs = []
    for threads in (1, 2, 5):
        monkeypatch.setattr(blocks, "threads_for", lambda size, per, t=threads: t)
        runs.append((activation_native.forward(kind, x, 0.2).tobytes(),
                     activation_native.backward(kind, x, d, 0.2).tobytes()))
    assert runs[0] == runs[1] == runs[2]
    short = x[:n]
    assert activation_native.forward(kind, short, 0.2).tobytes() == \
        activation_native.forward(kind, x, 0.2)[:n].tobytes()


def test_gradient_into_dout():
    x = values()
    d = rng.standard_normal(x.size).astype(np.float32)
    want = activation_native.backward("silu", x, d)
    got = activation_native.backward("silu", x, d, into=d)
    assert got is d and d.tobytes() == want.tobytes()


def test_what_it_does_not_take(monkeypatch):
    x = values(64)
    assert activation_native.forward("tanh", x.astype(np.float64)) is None
    assert activation_native.forward("tanh", x.reshape(8, 8)[:, ::2]) is None
    assert activation_native.backward("tanh", x, x[:32]) is None
    assert activation_native.forward("tanh", np.empty(0, np.float32)).size == 0
    monkeypatch.setenv("MINIGRAPH_NATIVE", "0")
    assert activation_native.forward("tanh", x) is None


@pytest.mark.parametrize("kind", sorted(activation_native.KINDS))
def test_bound_forms_run_the_kernel_into_a_kept_array(kind):
    """The forward's bound form (inference nets, minigraph.bound_run): the kernel's bits
    into the same array every run, new values in the same input array read anew; None
    (the kernel runs) for float64."""
    import minigraph as mg
    from minigraph.kernels.cpu import activation

    scope = mg.Scope()
    attrs = {"alpha": 0.2} if kind == "leaky_relu" else {}
    op = mg.Operator(kind, x=scope.new_var("x"), out=scope.new_var("out"), **attrs)
    run = activation.bind_native(kind)(op)
    x = values(1000).copy()
    first = run({"x": x})["out"]
    for new in (x * 0.5 + 0.25, rng.standard_normal(x.size).astype(np.float32)):
        x[...] = new
        got = run({"x": x})["out"]
        assert got is first
        assert got.tobytes() == activation_native.forward(kind, x, 0.2).tobytes()
    assert run({"x": x.astype(np.float64)}) is None
