import numpy as np
import pytest

import minigraph as mg


def test_new_var_find_var_walks_up_to_parents():
    root = mg.Scope()
    x = root.new_var("x")
    child = root.new_scope()
    grandchild = child.new_scope()
    assert child.find_var("x") is x
    assert grandchild.find_var("x") is x
    assert child.find_local_var("x") is None
    assert root.find_var("nope") is None


def test_child_var_shadows_parent_and_is_invisible_to_parent():
    root = mg.Scope()
    outer = root.new_var("h")
    kid = root.new_scope()
    inner = kid.new_var("h")
    assert kid.find_var("h") is inner
    assert root.find_var("h") is outer


def test_creating_a_name_twice_in_one_scope_is_an_error():
    scope = mg.Scope()
    scope.new_var("x")
    with pytest.raises(ValueError, match="'x' already exists"):
        scope.new_var("x")
    scope.new_scope().new_var("x")          # another scope may reuse it


def test_drop_kids_forgets_child_scopes():
    root = mg.Scope()
    root.new_scope()
    root.new_scope()
    assert len(root.kids) == 2
    root.drop_kids()
    assert root.kids == []


def test_variable_value_shape_dtype_and_flags():
    scope = mg.Scope()
    v = scope.new_var("w", persistable=True, trainable=True)
    assert v.persistable and v.trainable
    assert v.shape is None and v.dtype is None
    with pytest.raises(ValueError, match="has no value"):
        v.get()
    v.declare((-1, 3), "float32")
    assert v.shape == (-1, 3) and v.dtype == np.float32
    v.set(np.zeros((2, 3), np.float32))
    assert v.shape == (2, 3) and v.dtype == np.float32
    assert isinstance(v.get(), np.ndarray)
    assert scope.new_var("e").persistable is False


# ---- Variable.set copies host arrays -------------------------------------------------

def test_set_copies_a_numpy_array():
    v = mg.Scope().new_var("w")
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    v.set(a)
    a[0, 0] = 99.0
    assert v.get()[0, 0] == 0.0 and v.value is not a
    v.value[1, 1] = -1.0
    assert a[1, 1] == 4.0
    f = np.asfortranarray(np.ones((3, 2)))
    v.set(f)
    assert v.value.flags.c_contiguous and v.value.dtype == np.float64
    v.set(np.float32(2.5))
    assert v.shape == () and v.dtype == np.float32


def test_a_training_step_never_rewrites_the_users_array():
    net = mg.Net(seed=0)
    x = mg.layers.data(net, "x", shape=(-1, 4))
    loss = mg.layers.mean(net, mg.layers.fc(net, x, size=3, name="fc"))
    mg.optimizer.SGD(learning_rate=0.5).minimize(net, loss)
    mine = np.full((4, 3), 0.25, np.float32)
    net.var("fc.w").set(mine)
    net.train(feed={"x": np.ones((2, 4), np.float32)}, fetch=[loss])
    assert np.array_equal(mine, np.full((4, 3), 0.25, np.float32))
    assert not np.array_equal(net.var("fc.w").get(), mine)      # the step did update fc.w


# ---- variable names ---------------------------------------------------------------

@pytest.mark.parametrize("name", ["fc_0.w", "x@GRAD", "x@GRAD@1", "bn1.num_batches",
                                  "adam_0.learning_rate", "momentum_0.c1.w.velocity",
                                  "learning_rate_0", "c1.w.velocity", "a b", "ünïcode",
                                  "x" * 255, "...", ".hidden", "__x", "x__"])
def test_names_the_project_uses_stay_valid(name):
    assert mg.Scope().new_var(name).name == name


@pytest.mark.parametrize("name, rule", [
    ("", "must not be empty"),
    ("x" * 256, "at most 255 characters"),
    ("a/b", "path separator"),
    ("../etc/passwd", "path separator"),
    ("a\\b", "path separator"),
    ("..", "must not be '.' or '..'"),
    (".", "must not be '.' or '..'"),
    ("a\0b", "must not contain NUL"),
    ("line\nbreak", "printable characters only"),
    ("tab\there", "printable characters only"),
])
def test_bad_names_are_refused_naming_the_variable_and_the_rule(name, rule):
    scope = mg.Scope()
    with pytest.raises(ValueError) as err:
        scope.new_var(name)
    assert rule in str(err.value)
    assert repr(name[:77])[:-1] in str(err.value)
    assert scope.vars == {}


def test_a_name_must_be_a_string():
    with pytest.raises(TypeError, match="must be a str"):
        mg.Scope().new_var(3)


def test_layer_names_are_checked_too():
    net = mg.Net(seed=0)
    x = mg.layers.data(net, "x", shape=(-1, 4))
    with pytest.raises(ValueError, match="path separator"):
        mg.layers.fc(net, x, size=3, name="../fc")
    with pytest.raises(ValueError, match="path separator"):
        mg.layers.data(net, "a/b", shape=(-1, 4))


# ---- what a persistable takes, and what get() gives ------------------------------------

def test_a_persistable_refuses_none_a_list_and_another_shape_or_dtype():
    v = mg.Scope().new_var("w", persistable=True)
    v.set(np.zeros((2, 3), np.float32))
    before = v.value
    for bad, kind, message in [
            (None, TypeError, "takes an array, got NoneType"),
            ([[0.0] * 3] * 2, TypeError, "takes an array, got list"),
            (np.zeros((3, 2), np.float32), ValueError, r"holds shape \(2, 3\), got shape \(3, 2\)"),
            (np.zeros(6, np.float32), ValueError, "holds shape"),
            (np.zeros((2, 3), np.float64), TypeError, "holds float32, got float64"),
            ("abc", TypeError, "takes an array")]:
        with pytest.raises(kind, match=message):
            v.set(bad)
        assert v.value is before
    v.set(np.ones((2, 3), np.float32))              # the right shape and dtype is fine
    s = mg.Scope().new_var("lr", persistable=True)
    s.set(np.float64(0.5))                           # a numpy scalar for a scalar
    s.set(0.25)
    assert s.get() == 0.25 and s.get().dtype == np.float64
    fresh = mg.Scope().new_var("any", persistable=True)
    fresh.set(np.arange(3))                          # nothing known yet: any array
    temp = mg.Scope().new_var("t")
    temp.set([1, 2, 3])                              # temporaries take host values as before
    temp.set(None)


def test_get_returns_a_copy_the_variable_never_changes():
    """Keep-the-best-weights: `best = var.get()` must not follow later steps, and
    writing into it must not change the variable."""
    import minigraph.layers as L

    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 4))
    lbl = L.data(net, "label", shape=(-1,), dtype="int64")
    h = L.batch_norm(net, L.fc(net, x, 3, name="fc"), name="bn")
    loss = L.mean(net, L.softmax_with_cross_entropy(net, h, lbl))
    mg.optimizer.Momentum(0.1, 0.9).minimize(net, loss)
    rng = np.random.default_rng(0)
    feed = {"x": rng.standard_normal((8, 4)).astype(np.float32), "label": rng.integers(0, 3, 8)}
    net.train(feed=feed)
    w, mean = net.var("fc.w"), net.var("bn.estimated_mean")
    best_w, best_mean = w.get(), mean.get()
    kept_w, kept_mean = best_w.copy(), best_mean.copy()
    (fetched_w, fetched_mean, _) = net.train(feed=feed, fetch=[w, mean, loss])
    kept_fetch = fetched_mean.copy()
    for _ in range(3):
        net.train(feed=feed)
    np.testing.assert_array_equal(best_w, kept_w)
    np.testing.assert_array_equal(best_mean, kept_mean)     # estimates change in place
    np.testing.assert_array_equal(fetched_mean, kept_fetch)
    now = w.get()
    best_w[...] = 7.0
    fetched_w[...] = 7.0
    np.testing.assert_array_equal(w.get(), now)
    (inferred,) = net.infer(feed={"x": feed["x"]}, fetch=[mean])
    inferred[...] = 5.0
    assert not (mean.get() == 5.0).any()


# ---- values a persistable may hold ---------------------------------------------------------

def bn_net():
    net = mg.Net(seed=0)
    x = mg.layers.data(net, "x", shape=(-1, 3))
    y = mg.layers.data(net, "y", shape=(-1,), dtype="int64")
    h = mg.layers.batch_norm(net, mg.layers.fc(net, x, 3, name="fc"), name="bn")
    loss = mg.layers.mean(net, mg.layers.softmax_with_cross_entropy(net, h, y))
    mg.optimizer.SGD(0.1).minimize(net, loss)
    return net


@pytest.mark.parametrize("name, value, message", [
    ("bn.estimated_var", np.array([1, -0.5, 1], np.float32), "variance estimate 'bn.estimated_var'"
                                                             " holds -0.5 at index 1"),
    ("bn.estimated_mean", np.array([0, np.nan, 0], np.float32), "1 NaN"),
    ("fc.w", np.full((3, 3), np.inf, np.float32), "9 inf"),
    ("bn.num_batches", np.array(-1), "counter 'bn.num_batches' holds -1"),
    ("sgd_0.learning_rate", np.array(-0.1), "learning rate 'sgd_0.learning_rate' holds -0.1"),
])
def test_set_checks_a_persistable_as_a_load_does(name, value, message):
    """A negative variance estimate used to be accepted by Variable.set."""
    var = bn_net().var(name)
    before = var.get()
    with pytest.raises(ValueError) as err:
        var.set(value)
    assert str(err.value).startswith("Variable.set: ") and message in str(err.value)
    assert str(err.value).endswith("the value stays as it was")
    assert var.get().tobytes() == before.tobytes()


def test_set_checks_low_level_persistables_by_dtype_only():
    scope = mg.Scope()
    w = scope.new_var("w", persistable=True)
    with pytest.raises(ValueError, match="'w' holds non-finite values"):
        w.set(np.array([1.0, np.nan]))
    assert w.value is None
    w.set(np.array([-1.0, 2.0]))                  # nothing says it is a variance
    tmp = scope.new_var("t")
    tmp.set(np.array([np.nan]))                   # temporaries hold anything
