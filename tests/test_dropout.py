"""dropout: inverted dropout with Philox4x32-10 masks keyed by (seed, step); identity in infer."""
import numpy as np
import pytest
from helpers import helper_test_op
from references import dropout_keep

import minigraph as mg
from minigraph.schema import get_schema

rng = np.random.default_rng(8)


def dropout_reference(x, step, p=0.5, seed=0, is_infer=False):
    """dropout's outputs in float64 from references.dropout_keep (an independent
    Philox): x / (1 - p) where kept, the mask, the step after the call."""
    if is_infer:
        return {"out": x.copy(), "step_out": step}
    keep = dropout_keep(x.size, p, seed, int(step)).reshape(x.shape)
    return {"out": np.where(keep, x / (1.0 - p), 0.0), "mask": keep.astype(np.uint8),
            "step_out": step + 1}


def step_of(k):
    return np.array(k, dtype=np.int64)


@pytest.mark.parametrize("shape, p, seed, step", [((3, 5), 0.5, 0, 0), ((7,), 0.3, 12345, 3),
                                                  ((2, 3, 4), 0.9, 2**32 - 1, 2**33 + 7),
                                                  ((1,), 0.5, 1, 1), ((0, 3), 0.5, 1, 1)])
def test_forward_matches_independent_philox_reference(shape, p, seed, step):
    x = rng.standard_normal(shape)
    got = helper_test_op("dropout", {"x": x, "step": step_of(step)},
                         {"p": p, "seed": seed}, dropout_reference)
    assert got["mask"].dtype == np.uint8


def test_float32_uses_the_factor_in_x_dtype():
    x = rng.standard_normal((4, 6)).astype("float32")
    got = helper_test_op("dropout", {"x": x, "step": step_of(5)}, {"p": 0.3, "seed": 9},
                         dropout_reference)
    assert got["out"].dtype == np.float32
    factor = np.float32(1.0 / (1.0 - 0.3))
    np.testing.assert_array_equal(got["out"], x * (got["mask"].astype("float32") * factor))


def test_grad_through_helper_with_fixed_step():
    x = rng.standard_normal((4, 5))
    helper_test_op("dropout", {"x": x, "step": step_of(11)}, {"p": 0.4, "seed": 3},
                   dropout_reference, grad_wrt=("x",))


def test_infer_grad_is_identity():
    x = rng.standard_normal((3, 4))
    helper_test_op("dropout", {"x": x, "step": step_of(2)}, {"p": 0.4, "is_infer": True},
                   dropout_reference, grad_wrt=("x",))


def test_dropout_grad_kernel_is_the_mask_rule():
    d = rng.standard_normal((6, 7)).astype("float32")
    mask = (rng.random((6, 7)) > 0.5).astype(np.uint8)
    scope = mg.Scope()
    dv, mv, dx = scope.new_var("dout"), scope.new_var("mask"), scope.new_var("dx")
    dv.set(d)
    mv.set(mask)
    mg.Executor().run([mg.Operator("dropout_grad", mask=mv, dout=dv, dx=dx, p=0.25)], scope)
    assert dx.get().dtype == np.float32
    np.testing.assert_allclose(dx.get(), d * mask / 0.75, rtol=1e-6)


class Dropout:
    """One dropout op in a scope with a persistable step counter."""

    def __init__(self, x, p=0.5, seed=7, is_infer=False, step=0):
        self.scope = mg.Scope()
        self.x, self.out, self.mask = (self.scope.new_var(n) for n in ("x", "out", "mask"))
        self.step = self.scope.new_var("step", persistable=True)
        self.x.set(x)
        self.step.set(step_of(step))
        self.op = mg.Operator("dropout", x=self.x, step=self.step, out=self.out, mask=self.mask,
                              step_out=self.step, p=p, seed=seed, is_infer=is_infer)

    def run(self):
        mg.Executor().run([self.op], self.scope)
        return self.out.get().copy(), self.mask.get().copy(), int(self.step.get())


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_train_statistics(p):
    n = 100_000
    x = rng.uniform(0.5, 2.0, n)
    out, mask, _ = Dropout(x, p=p, seed=123).run()
    kept = mask.astype(bool)
    sigma = np.sqrt(n * p * (1 - p))
    assert abs(kept.sum() - n * (1 - p)) < 4 * sigma
    np.testing.assert_allclose(out[kept], x[kept] / (1 - p), rtol=1e-15)
    assert (out[~kept] == 0).all()
    # E[out_i] = x_i: the mean of out / x is 1 within 4 standard errors
    ratio = out / x
    assert abs(ratio.mean() - 1) < 4 * ratio.std() / np.sqrt(n)


def test_masks_are_independent_of_position_patterns():
    """Neighbouring elements (the 4 words of one Philox call) are not correlated."""
    _, mask, _ = Dropout(np.ones(40_000), p=0.5, seed=1).run()
    m = mask.astype(float).reshape(-1, 4)
    corr = np.corrcoef(m.T)
    assert np.abs(corr - np.eye(4)).max() < 0.05


def test_determinism_and_the_step_counter():
    x = rng.standard_normal((50, 20))
    a = Dropout(x, seed=5)
    out0, mask0, step = a.run()
    assert step == 1
    out1, mask1, step = a.run()
    assert step == 2 and not np.array_equal(mask0, mask1)      # a new step, a new mask
    b = Dropout(x, seed=5)
    np.testing.assert_array_equal(b.run()[1], mask0)             # same seed and step
    c = Dropout(x, seed=5, step=1)
    np.testing.assert_array_equal(c.run()[1], mask1)
    d = Dropout(x, seed=6)
    assert not np.array_equal(d.run()[1], mask0)                 # another seed
    np.testing.assert_array_equal(out0, np.where(mask0, x * 2.0, 0.0))


def test_mask_depends_on_the_flat_index_only():
    x = rng.standard_normal(24)
    flat = Dropout(x, seed=4).run()[1]
    shaped = Dropout(x.reshape(2, 3, 4), seed=4).run()[1]
    np.testing.assert_array_equal(shaped.ravel(), flat)


def test_infer_is_identity_and_leaves_step_and_mask():
    x = rng.standard_normal((5, 6))
    d = Dropout(x, is_infer=True, step=3)
    d.mask.set(np.full(x.shape, 7, np.uint8))
    out, mask, step = d.run()
    np.testing.assert_array_equal(out, x)
    assert not np.shares_memory(d.out.get(), d.x.get())
    assert step == 3 and (mask == 7).all()


def test_p_zero_keeps_everything():
    x = rng.standard_normal((30, 30)).astype("float32")
    out, mask, step = Dropout(x, p=0.0).run()
    np.testing.assert_array_equal(out, x)
    assert out.dtype == np.float32 and (mask == 1).all() and step == 1


def test_schema_declares_mode_and_in_place_counter():
    s = get_schema("dropout")
    assert s.mode_attr == "is_infer" and s.inplace == {"step_out": "step"}
    assert s.attr("p").default == 0.5 and s.attr("seed").default == 0
    op = Dropout(np.zeros(3)).op
    assert s.grad(op, {"out": None, "mask": None, "step_out": None}, lambda v: v) == []


def test_grad_maker_builds_dropout_grad_from_the_mask():
    d = Dropout(np.zeros(3), p=0.2)
    dout = d.scope.new_var("dout")
    descs = d.op.schema.grad(d.op, {"out": dout, "mask": None, "step_out": None},
                             lambda v: d.scope.new_var("dx") if v is d.x else None)
    assert [g.type for g in descs] == ["dropout_grad"]
    assert descs[0].kwargs["mask"] is d.mask and descs[0].kwargs["p"] == 0.2


def test_grad_needs_the_mask_in_training():
    scope = mg.Scope()
    x, step, out = scope.new_var("x"), scope.new_var("step"), scope.new_var("out")
    x.set(np.zeros(3))
    step.set(step_of(0))
    op = mg.Operator("dropout", x=x, step=step, out=out, step_out=step)
    with pytest.raises(mg.OpError, match="dropout: output 'mask' must be bound"):
        op.schema.grad(op, {"out": scope.new_var("d")}, lambda v: scope.new_var("dx"))


def build(x_shape=(3,), x_dtype="float32", step_shape=(), step_dtype="int64", **attrs):
    scope = mg.Scope()
    x, step = scope.new_var("x"), scope.new_var("step")
    x.declare(x_shape, np.dtype(x_dtype))
    step.declare(step_shape, np.dtype(step_dtype))
    return mg.Operator("dropout", x=x, step=step, out=scope.new_var("out"), step_out=step,
                       **attrs)


@pytest.mark.parametrize("p", [-0.1, 1.0, float("nan"), 1.5])
def test_p_out_of_range(p):
    with pytest.raises(mg.OpError, match=r"dropout: attribute 'p' must be in \[0, 1\)"):
        build(p=p)


@pytest.mark.parametrize("seed, match", [(-1, r"must be in \[0, 2\*\*32\)"),
                                         (2**32, r"must be in \[0, 2\*\*32\)"),
                                         (1.5, "must be int")])
def test_seed_out_of_range(seed, match):
    with pytest.raises(mg.OpError, match=rf"dropout: attribute 'seed' {match}"):
        build(seed=seed)


@pytest.mark.parametrize("kwargs, match", [
    ({"x_dtype": "int64"}, r"dropout: input 'x' must be a float tensor"),
    ({"step_dtype": "int32"}, r"dropout: input 'step' must be an int64 scalar"),
    ({"step_shape": (1,)}, r"dropout: input 'step' must be an int64 scalar \(shape \(\)\)"),
])
def test_bad_inputs(kwargs, match):
    with pytest.raises(mg.OpError, match=match):
        build(**kwargs)


def test_step_out_must_be_the_step_variable():
    scope = mg.Scope()
    x, step = scope.new_var("x"), scope.new_var("step")
    with pytest.raises(mg.OpError, match="dropout: output 'step_out' must be the same Variable"):
        mg.Operator("dropout", x=x, step=step, out=scope.new_var("out"),
                    step_out=scope.new_var("other"))


def test_unknown_batch_flows_through():
    op = build(x_shape=(-1, 4))
    assert op.outputs["out"].shape == (-1, 4)


def test_dropout_grad_checks_mask():
    scope = mg.Scope()
    d, m = scope.new_var("dout"), scope.new_var("mask")
    d.declare((2, 3), np.dtype("float32"))
    m.declare((2, 3), np.dtype("bool"))
    with pytest.raises(mg.OpError, match="dropout_grad: input 'mask' must have dtype uint8"):
        mg.Operator("dropout_grad", mask=m, dout=d, dx=scope.new_var("dx"))
    m2 = scope.new_var("m2")
    m2.declare((3, 2), np.dtype("uint8"))
    with pytest.raises(mg.OpError, match=r"dropout_grad: input 'mask' must have shape \(2, 3\)"):
        mg.Operator("dropout_grad", mask=m2, dout=d, dx=scope.new_var("dx2"))
