"""embedding: rows gathered by int64 id against a loop reference, the table's gradient
(repeated ids add up, the padding row gets none) against finite differences, bad ids,
and the layer (torch's N(0, 1) initialisation with a zero padding row)."""
import numpy as np
import pytest
from helpers import helper_test_op

import minigraph as mg
from minigraph import layers as L

rng = np.random.default_rng(0)


def embedding_reference(ids, w, padding_idx=-1):
    out = np.zeros(ids.shape + (w.shape[1],))
    for pos in np.ndindex(*ids.shape):
        out[pos] = w[int(ids[pos])]
    return {"out": out}


@pytest.mark.parametrize("ids_shape, padding_idx", [((5,), -1), ((3, 4), -1), ((2, 3), 2),
                                                    ((), -1), ((0, 2), -1)])
def test_forward_and_table_grad(ids_shape, padding_idx):
    ids = rng.integers(0, 6, ids_shape).astype(np.int64)
    if ids.size:
        ids.reshape(-1)[0] = 2                     # the padding row is looked up too
    w = rng.standard_normal((6, 3))
    # the padding row's gradient is 0 by definition, not its finite difference: checked
    # by hand below
    grads = ("w",) if ids.size and padding_idx == -1 else ()
    helper_test_op("embedding", {"ids": ids, "w": w}, {"padding_idx": padding_idx},
                   embedding_reference, grad_wrt=grads)


def run_grad(ids, w, dout, padding_idx=-1):
    scope = mg.Scope()
    v = {n: scope.new_var(n) for n in ("ids", "w", "dout", "dw")}
    for n, a in (("ids", ids), ("w", w), ("dout", dout)):
        v[n].set(a)
    mg.Executor().run([mg.Operator("embedding_grad", **v, padding_idx=padding_idx)], scope)
    return v["dw"].get()


def test_repeated_ids_add_and_the_padding_row_gets_nothing():
    ids = np.array([[1, 1], [3, 1]], np.int64)
    dout = np.arange(8, dtype=np.float32).reshape(2, 2, 2)
    dw = run_grad(ids, np.zeros((4, 2), np.float32), dout)
    np.testing.assert_array_equal(dw, [[0, 0], [0 + 2 + 6, 1 + 3 + 7], [0, 0], [4, 5]])
    assert dw.dtype == np.float32
    dw = run_grad(ids, np.zeros((4, 2), np.float32), dout, padding_idx=1)
    np.testing.assert_array_equal(dw, [[0, 0], [0, 0], [0, 0], [4, 5]])


@pytest.mark.parametrize("bad", [-1, 4])
def test_an_id_outside_the_table_names_ids(bad):
    ids = np.array([0, bad, 1], np.int64)
    scope = mg.Scope()
    vi, vw, out = scope.new_var("ids"), scope.new_var("w"), scope.new_var("out")
    vi.set(ids)
    vw.set(np.zeros((4, 2)))
    with pytest.raises(mg.OpError, match=f"embedding: input 'ids' has value {bad} at flat "
                                         "position 1, outside \\[0, 4\\)"):
        mg.Executor().run([mg.Operator("embedding", ids=vi, w=vw, out=out)], scope)


def test_ids_must_be_int64_and_padding_a_row():
    scope = mg.Scope()
    ids, w = scope.new_var("ids"), scope.new_var("w")
    ids.declare((3,), np.dtype("int32"))
    w.declare((4, 2), np.dtype("float32"))
    with pytest.raises(mg.OpError, match="embedding: input 'ids' must have dtype int64"):
        mg.Operator("embedding", ids=ids, w=w, out=scope.new_var("out"))
    ids.declare((3,), np.dtype("int64"))
    with pytest.raises(mg.OpError, match="embedding: attribute 'padding_idx' must be -1 "
                                         "\\(none\\) or a row of the 4-row table"):
        mg.Operator("embedding", ids=ids, w=w, out=scope.new_var("out2"), padding_idx=4)


def test_layer_initialises_as_torch_and_keeps_the_padding_row_zero():
    net = mg.Net(seed=1)
    ids = L.data(net, "ids", (-1, 5), "int64")
    target = L.data(net, "t", (-1, 5, 8))
    e = L.embedding(net, ids, 50, 8, padding_idx=-1, name="emb")
    assert e.shape == (-1, 5, 8)
    table = net.var("emb.w").get().copy()
    np.testing.assert_array_equal(table[49], 0)
    assert abs(table[:49].std() - 1.0) < 0.15 and abs(table[:49].mean()) < 0.15
    loss = L.mse_loss(net, e, target)
    mg.optimizer.SGD(0.5).minimize(net, loss)
    feed = {"ids": np.array([[49, 1, 2, 49, 3]] * 4, np.int64),
            "t": rng.standard_normal((4, 5, 8)).astype(np.float32)}
    for _ in range(3):
        net.train(feed=feed, fetch=[loss])
    after = net.var("emb.w").get()
    np.testing.assert_array_equal(after[49], 0)
    assert not np.array_equal(after[1], table[1])
    np.testing.assert_array_equal(after[10], table[10])       # never looked up
    net.initialize(force=True)
    np.testing.assert_array_equal(net.var("emb.w").get()[49], 0)


@pytest.mark.parametrize("kwargs, message", [
    ({"num_embeddings": 0, "embedding_dim": 4}, "embedding: argument 'num_embeddings' must be "
                                                "an int >= 1"),
    ({"num_embeddings": 5, "embedding_dim": 4, "padding_idx": 5},
     "embedding: argument 'padding_idx' must be None or an int in \\[-5, 5\\)"),
])
def test_layer_arguments_are_checked(kwargs, message):
    net = mg.Net(seed=0)
    ids = L.data(net, "ids", (-1,), "int64")
    with pytest.raises(ValueError, match=message):
        L.embedding(net, ids, **kwargs)


def test_layer_refuses_float_ids():
    net = mg.Net(seed=0)
    ids = L.data(net, "ids", (-1,))
    with pytest.raises(TypeError, match="embedding: argument 'ids' must be int64 row indices"):
        L.embedding(net, ids, 5, 2)
