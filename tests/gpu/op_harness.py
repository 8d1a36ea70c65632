"""What the GPU op tests share (tests/gpu/test_gpu_*.py): running one op and its grad
ops through the Executor on any place, comparing with the CPU's results, seeded
inputs, and a small net with its batches."""
from __future__ import annotations

import numpy as np

import minigraph as mg
from minigraph import layers
from minigraph.schema import get_schema

TOL = {np.dtype("float16"): 1e-3, np.dtype("float32"): 2e-5, np.dtype("float64"): 1e-12}


def is_device_array(value):
    """Whether `value` is a device array (a GPUArray or the emulator's EmuArray)."""
    return not isinstance(value, np.ndarray) and hasattr(value, "gpudata")


def _leaves(v):
    return v if isinstance(v, list) else [v]


def run_op(place, op_type, inputs, attrs=None, grad_sets=(), dout_slots=None, seed=0):
    """Run `op_type` once on `place` through an Executor, then its grad ops.

    inputs: {slot: array or list of arrays}. grad_sets: tuples of input slots
    whose gradients are asked for together (one backward run per tuple), with
    d(loss)/d(out) fixed random values (from `seed`) for each float output in
    `dout_slots` (default: every one that is not an in-place alias).
    Returns (outputs {slot: array}, grads {slots: {input var name: array}}).
    """
    schema = get_schema(op_type)
    scope = mg.Scope()
    ex = mg.Executor(place)
    in_vars, originals = {}, {}
    for slot in schema.inputs:
        value = inputs.get(slot.name)
        if value is None:
            continue
        if isinstance(value, list):
            in_vars[slot.name] = [scope.new_var(f"{slot.name}{i}") for i in range(len(value))]
        else:
            in_vars[slot.name] = scope.new_var(slot.name)
        for var, a in zip(_leaves(in_vars[slot.name]), _leaves(value), strict=True):
            var.set(place.to_device(np.array(a, copy=True)))
            originals[var.name] = var.value
    out_vars = {}
    for slot in schema.outputs:
        src = schema.inplace.get(slot.name)
        if src and src not in in_vars:
            continue                # an in-place output of an unbound optional input
        out_vars[slot.name] = in_vars[src] if src else scope.new_var(f"out.{slot.name}")
    op = mg.Operator(op_type, **in_vars, **out_vars, **(attrs or {}))
    fetched = iter(ex.run([op], scope, fetch=[v for vs in out_vars.values() for v in _leaves(vs)]))
    outs = {slot: [next(fetched) for _ in vs] if isinstance(vs, list) else next(fetched)
            for slot, vs in out_vars.items()}
    for slot, vs in out_vars.items():
        for var in _leaves(vs):
            if place.kind == "gpu":
                assert is_device_array(var.value), \
                    f"{op_type}: output {slot!r} is not on the device"
            if slot in schema.inplace:
                assert var.value is originals[var.name], \
                    f"{op_type}: in-place output {slot!r} is not the input's own buffer"
    grads = {}
    for wanted in grad_sets:
        gscope = scope.new_scope()
        rng = np.random.default_rng(seed)
        dout = {}
        for slot, var in out_vars.items():
            if slot in schema.inplace or outs[slot].dtype.kind != "f" or \
                    (dout_slots is not None and slot not in dout_slots):
                dout[slot] = None
                continue
            d = gscope.new_var(f"{var.name}@GRAD")
            d.set(place.to_device(rng.standard_normal(outs[slot].shape).astype(outs[slot].dtype)))
            dout[slot] = d
        targets = {id(v) for s in wanted for v in _leaves(in_vars[s])}
        made = {}

        def make_grad(var, targets=targets, made=made, gscope=gscope):
            if id(var) not in targets:
                return None
            made[var.name] = gscope.new_var(f"{var.name}@GRAD")
            return made[var.name]

        grad_ops = [mg.Operator(d.type, **d.kwargs) for d in schema.grad(op, dout, make_grad)]
        values = ex.run(grad_ops, gscope, fetch=list(made.values()))
        for var in made.values():
            if place.kind == "gpu":
                assert is_device_array(var.value), f"{op_type}: {var.name} is not on the device"
        grads[wanted] = dict(zip(made, values, strict=True))
    return outs, grads


def assert_close(got, want, where):
    """got has want's shape and dtype and (floats) a relative error under TOL[dtype], or
    (others) equal values; `where` names the case in the failure. Lists (a duplicable
    slot's) item by item."""
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), f"{where}: {len(want)} values"
        for k, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{where}[{k}]")
        return
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{where}: {got.dtype}{got.shape}, expected {want.dtype}{want.shape}"
    if want.dtype.kind != "f":
        np.testing.assert_array_equal(got, want, err_msg=where)
        return
    assert np.isfinite(got).all() == np.isfinite(want).all(), f"{where}: non-finite values"
    scale = np.linalg.norm(want.astype(np.float64).ravel()) or 1.0
    err = np.linalg.norm((got.astype(np.float64) - want).ravel()) / scale
    assert err < TOL[want.dtype], f"{where}: relative error {err:.3g}"


def r(*shape, dtype=np.float32, seed=0):
    """Standard normal values of `shape` and `dtype`, seeded by `seed` and the shape."""
    return np.random.default_rng(seed + sum(shape)).standard_normal(shape).astype(dtype)


def labels(n, k, seed=0):
    """n int64 labels in [0, k)."""
    return np.random.default_rng(seed).integers(0, k, n).astype(np.int64)


def small_net(place, optimizer, seed=7):
    """data -> conv2d -> relu -> pool2d -> fc -> softmax_with_cross_entropy -> mean."""
    net = mg.Net(place=place, seed=seed)
    image = layers.data(net, "image", shape=(-1, 2, 6, 6))
    label = layers.data(net, "label", shape=(-1,), dtype="int64")
    h = layers.relu(net, layers.conv2d(net, image, num_filters=4, filter_size=3, padding=1))
    h = layers.pool2d(net, h, 2)
    logits = layers.fc(net, h, size=5)
    loss = layers.mean(net, layers.softmax_with_cross_entropy(net, logits, label))
    optimizer.minimize(net, loss)
    return net, logits, loss


def batches(steps, n=4, seed=0):
    """`steps` feeds of small_net: n images (2, 6, 6) and labels in [0, 5)."""
    rng = np.random.default_rng(seed)
    return [{"image": rng.standard_normal((n, 2, 6, 6)).astype(np.float32),
             "label": rng.integers(0, 5, n).astype(np.int64)} for _ in range(steps)]
