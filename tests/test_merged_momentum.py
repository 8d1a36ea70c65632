"""merged_momentum: momentum's update of a list of parameters in one op, against the
float64 reference and against the momentum op itself, in place and into spare
arrays, with the native kernel and with numpy's per-parameter fallback."""
import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg
from minigraph.kernels.cpu import optim_native
from minigraph.schema import KernelContext, OpError, get_schema

rng = np.random.default_rng(5)
SHAPES = [(3, 5), (7,), (40, 600), (1,)]        # 24000 values: the native call splits them


def merged_reference(param, grad, velocity, learning_rate, mu=0.9, use_nesterov=False,
                     weight_decay=0.0, mu_value=None):
    lr = float(np.ravel(learning_rate)[0])
    mu = mu if mu_value is None else float(mu_value)
    params, velocities = [], []
    for p, g, v in zip(param, grad, velocity):
        d = g + weight_decay * p
        nv = mu * v + d
        params.append(p - lr * (d + mu * nv if use_nesterov else nv))
        velocities.append(nv)
    return {"param_out": params, "velocity_out": velocities}


def lists(dtype, shapes=SHAPES):
    return {slot: [rng.standard_normal(s).astype(dtype) for s in shapes]
            for slot in ("param", "grad", "velocity")}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("attrs", [{}, {"mu": 0.5}, {"use_nesterov": True}, {"mu": 0.0},
                                   {"weight_decay": 0.05, "use_nesterov": True}])
def test_merged_momentum_matches_the_float64_reference(dtype, attrs):
    helper_test_op("merged_momentum", {**lists(dtype), "learning_rate": np.array([0.05])},
                   attrs, merged_reference)


def test_a_bound_mu_value_replaces_the_attribute():
    helper_test_op("merged_momentum", {**lists(np.float32), "learning_rate": np.array(0.1),
                                       "mu_value": np.array(0.87)},
                   {"mu": 0.5}, merged_reference)


def run_kernel(ins, attrs, spares=None):
    op_ins = {slot: [a.copy() for a in v] if isinstance(v, list) else v
              for slot, v in ins.items()}
    op = _operator(len(ins["param"]), attrs)
    ctx = KernelContext(spares=spares)
    return op_ins, get_schema("merged_momentum").kernels["cpu"][0].fn(op, op_ins, ctx)


def _operator(n, attrs):
    scope = mg.Scope()
    ps, gs, vs = ([scope.new_var(f"{s}{i}") for i in range(n)] for s in "pgv")
    return mg.Operator("merged_momentum", param=ps, grad=gs, velocity=vs,
                       learning_rate=scope.new_var("lr"), param_out=ps, velocity_out=vs,
                       **attrs)


def momentum_op_results(ins, attrs):
    """What the momentum op's own kernel gives each parameter."""
    fn = get_schema("momentum").kernels["cpu"][0].fn
    scope = mg.Scope()
    p, g, v, lr = (scope.new_var(n) for n in ("p", "g", "v", "lr"))
    op = mg.Operator("momentum", param=p, grad=g, velocity=v, learning_rate=lr, param_out=p,
                     velocity_out=v, **attrs)
    out = []
    for param, grad, velocity in zip(ins["param"], ins["grad"], ins["velocity"]):
        got = fn(op, {"param": param.copy(), "grad": grad, "velocity": velocity.copy(),
                      "learning_rate": ins["learning_rate"]}, KernelContext())
        out.append((got["param_out"], got["velocity_out"]))
    return out


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("attrs", [{}, {"use_nesterov": True, "weight_decay": 0.01}])
def test_each_parameter_gets_what_the_momentum_op_gives_it(dtype, attrs):
    ins = {**lists(dtype), "learning_rate": np.array(0.1, np.float32)}
    _, got = run_kernel(ins, attrs)
    tol = 1e-6 if dtype == np.float32 else 1e-14
    for k, (p, v) in enumerate(momentum_op_results(ins, attrs)):
        np.testing.assert_allclose(got["param_out"][k], p, rtol=tol, atol=tol)
        np.testing.assert_allclose(got["velocity_out"][k], v, rtol=tol, atol=tol)
        if ins["param"][k].size >= optim_native.MIN_VALUES["momentum"]:
            assert np.array_equal(got["param_out"][k], p)      # both native: the same bits


def test_spares_take_the_new_values_and_leave_the_inputs_alone():
    ins = {**lists(np.float32), "learning_rate": np.array(0.1, np.float32)}
    spare_p = [np.empty_like(a) for a in ins["param"]]
    spare_p[1] = None                                   # this one is written in place
    spare_v = [np.empty_like(a) for a in ins["velocity"]]
    op_ins, got = run_kernel(ins, {}, {"param_out": spare_p, "velocity_out": spare_v})
    _, in_place = run_kernel(ins, {})
    for k in range(len(SHAPES)):
        assert got["velocity_out"][k] is spare_v[k]
        np.testing.assert_array_equal(got["param_out"][k], in_place["param_out"][k])
        np.testing.assert_array_equal(op_ins["velocity"][k], ins["velocity"][k])
        if k == 1:
            assert got["param_out"][k] is op_ins["param"][k]
        else:
            assert got["param_out"][k] is spare_p[k]
            np.testing.assert_array_equal(op_ins["param"][k], ins["param"][k])


def test_arrays_the_native_call_refuses_go_through_numpy(monkeypatch):
    ins = {**lists(np.float32), "learning_rate": np.array(0.1, np.float32)}
    ins["grad"][2] = np.asfortranarray(ins["grad"][2])          # not C-contiguous
    assert not optim_native.update_list("momentum", ins["param"], ins["grad"],
                                        (ins["velocity"], None),
                                        ([a.copy() for a in ins["param"]],
                                         [a.copy() for a in ins["velocity"]], None))
    _, got = run_kernel(ins, {})
    for k, (p, v) in enumerate(momentum_op_results(ins, {})):
        np.testing.assert_allclose(got["param_out"][k], p, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got["velocity_out"][k], v, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not optim_native.available(), reason="native kernels not built")
def test_the_native_list_update_splits_the_same_on_any_number_of_threads():
    ins = lists(np.float32, [(5,), (70_000,), (3, 3), (20_001,)])
    results = []
    for threads in (1, 2, 3):
        outs = ([a.copy() for a in ins["param"]], [a.copy() for a in ins["velocity"]], None)
        assert optim_native.update_list("momentum", ins["param"], ins["grad"],
                                        (ins["velocity"], None), outs, lr=0.1, mu=0.9,
                                        threads=threads)
        results.append(outs)
    for outs in results[1:]:
        for a, b in zip(outs[0] + outs[1], results[0][0] + results[0][1]):
            np.testing.assert_array_equal(a, b)


def test_bad_lists_are_errors_naming_the_op_and_slot():
    scope = mg.Scope()

    def var(name, shape=(3,)):
        v = scope.new_var(name)
        v.set(np.zeros(shape, np.float32))
        return v

    ps, gs, vs = ([var(f"{s}{i}") for i in range(2)] for s in "pgv")
    lr = var("lr", ())
    with pytest.raises(OpError, match="merged_momentum: .*'grad'.*one entry per parameter"):
        mg.Operator("merged_momentum", param=ps, grad=gs[:1], velocity=vs, learning_rate=lr,
                    param_out=ps, velocity_out=vs)
    with pytest.raises(OpError, match="merged_momentum: .*'param'.*twice"):
        mg.Operator("merged_momentum", param=[ps[0], ps[0]], grad=gs, velocity=vs,
                    learning_rate=lr, param_out=[ps[0], ps[0]], velocity_out=vs)
    with pytest.raises(OpError, match="in-place pair"):
        mg.Operator("merged_momentum", param=ps, grad=gs, velocity=vs, learning_rate=lr,
                    param_out=ps[::-1], velocity_out=vs)
    bad = var("bad", (4,))
    with pytest.raises(OpError, match=r"merged_momentum \(parameter 1\): .*'grad'"):
        mg.Operator("merged_momentum", param=ps, grad=[gs[0], bad], velocity=vs,
                    learning_rate=lr, param_out=ps, velocity_out=vs)
    assert get_schema("merged_momentum").grad is None
