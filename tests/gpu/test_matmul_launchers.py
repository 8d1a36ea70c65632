"""kernels/cuda/matmul.py against float64 numpy, on the emulator and (marked gpu) a real
GPU: matmul with either operand transposed and accumulation into `out`, odd and
one-element sizes; mul (x flattened to 2-D at x_num_col_dims) and its grad; batched
products with broadcast batch axes and either operand transposed (the matmul op), their
launch plans and gradients."""
from __future__ import annotations

import numpy as np
import pytest
from launcher_harness import rel_err, rng


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (65, 17, 130), (3, 200, 5), (128, 64, 64)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_variants(device, m, k, n, dtype):
    from minigraph.kernels.cuda import matmul

    r = rng(8)
    a, b = r.normal(size=(m, k)).astype(dtype), r.normal(size=(k, n)).astype(dtype)
    want = a.astype(np.float64) @ b
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert rel_err(device.get(matmul.matmul(device.put(a), device.put(b))), want) < tol
    assert rel_err(device.get(matmul.matmul(device.put(a.T.copy()), device.put(b), trans_a=True)),
                   want) < tol
    assert rel_err(device.get(matmul.matmul(device.put(a), device.put(b.T.copy()), trans_b=True)),
                   want) < tol
    acc = device.put(np.ones((m, n), dtype))
    matmul.matmul(device.put(a), device.put(b), out=acc, accumulate=True)
    assert rel_err(device.get(acc), want + 1) < tol


def test_mul_and_grad(device):
    from minigraph.kernels.cuda import matmul

    r = rng(9)
    x, y = r.normal(size=(4, 3, 5, 2)), r.normal(size=(10, 7))
    d = r.normal(size=(4, 3, 7))
    out = matmul.mul(device.put(x), device.put(y), x_num_col_dims=2)
    x2 = x.reshape(12, 10)
    assert rel_err(device.get(out), (x2 @ y).reshape(4, 3, 7)) < 1e-12
    dx, dy = matmul.mul_grad(device.put(x), device.put(y), device.put(d), x_num_col_dims=2)
    assert rel_err(device.get(dx), (d.reshape(12, 7) @ y.T).reshape(x.shape)) < 1e-12
    assert rel_err(device.get(dy), x2.T @ d.reshape(12, 7)) < 1e-12


# ---- batched products with broadcast batch axes (the matmul op) ---------------------------


def test_batch_launches_cover_every_product_once():
    from minigraph.kernels.cuda import batched_matmul

    dims, strides = (3, 4, 5), ((0, 5, 1), (20, 0, 1), (20, 5, 1))
    want = sorted(tuple(sum(i * s for i, s in zip(idx, st)) for st in strides)
                  for idx in np.ndindex(*dims))
    for zmax in (1, 3, 7, 20, 65535):
        got = []
        for (oa, ob, oc), inner_count, batches, (ao, ai, bo, bi, co, ci) in \
                batched_matmul.batch_launches(dims, strides, zmax):
            assert batches <= zmax and batches % inner_count == 0
            for z in range(batches):
                o, i = divmod(z, inner_count)
                got.append([oa + o * ao + i * ai, ob + o * bo + i * bi, oc + o * co + i * ci])
        assert sorted(map(tuple, got)) == want, zmax
    assert batched_matmul.batch_launches((), ((), (), ()), 10) == [((0, 0, 0), 1, 1, (0,) * 6)]


def _t(a, flag):
    return np.swapaxes(a, -1, -2) if flag else a


@pytest.mark.parametrize("x_shape,y_shape", [((5, 7), (7, 3)), ((2, 3, 4, 5), (2, 3, 5, 6)),
                                             ((4, 3, 5), (5, 2)), ((3, 6, 4), (1, 4, 5)),
                                             ((2, 1, 3, 4), (5, 4, 2)), ((4, 6), (3, 2, 6, 5)),
                                             ((1, 70, 33), (2, 33, 65)),
                                             ((2, 1, 3, 4, 5), (4, 3, 5, 2))], ids=str)
@pytest.mark.parametrize("tx,ty", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["nn", "tn", "nt", "tt"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_batched_and_grad_match_numpy(device, x_shape, y_shape, tx, ty, dtype):
    from references import unbroadcast

    from minigraph.kernels.cuda import batched_matmul

    r = rng(11)
    xs = _t(np.empty(x_shape), tx).shape             # stored shapes for the transposed cases
    ys = _t(np.empty(y_shape), ty).shape
    x, y = r.normal(size=xs).astype(dtype), r.normal(size=ys).astype(dtype)
    x64, y64 = _t(x.astype(np.float64), tx), _t(y.astype(np.float64), ty)
    want = np.matmul(x64, y64)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    out = device.get(batched_matmul.batched(device.put(x), device.put(y), tx, ty))
    assert out.shape == want.shape and out.dtype == dtype
    assert rel_err(out, want) < tol
    d = r.normal(size=want.shape).astype(dtype)
    dx, dy = batched_matmul.batched_grad(device.put(x), device.put(y), device.put(d), tx, ty)
    want_dx = unbroadcast(_t(np.matmul(d, np.swapaxes(y64, -1, -2)), tx), x.shape)
    want_dy = unbroadcast(_t(np.matmul(np.swapaxes(x64, -1, -2), d), ty), y.shape)
    assert device.get(dx).shape == x.shape and device.get(dy).shape == y.shape
    assert rel_err(device.get(dx), want_dx) < tol
    assert rel_err(device.get(dy), want_dy) < tol
    only = batched_matmul.batched_grad(device.put(x), device.put(y), device.put(d), tx, ty, need_dx=False)
    assert only[0] is None and rel_err(device.get(only[1]), want_dy) < tol


def test_batched_edge_cases_and_checks(device):
    from minigraph.kernels.cuda import batched_matmul

    x, y = np.ones((2, 3, 0)), np.ones((0, 4))
    out = batched_matmul.batched(device.put(x), device.put(y))
    np.testing.assert_array_equal(device.get(out), np.zeros((2, 3, 4)))
    dx, dy = batched_matmul.batched_grad(device.put(x), device.put(y), device.put(np.ones((2, 3, 4))))
    assert device.get(dx).shape == (2, 3, 0)
    np.testing.assert_array_equal(device.get(dy), np.zeros((0, 4)))
    x, y = np.ones((1, 3, 2)), np.ones((0, 2, 4))          # no batch matrices: dx sums none
    assert device.get(batched_matmul.batched(device.put(x), device.put(y))).shape == (0, 3, 4)
    dx, _ = batched_matmul.batched_grad(device.put(x), device.put(y), device.put(np.ones((0, 3, 4))))
    np.testing.assert_array_equal(device.get(dx), np.zeros((1, 3, 2)))
    with pytest.raises(ValueError, match="inner dims differ"):
        batched_matmul.batched(device.put(np.ones((2, 3))), device.put(np.ones((2, 3))))
    with pytest.raises(ValueError, match=r"shapes \(2,\) and \(3,\) do not broadcast"):
        batched_matmul.batched(device.put(np.ones((2, 1, 3))), device.put(np.ones((3, 3, 1))))
