"""adam (and AdamW's decoupled form): one step against the published update rule."""
import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg

rng = np.random.default_rng(3)
SLOTS = ("param", "moment1", "moment2", "beta1_pow", "beta2_pow")


def adam_reference(param, grad, moment1, moment2, beta1_pow, beta2_pow, learning_rate,
                   beta1=0.9, beta2=0.999, epsilon=1e-8, weight_decay=0.0, decoupled=False):
    """torch.optim.Adam / AdamW (single tensor, float64), one step."""
    lr = float(learning_rate)
    b1p, b2p = float(beta1_pow) * beta1, float(beta2_pow) * beta2
    if decoupled:
        param = param * (1 - lr * weight_decay)
    else:
        grad = grad + weight_decay * param
    m = beta1 * moment1 + (1 - beta1) * grad
    v = beta2 * moment2 + (1 - beta2) * grad * grad
    denom = np.sqrt(v) / np.sqrt(1 - b2p) + epsilon
    return {"param_out": param - lr / (1 - b1p) * m / denom, "moment1_out": m,
            "moment2_out": v, "beta1_pow_out": np.array(b1p), "beta2_pow_out": np.array(b2p)}


def inputs(shape=(3, 4), dtype=np.float64, b1p=0.9, b2p=0.999):
    return {"param": rng.standard_normal(shape).astype(dtype),
            "grad": rng.standard_normal(shape).astype(dtype),
            "moment1": rng.standard_normal(shape).astype(dtype) * 0.1,
            "moment2": rng.random(shape).astype(dtype) * 0.01,
            "beta1_pow": np.array(b1p), "beta2_pow": np.array(b2p),
            "learning_rate": np.array(0.01)}


@pytest.mark.parametrize("attrs", [{}, {"weight_decay": 0.1}, {"weight_decay": 0.1, "decoupled": True},
                                   {"beta1": 0.5, "beta2": 0.9, "epsilon": 1e-3},
                                   {"beta1": 0.0}])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_adam_one_step(attrs, dtype):
    ins = inputs(dtype=dtype)
    want = adam_reference(**{k: np.float64(v) for k, v in ins.items()}, **attrs)

    def tensors_only(**kw):          # the helper wants every compared float output in x's dtype
        return {k: v for k, v in adam_reference(**kw).items() if "pow" not in k}
    got = helper_test_op("adam", ins, attrs, tensors_only)
    for slot in ("beta1_pow_out", "beta2_pow_out"):
        assert got[slot].dtype == np.float64
        np.testing.assert_allclose(got[slot], want[slot], rtol=1e-15)


def test_first_step_from_fresh_state():
    ins = inputs(b1p=1.0, b2p=1.0)
    ins["moment1"][...] = 0
    ins["moment2"][...] = 0
    got = helper_test_op("adam", ins, {}, adam_reference)
    # the first Adam step moves every element by about lr (m/sqrt(v) = sign(g) after correction)
    np.testing.assert_allclose(np.abs(got["param_out"] - ins["param"]), 0.01, rtol=1e-4)


def test_bad_state_is_a_clear_error():
    ins = inputs()
    scope = mg.Scope()
    kw = {}
    for slot, value in ins.items():
        kw[slot] = scope.new_var(slot)
        kw[slot].set(value)
    kw["beta1_pow"].set(np.array(0.9, np.float32))
    outs = {f"{s}_out": kw[s] for s in SLOTS}
    with pytest.raises(mg.OpError, match="adam: input 'beta1_pow' must be a float64 scalar"):
        mg.Operator("adam", **kw, **outs)
    kw["beta1_pow"].set(np.array(0.9))
    with pytest.raises(mg.OpError, match=r"adam: attribute 'beta1' must be in \[0, 1\)"):
        mg.Operator("adam", **kw, **outs, beta1=1.0)
    with pytest.raises(mg.OpError, match="adam: input 'moment2' must have shape"):
        kw["moment2"].set(np.zeros(3))
        mg.Operator("adam", **kw, **outs)


@pytest.mark.parametrize("attrs", [{}, {"weight_decay": 0.1, "decoupled": True}])
def test_a_float16_parameter_is_updated_in_float32(attrs):
    """In float16 epsilon = 1e-8 is 0 and (1 - beta2) g^2 underflows: the first step
    used to divide by zero and commit non-finite weights."""
    scope = mg.Scope()
    ins = inputs(dtype=np.float32, b1p=1.0, b2p=1.0)
    ins["param"] = ins["param"].astype(np.float16)
    ins["grad"] = (ins["grad"] * 1e-4).astype(np.float16)     # squares below float16's range
    ins["moment1"][...] = 0
    ins["moment2"][...] = 0
    kw = {}
    for slot, value in ins.items():
        kw[slot] = scope.new_var(slot)
        kw[slot].set(value)
    op = mg.Operator("adam", **kw, **{f"{s}_out": kw[s] for s in SLOTS}, **attrs)
    mg.Executor(mg.CPUPlace()).run([op], scope)
    want = adam_reference(**{k: np.float64(v) for k, v in ins.items()}, **attrs)
    got = kw["param"].get()
    assert got.dtype == np.float16 and np.isfinite(got).all()
    np.testing.assert_allclose(got, want["param_out"], rtol=2 ** -10)     # float16 rounding
    assert kw["moment2"].get().dtype == np.float32 and (kw["moment2"].get() > 0).all()
    np.testing.assert_allclose(kw["moment2"].get(), want["moment2_out"], rtol=1e-6)


def test_a_float16_net_trains_with_adam():
    """Its batch norm used to fail a step later, blamed for the weights Adam broke."""
    from minigraph import layers as L

    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 4), dtype="float16")
    y = L.data(net, "y", shape=(-1,), dtype="int64")
    h = L.batch_norm(net, L.fc(net, x, 8, name="fc1"), name="bn1")
    loss = L.mean(net, L.softmax_with_cross_entropy(net, L.fc(net, L.relu(net, h), 3), y))
    mg.optimizer.Adam(1e-3).minimize(net, loss)
    feed = {"x": rng.standard_normal((16, 4)).astype(np.float16), "y": rng.integers(0, 3, 16)}
    losses = [float(net.train(feed=feed, fetch=[loss])[0]) for _ in range(20)]
    assert all(np.isfinite(p.get()).all() for p in net.parameters())
    assert losses[-1] < losses[0]
    (moment,) = [v for v in net.persistables() if v.name.endswith("fc1.w.moment1")]
    assert moment.dtype == np.float32


def test_float16_moments_are_refused():
    scope = mg.Scope()
    kw = {s: scope.new_var(s) for s in ("param", "grad", "learning_rate") + SLOTS[1:]}
    ins = inputs(dtype=np.float16)
    for slot, var in kw.items():
        var.set(ins[slot])
    with pytest.raises(mg.OpError, match="adam: input 'moment1' must have shape \\(3, 4\\) "
                                         "and dtype float32 \\(those of 'param'; float32 for "
                                         "a float16 param\\)"):
        mg.Operator("adam", **kw, **{f"{s}_out": kw[s] for s in SLOTS})
