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
