"""Launchers of the optimizer kernels against numpy, on the emulator and (marked gpu)
a real GPU: sgd / momentum in place (with weight decay; a learning rate of either
float dtype), adam / AdamW (beta powers advanced on the device),
clip_by_global_norm (no host sync) and lr_schedule (the step counter and the rate
on the device, every kind and the linear warm-up, the milestones uploaded once)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from launcher_harness import TOL, rel_err, rng

from minigraph.kernels.cuda import clip, lr_schedule, optimizer_ops

SHAPES = [(3, 41), (5,), (2, 8)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype,lr_dtype", [(np.float32, np.float32), (np.float64, np.float64),
                                            (np.float32, np.float64)])
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
def test_sgd_and_momentum_with_weight_decay(device, shape, dtype, lr_dtype, nesterov, offset):
    r = rng(1)
    p, g, v = (r.normal(size=shape).astype(dtype) for _ in range(3))
    lr, wd, mu = np.array([0.1], lr_dtype), 0.01, dtype(0.9)
    dp = device.put(p, offset)
    optimizer_ops.sgd(dp, device.put(g, offset), device.put(lr), weight_decay=wd)
    d, rate = g + dtype(wd) * p, dtype(lr[0])
    # p - rate * step cancels where p is close to rate * step: errors against the terms
    assert rel_err(device.get(dp), p - d * rate, abs(p) + abs(d * rate)) < TOL[dtype]
    dp, dv = device.put(p, offset), device.put(v, offset)
    optimizer_ops.momentum(dp, device.put(g, offset), dv, device.put(lr), 0.9, nesterov, wd)
    nv = mu * v + d
    step = d + mu * nv if nesterov else nv
    assert rel_err(device.get(dv), nv, abs(mu * v) + abs(d)) < TOL[dtype]
    assert rel_err(device.get(dp), p - rate * step, abs(p) + abs(rate * step)) < TOL[dtype]


@pytest.mark.parametrize("dtype,lr_dtype", [(np.float32, np.float32), (np.float64, np.float32),
                                            (np.float32, np.float64)])
@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_and_momentum_in_place(device, dtype, lr_dtype, nesterov):
    r = rng(16)
    p, g, v = (r.normal(size=(3, 41)).astype(dtype) for _ in range(3))
    lr = np.array([0.1], lr_dtype)
    dp = device.put(p)
    optimizer_ops.sgd(dp, device.put(g), device.put(lr))
    want = p - g * dtype(lr[0])
    np.testing.assert_allclose(device.get(dp), want, rtol=TOL[dtype])
    dp, dv = device.put(p), device.put(v)
    optimizer_ops.momentum(dp, device.put(g), dv, device.put(lr), 0.9, nesterov)
    nv = dtype(0.9) * v + g
    step = g + dtype(0.9) * nv if nesterov else nv
    np.testing.assert_allclose(device.get(dv), nv, rtol=TOL[dtype])
    np.testing.assert_allclose(device.get(dp), p - dtype(lr[0]) * step, rtol=TOL[dtype])


def test_zero_weight_decay_leaves_infinite_params_alone(device):
    p = np.array([np.inf, 1.0], np.float32)
    dp = device.put(p)
    optimizer_ops.sgd(dp, device.put(np.zeros(2, np.float32)),
                      device.put(np.array([0.1], np.float32)))
    np.testing.assert_array_equal(device.get(dp), p)


def adam_ref(p, g, m, v, b1p, b2p, lr, beta1, beta2, eps, wd, decoupled):
    """ops/adam.py's arithmetic (in p's dtype, scalars in double)."""
    dt = p.dtype.type
    b1p, b2p = b1p * beta1, b2p * beta2
    if decoupled:
        p = p * dt(1.0 - lr * wd)
    elif wd:
        g = g + dt(wd) * p
    m = m + dt(1.0 - beta1) * (g - m)
    v = v * dt(beta2) + dt(1.0 - beta2) * g * g
    denom = np.sqrt(v) / dt(math.sqrt(1.0 - b2p)) + dt(eps)
    return p - dt(lr / (1.0 - b1p)) * m / denom, m, v, b1p, b2p


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype,lr_dtype", [(np.float32, np.float32), (np.float64, np.float64),
                                            (np.float64, np.float32)])
@pytest.mark.parametrize("decoupled,wd", [(False, 0.0), (False, 0.05), (True, 0.01)])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
def test_adam_steps_and_beta_powers(device, shape, dtype, lr_dtype, decoupled, wd, offset):
    r = rng(2)
    p = r.normal(size=shape).astype(dtype)
    m, v = np.zeros(shape, dtype), np.zeros(shape, dtype)
    b1p = b2p = 1.0
    dp, dm, dv = device.put(p, offset), device.put(m, offset), device.put(v, offset)
    d1, d2 = device.put(np.array(1.0)), device.put(np.array(1.0))
    lr = np.array(1e-2, lr_dtype)
    for _ in range(3):
        g = r.normal(size=shape).astype(dtype)
        optimizer_ops.adam(dp, device.put(g, offset), dm, dv, d1, d2, device.put(lr), 0.9, 0.99,
                           1e-8, wd, decoupled)
        p, m, v, b1p, b2p = adam_ref(p, g, m, v, b1p, b2p, float(lr), 0.9, 0.99, 1e-8, wd,
                                     decoupled)
        assert float(device.get(d1)) == b1p and float(device.get(d2)) == b2p
        for got, want in ((dp, p), (dm, m), (dv, v)):
            np.testing.assert_allclose(device.get(got), want, rtol=20 * TOL[dtype], atol=1e-7)


def test_adam_checks_its_inputs(device):
    p = device.put(np.ones(3, np.float32))
    one = device.put(np.array(1.0))
    with pytest.raises(ValueError, match="adam: 'moment2' must match param"):
        optimizer_ops.adam(p, p, p, device.put(np.ones(4, np.float32)), one, one,
                           device.put(np.array([0.1], np.float32)))
    with pytest.raises(ValueError, match=r"adam: beta1_pow must be float64 of shape \(\)"):
        optimizer_ops.adam(p, p, device.put(np.ones(3, np.float32)),
                           device.put(np.ones(3, np.float32)),
                           device.put(np.array(1.0, np.float32)), one,
                           device.put(np.array([0.1], np.float32)))


@pytest.mark.parametrize("count", [1, 3, 11])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_clip_by_global_norm_in_place(device, count, max_norm):
    r = rng(3)
    xs = [(r.normal(size=(k % 4 + 1, 37 * k + 5)) * 3).astype(np.float32 if k % 2 else np.float64)
          for k in range(count)]
    arrays = [device.put(x) for x in xs]
    assert clip.clip_by_global_norm(arrays, max_norm) is arrays
    total = math.sqrt(sum(float(np.dot(x.ravel().astype(np.float64), x.ravel())) for x in xs))
    coef = min(max_norm / (total + 1e-6), 1.0)
    for got, x in zip(arrays, xs, strict=True):
        np.testing.assert_allclose(device.get(got), x * x.dtype.type(coef), rtol=TOL[x.dtype.type])
    if max_norm > total:
        for got, x in zip(arrays, xs, strict=True):
            np.testing.assert_array_equal(device.get(got), x)


def test_clip_edge_cases(device):
    zeros = [device.put(np.zeros(5, np.float32)), device.put(np.zeros((0, 3), np.float64))]
    clip.clip_by_global_norm(zeros, 1.0)
    np.testing.assert_array_equal(device.get(zeros[0]), np.zeros(5))
    bad = device.put(np.array([np.nan, 1.0], np.float32))
    clip.clip_by_global_norm([bad], 1.0)
    assert np.isnan(device.get(bad)).all()              # coef = min(nan, 1) = nan, as Python's min
    assert clip.clip_by_global_norm([], 1.0) == []
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        clip.clip_by_global_norm(zeros, 0.0)


SCHEDULES = [dict(kind="step", base_lr=0.1, step_size=3, gamma=0.5),
             dict(kind="cosine", base_lr=0.1, total_steps=7, end_lr=0.01),
             dict(kind="cosine", base_lr=1.0, total_steps=6, end_lr=0.0, warmup_steps=2),
             dict(kind="constant", base_lr=0.3),
             dict(kind="exponential", base_lr=0.1, gamma=0.9),
             dict(kind="multistep", base_lr=0.1, gamma=0.5, milestones=(2, 6, 9)),
             dict(kind="multistep", base_lr=0.1, gamma=0.5, milestones=(0,)),
             dict(kind="onecycle", base_lr=0.1, total_steps=12, end_lr=1e-4),
             dict(kind="onecycle", base_lr=0.7, total_steps=9, end_lr=0.0, divide_factor=10.0,
                  phase_pct=0.45),
             dict(kind="constant", base_lr=0.1, linear_warmup_steps=4, linear_warmup_start=0.01,
                  linear_warmup_end=0.1),
             dict(kind="step", base_lr=0.1, step_size=2, gamma=0.5, linear_warmup_steps=3,
                  linear_warmup_end=0.2),
             dict(kind="onecycle", base_lr=0.1, total_steps=10, linear_warmup_steps=2,
                  linear_warmup_end=0.004)]
DEFAULTS = dict(step_size=1, gamma=0.1, total_steps=1, end_lr=0.0, warmup_steps=0,
                milestones=(), divide_factor=25.0, phase_pct=0.3, linear_warmup_steps=0,
                linear_warmup_start=0.0, linear_warmup_end=0.0)


@pytest.mark.parametrize("attrs", SCHEDULES,
                         ids=lambda a: "-".join(f"{v}" for v in a.values())[:40])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lr_schedule_on_the_device(device, attrs, dtype):
    """Against the float64 reference (kernels/cpu/lr_schedule.py's schedule_value); on
    the emulator (the same libm), float64 rates are the reference's bits."""
    from minigraph.kernels.cpu.lr_schedule import schedule_value

    full = {**DEFAULTS, **attrs}
    step, lr = device.put(np.array(0, np.int64)), device.put(np.zeros((), dtype))
    for t in range(15):                              # past total_steps: periodic
        lr_schedule.lr_schedule(step, lr, **attrs)
        want = schedule_value(full, t)
        np.testing.assert_allclose(device.get(lr), want, rtol=TOL[dtype], atol=1e-15)
        if device.emulated and dtype == np.float64:
            assert float(device.get(lr)) == want, t
        assert int(device.get(step)) == t + 1


def test_lr_schedule_checks(device):
    step, lr = device.put(np.array(0, np.int64)), device.put(np.zeros((), np.float64))
    with pytest.raises(ValueError, match="kind must be one of"):
        lr_schedule.lr_schedule(step, lr, "linear", 0.1)
    with pytest.raises(ValueError, match=r"warmup_steps \(5\) must be in \[0, total_steps=5\)"):
        lr_schedule.lr_schedule(step, lr, "cosine", 0.1, total_steps=5, warmup_steps=5)
    with pytest.raises(ValueError, match=r"step must be int64 of shape \(\)"):
        lr_schedule.lr_schedule(device.put(np.array(0, np.int32)), lr, "step", 0.1)
    with pytest.raises(ValueError, match="milestones must be strictly increasing"):
        lr_schedule.lr_schedule(step, lr, "multistep", 0.1, milestones=(3, 3))
    with pytest.raises(ValueError, match="onecycle needs"):
        lr_schedule.lr_schedule(step, lr, "onecycle", 0.1, total_steps=2)
    assert int(device.get(step)) == 0                    # nothing ran


def test_milestones_are_uploaded_once_per_tuple(device):
    step, lr = device.put(np.array(0, np.int64)), device.put(np.zeros((), np.float64))
    first = lr_schedule.milestones_on_device((2, 5))
    assert first[1] == 2 and lr_schedule.milestones_on_device([2, 5]) == first
    assert lr_schedule.milestones_on_device((2, 6))[0] != first[0]
    assert lr_schedule.milestones_on_device(()) == (0, 0)
    for _ in range(6):
        lr_schedule.lr_schedule(step, lr, "multistep", 1.0, gamma=0.5, milestones=(2, 5))
    assert float(device.get(lr)) == 0.25
