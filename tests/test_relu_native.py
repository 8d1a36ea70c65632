"""The native relu gradient (kernels/cpu/relu_native.c) against np.where, the values
the numpy kernel gives: the same bits on odd sizes, in place over dout or apart,
1-3 threads, NaN, infinities and signed zeros in out and dout; where it does not
apply, False and nothing written; and the op's kernel taking it."""
from types import SimpleNamespace

import numpy as np
import pytest

from minigraph.kernels.cpu import activation, blocks, native, relu_native

rng = np.random.default_rng(13)

pytestmark = pytest.mark.skipif(
    not relu_native.available(),
    reason=f"native kernels not built: {native.reason('relu_native')}")

SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e-42, -1e-42]


def data(shape, dtype):
    """out and dout with every special value in both, at random places."""
    out = rng.standard_normal(shape).astype(dtype)
    dout = rng.standard_normal(shape).astype(dtype)
    for a in (out, dout):
        flat = a.reshape(-1)
        flat[rng.integers(0, max(1, flat.size), size=min(flat.size, 3 * len(SPECIAL)))] = \
            np.resize(np.array(SPECIAL, dtype=dtype), min(flat.size, 3 * len(SPECIAL)))
    return out, dout


def reference(out, dout):
    return np.where(out > 0, dout, np.zeros((), dtype=dout.dtype))


def same_bits(got, want):
    ints = {4: np.int32, 8: np.int64}[got.dtype.itemsize]
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.view(ints), want.view(ints))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1,), (7,), (33, 130), (32, 16, 9, 9), (0, 4)])
@pytest.mark.parametrize("in_place", [False, True])
def test_same_bits_as_np_where(shape, dtype, threads, in_place, monkeypatch):
    monkeypatch.setattr(relu_native, "MIN_THREAD_VALUES", 1)
    monkeypatch.setattr(blocks, "get_num_threads", lambda: threads)
    out, dout = data(shape, dtype)
    want = reference(out, dout)
    dx = dout if in_place else np.empty_like(dout)
    assert relu_native.relu_grad(out, dout, dx)
    same_bits(dx, want)


def test_where_it_does_not_apply_nothing_is_written():
    out, dout = data((6, 8), np.float32)
    before = dout.copy()
    dx = np.full_like(dout, 7.0)
    cases = [
        (out[:, ::2], dout[:, ::2], dx[:, ::2]),                  # not contiguous
        (out.astype(np.float64), dout, dx),                       # dtypes differ
        (out.astype(np.float16), dout.astype(np.float16), dx.astype(np.float16)),
        (out.reshape(8, 6), dout, dx),                            # shapes differ
    ]
    frozen = dx.copy()
    frozen.flags.writeable = False
    cases.append((out, dout, frozen))                             # read-only dx
    for o, d, x in cases:
        assert relu_native.relu_grad(o, d, x) is False
    np.testing.assert_array_equal(dx, 7.0)
    np.testing.assert_array_equal(dout, before)


@pytest.mark.parametrize("donated", [(), ("dout",)])
def test_the_op_kernel_takes_it(donated, monkeypatch):
    """relu_grad_cpu runs the native kernel (dx written over dout when it is handed
    over, else a new array) and gives np.where's bits; with the kernel off, the
    numpy path gives the same."""
    out, dout = data((4, 5, 6), np.float32)
    want = reference(out, dout)
    calls = []
    real = relu_native.relu_grad
    monkeypatch.setattr(relu_native, "relu_grad", lambda *a: calls.append(a) or real(*a))
    d = dout.copy()
    dx = activation.relu_grad_cpu(None, {"out": out, "dout": d},
                                  SimpleNamespace(donated=donated))["dx"]
    assert len(calls) == 1 and (dx is d) == bool(donated)
    same_bits(dx, want)
    monkeypatch.setattr(relu_native, "relu_grad", lambda *a: False)
    d = dout.copy()
    same_bits(activation.relu_grad_cpu(None, {"out": out, "dout": d},
                                       SimpleNamespace(donated=donated))["dx"], want)


def test_a_handed_over_dout_that_is_not_contiguous_gets_a_new_dx():
    out, dout = data((6, 10), np.float32)
    out, d = out[:, ::2], dout.copy()[:, ::2]
    kept = d.copy()
    dx = activation.relu_grad_cpu(None, {"out": out, "dout": d},
                                  SimpleNamespace(donated=("dout",)))["dx"]
    assert not np.shares_memory(dx, d) and dx.flags.c_contiguous
    same_bits(dx, reference(out, kept))
