"""silu (the worked example of docs/adding_an_op.md): the CPU kernel against a
float64 reference, the gradient against finite differences, the GPU kernels against
the CPU (on the kernel emulator, and on a real GPU where there is one)."""
import math

import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg

rng = np.random.default_rng(0)


def silu_reference(x):
    sig = np.vectorize(lambda v: 1.0 / (1.0 + math.exp(-v)) if v >= 0 else
                       math.exp(v) / (1.0 + math.exp(v)))
    return {"out": x * sig(x)}


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_silu_forward_and_grad(dtype):
    x = rng.standard_normal((3, 5)) * 4
    x[0, :3] = (-800.0, 0.0, 800.0)                # the tails stay finite
    helper_test_op("silu", {"x": x.astype(dtype)}, {}, silu_reference,
                   grad_wrt=("x",) if dtype == np.float64 else ())


def test_silu_needs_a_float_input():
    scope = mg.Scope()
    x, out = scope.new_var("x"), scope.new_var("out")
    x.set(np.ones(3, np.int64))
    with pytest.raises(mg.OpError, match="silu: input 'x' must be a float tensor"):
        mg.Executor().run([mg.Operator("silu", x=x, out=out)], scope)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_silu_on_the_gpu_equals_the_cpu(device_place, dtype):
    x = (rng.standard_normal(37) * 6).astype(dtype)     # not a multiple of the pack width
    dout = rng.standard_normal(37).astype(dtype)
    got, want = ({}, {})
    for place, result in ((device_place, got), (mg.CPUPlace(), want)):
        scope = mg.Scope()
        vx, vd, out, dx = (scope.new_var(n) for n in ("x", "dout", "out", "dx"))
        vx.set(place.to_device(x))
        vd.set(place.to_device(dout))
        ops = [mg.Operator("silu", x=vx, out=out), mg.Operator("silu_grad", x=vx, dout=vd, dx=dx)]
        result.update(zip(("out", "dx"), mg.Executor(place).run(ops, scope, fetch=[out, dx])))
    tol = 1e-6 if dtype == np.float32 else 1e-13
    for slot in ("out", "dx"):
        np.testing.assert_allclose(got[slot], want[slot], rtol=tol, atol=tol, err_msg=slot)
