"""mean."""
import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg


def mean_reference(x):
    return {"out": np.array(np.mean(x, dtype=np.float64))}


def test_mean_forward_and_grad():
    x = np.random.default_rng(0).standard_normal((3, 4, 2))
    got = helper_test_op("mean", {"x": x}, {}, mean_reference, grad_wrt=("x",))
    assert got["out"].shape == ()


def test_mean_accumulates_float32_in_float64():
    # a float32 running sum of 2**20 values near 1e4 drifts far from the mean
    x = (1e4 + np.random.default_rng(1).standard_normal(1 << 20)).astype(np.float32)
    got = helper_test_op("mean", {"x": x}, {}, mean_reference, atol=0, rtol=1e-7)
    assert got["out"].dtype == np.float32


def test_mean_rejects_int_input():
    scope = mg.Scope()
    x = scope.new_var("x")
    x.set(np.arange(4))
    with pytest.raises(mg.OpError, match="mean: input 'x' must be a float tensor"):
        mg.Operator("mean", x=x, out=scope.new_var("out"))


def test_the_mean_of_an_empty_batch_is_zero_with_an_empty_gradient():
    got = helper_test_op("mean", {"x": np.ones((0, 3))}, {},
                         lambda x: {"out": np.array(0.0)}, grad_wrt=("x",))
    assert got["out"].shape == ()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("shape", [(), (7,), (64,), (3, 5, 7), (17, 130), (100_003,)])
def test_mean_gives_np_mean_bits(shape, dtype):
    """The kernel's float64 add.reduce / size is np.mean(x, dtype=float64) bit for bit,
    also on a transposed (not C-contiguous) x."""
    from minigraph.kernels.cpu.mean import mean_cpu

    rng = np.random.default_rng(7)
    for scale in (1e-4, 1.0, 1e4):
        x = (rng.standard_normal(shape) * scale).astype(dtype)
        for arr in (x, x.T):
            got = mean_cpu(None, {"x": arr}, None)["out"]
            want = np.asarray(np.mean(arr, dtype=np.float64), dtype=dtype)
            assert got.dtype == want.dtype and got.shape == ()
            assert got.tobytes() == want.tobytes()
