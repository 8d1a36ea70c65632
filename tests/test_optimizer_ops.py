"""sgd and momentum: in-place parameter updates."""
import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg

rng = np.random.default_rng(0)


def sgd_reference(param, grad, learning_rate, weight_decay=0.0):
    return {"param_out": param - float(np.ravel(learning_rate)[0]) * (grad + weight_decay * param)}


@pytest.mark.parametrize("lr_shape", [(), (1,)])
@pytest.mark.parametrize("attrs", [{}, {"weight_decay": 0.1}])
def test_sgd(lr_shape, attrs):
    helper_test_op("sgd", {"param": rng.standard_normal((3, 4)),
                           "grad": rng.standard_normal((3, 4)),
                           "learning_rate": np.full(lr_shape, 0.1)}, attrs, sgd_reference)


def test_sgd_float32_updates_the_array_in_place():
    scope = mg.Scope()
    p, g, lr = scope.new_var("p"), scope.new_var("g"), scope.new_var("lr")
    start = rng.standard_normal(5).astype("float32")
    p.set(start.copy())
    g.set(np.ones(5, "float32"))
    lr.set(np.array(0.5, "float32"))
    array = p.value
    op = mg.Operator("sgd", param=p, grad=g, learning_rate=lr, param_out=p)
    mg.Executor().run([op, op], scope)
    assert p.value is array and array.dtype == np.float32
    np.testing.assert_allclose(array, start - 1.0, rtol=1e-6)
    assert op.schema.grad is None


def momentum_reference(param, grad, velocity, learning_rate, mu=0.9, use_nesterov=False,
                       weight_decay=0.0):
    lr = float(np.ravel(learning_rate)[0])
    grad = grad + weight_decay * param
    v = mu * velocity + grad
    step = grad + mu * v if use_nesterov else v
    return {"param_out": param - lr * step, "velocity_out": v}


@pytest.mark.parametrize("attrs", [{}, {"mu": 0.5}, {"use_nesterov": True}, {"mu": 0.0},
                                   {"weight_decay": 0.05, "use_nesterov": True}])
def test_momentum(attrs):
    shape = (4, 3)
    helper_test_op("momentum", {
        "param": rng.standard_normal(shape), "grad": rng.standard_normal(shape),
        "velocity": rng.standard_normal(shape), "learning_rate": np.array([0.05])},
        attrs, momentum_reference)


def test_momentum_steps_update_in_place():
    scope = mg.Scope()
    p, g, v, lr = (scope.new_var(n) for n in ("p", "g", "v", "lr"))
    want_p, want_v = rng.standard_normal(6), np.zeros(6)
    p.set(want_p.copy())
    v.set(want_v.copy())
    lr.set(np.array(0.1))
    arrays = p.value, v.value
    op = mg.Operator("momentum", param=p, grad=g, velocity=v, learning_rate=lr, param_out=p,
                     velocity_out=v, mu=0.9, use_nesterov=True)
    for _ in range(4):
        grad = rng.standard_normal(6)
        g.set(grad)
        mg.Executor().run([op], scope)
        want = momentum_reference(want_p, grad, want_v, 0.1, 0.9, True)
        want_p, want_v = want["param_out"], want["velocity_out"]
    assert p.value is arrays[0] and v.value is arrays[1]
    np.testing.assert_allclose(p.value, want_p, rtol=1e-12)
    np.testing.assert_allclose(v.value, want_v, rtol=1e-12)


def build_update(op_type, param, grad, lr, extra=None, **attrs):
    scope = mg.Scope()
    kw = {}
    for slot, value in {"param": param, "grad": grad, "learning_rate": lr, **(extra or {})}.items():
        kw[slot] = scope.new_var(slot)
        kw[slot].set(value)
    kw["param_out"] = kw["param"]
    if "velocity" in kw:
        kw["velocity_out"] = kw["velocity"]
    return mg.Operator(op_type, **kw, **attrs)


def test_sgd_bad_inputs():
    z = np.zeros((3, 4))
    with pytest.raises(mg.OpError, match=r"sgd: input 'grad' must have shape \(3, 4\) "
                                         r"\(the shape of 'param'\), got \(4, 3\)"):
        build_update("sgd", z, np.zeros((4, 3)), np.array(0.1))
    with pytest.raises(mg.OpError, match=r"input 'learning_rate' must be a scalar .*got \(2,\)"):
        build_update("sgd", z, z, np.array([0.1, 0.2]))
    with pytest.raises(mg.OpError, match="input 'grad' has dtype float32 but input 'param'"):
        build_update("sgd", z, z.astype("float32"), np.array(0.1))
    scope = mg.Scope()
    p, g, lr, other = (scope.new_var(n) for n in ("p", "g", "lr", "other"))
    with pytest.raises(mg.OpError, match="output 'param_out' must be the same Variable as "
                                         "input 'param'"):
        mg.Operator("sgd", param=p, grad=g, learning_rate=lr, param_out=other)


def test_momentum_bad_inputs():
    z = np.zeros((3, 4))
    with pytest.raises(mg.OpError, match=r"momentum: input 'grad' must have shape \(3, 4\)"):
        build_update("momentum", z, np.zeros(12), np.array(0.1), {"velocity": z})
    with pytest.raises(mg.OpError, match=r"momentum: input 'velocity' must have shape \(3, 4\)"):
        build_update("momentum", z, z, np.array(0.1), {"velocity": np.zeros(3)})
    with pytest.raises(mg.OpError, match=r"attribute 'mu' must be in \[0.0, 1.0\]"):
        build_update("momentum", z, z, np.array(0.1), {"velocity": z}, mu=1.5)


def test_helper_leaves_the_callers_arrays_alone():
    param, grad = rng.standard_normal(4), rng.standard_normal(4)
    kept = param.copy()
    for _ in range(2):
        helper_test_op("sgd", {"param": param, "grad": grad, "learning_rate": np.array(0.5)},
                       {}, sgd_reference)
    np.testing.assert_array_equal(param, kept)
