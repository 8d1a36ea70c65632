"""The native optimizer updates (kernels/cpu/optim_native.c) against float64 references of
torch's formulas and against the numpy kernels they replace: sgd, momentum (Nesterov
too) and adam (L2 and decoupled decay), float32 and float64, in place and out of
place, split over threads (the same bits on any number), and the arrays they refuse."""
import math

import numpy as np
import pytest

from minigraph.kernels.cpu import native, optim_native

pytestmark = pytest.mark.skipif(not optim_native.available(),
                                reason=f"native kernels not built: {native.reason('optim_native')}")

rng = np.random.default_rng(3)
N = 300_001          # past MIN_SPLIT: split over threads, odd length


def arrays(dtype, n=N):
    p, g, m = (rng.standard_normal(n).astype(dtype) for _ in range(3))
    v = np.abs(rng.standard_normal(n)).astype(dtype)
    return p, g, m, v


def reference(kind, p, g, m, v, lr, wd, mu=0.9, nesterov=False, b1=0.9, b2=0.999, eps=1e-8,
              t=3, decoupled=False):
    """torch's update, in float64."""
    p, g, m, v = (a.astype(np.float64) for a in (p, g, m, v))
    if kind == "sgd":
        return (p - lr * (g + wd * p),)
    if kind == "momentum":
        d = g + wd * p
        nv = mu * m + d
        return (p - lr * (d + mu * nv if nesterov else nv), nv)
    if decoupled:
        p = p * (1 - lr * wd)
    else:
        g = g + wd * p
    nm = b1 * m + (1 - b1) * g
    nv = b2 * v + (1 - b2) * g * g
    return (p - lr / (1 - b1 ** t) * nm / (np.sqrt(nv) / math.sqrt(1 - b2 ** t) + eps), nm, nv)


def run(kind, p, g, m, v, out, lr, wd, threads=2, **kw):
    state = {"sgd": (None, None), "momentum": (m, None), "adam": (m, v)}[kind]
    t, b1, b2 = 3, 0.9, 0.999
    ok = optim_native.update(kind, p, g, state, out, lr=lr, wd=wd, mu=kw.get("mu", 0.9),
                             betas=(b1, b2), eps=1e-8,
                             corrections=(lr / (1 - b1 ** t), math.sqrt(1 - b2 ** t)),
                             nesterov=kw.get("nesterov", False),
                             decoupled=kw.get("decoupled", False), threads=threads)
    assert ok
    return out


CASES = [("sgd", {}), ("momentum", {}), ("momentum", {"nesterov": True}), ("adam", {}),
         ("adam", {"decoupled": True})]


@pytest.mark.parametrize("dtype, tol", [(np.float32, 2e-6), (np.float64, 1e-14)])
@pytest.mark.parametrize("kind, kw", CASES)
@pytest.mark.parametrize("where", ["in place", "out of place"])
def test_updates_equal_the_float64_reference(dtype, tol, kind, kw, where):
    p, g, m, v = arrays(dtype)
    want = reference(kind, p, g, m, v, 0.01, 0.05, **kw)
    before = [a.copy() for a in (p, g, m, v)]
    if where == "in place":
        out = (p, m if kind != "sgd" else None, v if kind == "adam" else None)
    else:
        out = tuple(np.empty_like(p) if keep else None
                    for keep in (True, kind != "sgd", kind == "adam"))
    got = run(kind, p, g, m, v, out, 0.01, 0.05, **kw)
    for a, w in zip(got, want):
        np.testing.assert_allclose(a, w, rtol=tol, atol=tol)
    if where == "out of place":                     # the inputs are untouched
        for a, b in zip((p, g, m, v), before):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("kind, kw", CASES)
def test_the_same_bits_on_any_number_of_threads(kind, kw):
    p, g, m, v = arrays(np.float32)
    outs = []
    for threads in (1, 2, 3):
        out = tuple(np.zeros_like(p) for _ in range(3))
        run(kind, p, g, m, v, out, 0.1, 0.01, threads=threads, **kw)
        outs.append(out)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)


def test_arrays_it_does_not_take_are_left_to_numpy():
    p, g, m, v = arrays(np.float32, 10)
    strided = np.zeros(20, np.float32)[::2]
    assert not optim_native.update("sgd", strided, g, out=(strided, None, None), lr=0.1)
    assert not optim_native.update("sgd", p, g.astype(np.float64), out=(p, None, None), lr=0.1)
    assert not optim_native.update("sgd", p.astype(np.float16), g.astype(np.float16),
                                   out=(p.astype(np.float16), None, None), lr=0.1)
    assert not optim_native.update("sgd", p, g[:5], out=(p, None, None), lr=0.1)


def test_empty_and_read_only_inputs():
    """No values: nothing to do, and no error. Read-only param and grad (a caller's
    frozen arrays) are read through numpy's address; the update goes out of place."""
    empty = np.zeros(0, np.float32)
    assert optim_native.update("sgd", empty, empty.copy(), out=(empty, None, None), lr=0.1)
    p, g, _, _ = arrays(np.float32, 10)
    p.flags.writeable = g.flags.writeable = False
    out = np.empty_like(p)
    assert optim_native.update("sgd", p, g, out=(out, None, None), lr=0.5)
    np.testing.assert_array_equal(out, p - g * np.float32(0.5))


@pytest.mark.parametrize("kind", ["sgd", "momentum", "adam"])
def test_op_kernels_take_the_native_update_from_its_threshold(kind, monkeypatch):
    """Parameters below MIN_VALUES take the numpy update (the C call's setup costs more);
    from it on, the native one; both give the float64 reference's values."""
    from types import SimpleNamespace

    from minigraph.kernels.cpu import adam, optimizer_ops

    calls = []
    real = optim_native.update
    monkeypatch.setattr(optim_native, "update", lambda *a, **k: calls.append(1) or real(*a, **k))
    kernel = {"sgd": optimizer_ops.sgd_cpu, "momentum": optimizer_ops.momentum_cpu,
              "adam": adam.adam_cpu}[kind]
    attrs = {"weight_decay": 0.01, "mu": 0.9, "use_nesterov": False, "beta1": 0.9,
             "beta2": 0.999, "epsilon": 1e-8, "decoupled": False}
    for n, native_ran in ((optim_native.MIN_VALUES[kind] - 1, False),
                          (optim_native.MIN_VALUES[kind], True)):
        p, g, m, v = arrays(np.float64, n)
        ins = {"param": p, "grad": g, "velocity": m, "moment1": m, "moment2": v,
               "learning_rate": np.array(0.1), "beta1_pow": np.array(0.9 ** 2),
               "beta2_pow": np.array(0.999 ** 2)}
        want = reference(kind, p, g, m, v, 0.1, 0.01)        # before the update in place
        calls.clear()
        got = kernel(SimpleNamespace(attrs=attrs), ins, SimpleNamespace(spares={}))
        assert bool(calls) == native_ran
        np.testing.assert_allclose(got["param_out"], want[0], rtol=1e-12, atol=1e-12)
