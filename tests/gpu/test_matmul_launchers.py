"""kernels/cuda/matmul.py against float64 numpy, on the emulator and (marked gpu) a real
GPU: matmul with either operand transposed and accumulation into `out`, odd and
one-element sizes; mul (x flattened to 2-D at x_num_col_dims) and its grad."""
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
