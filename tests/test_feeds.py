"""Feeds and fetches as callers give them (minigraph/feeds.py): read in place, never
written or kept, and clear errors for what is not a feed or a fetch list."""
from __future__ import annotations

import numpy as np
import pytest

import minigraph as mg
from minigraph import feeds
from minigraph import layers as L


def small_net():
    net = mg.Net(seed=0)
    x = L.data(net, "x", shape=(-1, 4))
    lbl = L.data(net, "label", shape=(-1,), dtype="int64")
    logits = L.fc(net, x, 3, name="fc")
    loss = L.mean(net, L.softmax_with_cross_entropy(net, logits, lbl))
    mg.optimizer.SGD(0.1).minimize(net, loss)
    return net, logits, loss


def test_feeds_are_read_in_place_and_never_written_or_kept(tmp_path):
    """A C-contiguous feed is read through a read-only view (no copy), any other
    through a read-only copy: no kernel can write the caller's array (or the file
    under a memmap, or a masked array's data), and the net lets go of it when the run
    ends. Masked arrays and memmaps come in as plain arrays."""
    net, logits, loss = small_net()
    rng = np.random.default_rng(0)
    data = rng.standard_normal((6, 4)).astype(np.float32)
    mm = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32,
                                   shape=(6, 4))
    mm[...] = data
    masked = np.ma.masked_array(data.copy(), mask=np.zeros_like(data, dtype=bool))
    strided = np.repeat(data, 2, axis=1)[:, ::2]
    labels = rng.integers(0, 3, 6)
    for given in (data, mm, masked, strided):
        feeds.store_feeds(net.place, net.data_vars, (), {"x": given}, "train")
        stored = net.var("x").value
        assert type(stored) is np.ndarray and not stored.flags.writeable
        assert stored.flags.c_contiguous
        assert np.shares_memory(stored, np.asarray(given)) == (given is not strided)
        np.testing.assert_array_equal(stored, data)
        with pytest.raises(ValueError, match="read-only"):
            stored[...] = 0
        (got,) = net.train(feed={"x": given, "label": labels}, fetch=["x"])
        assert got.flags.writeable and not np.shares_memory(got, np.asarray(given))
        assert net.var("x").value is None and net.var("label").value is None
        np.testing.assert_array_equal(np.asarray(given), data)
    np.testing.assert_array_equal(np.load(tmp_path / "x.npy"), data)


def test_a_run_that_fails_lets_go_of_the_feeds_it_stored():
    """'x' is stored before 'label' fails its check: neither is kept."""
    net, logits, loss = small_net()
    x = np.zeros((6, 4), np.float32)
    with pytest.raises(ValueError, match="feed 'label': expected shape"):
        net.train(feed={"x": x, "label": np.zeros((6, 2), np.int64)})
    assert net.var("x").value is None and net.var("label").value is None


@pytest.mark.parametrize("fetch", ["fc.w", b"fc.w"])
def test_a_fetch_that_is_not_a_list_is_an_error(fetch):
    """fetch="name" used to be iterated per character."""
    net, logits, loss = small_net()
    feed = {"x": np.zeros((2, 4), np.float32), "label": np.zeros(2, np.int64)}
    for call in (net.train, net.infer):
        with pytest.raises(TypeError, match=r"fetch must be a list .* \(fetch=\['fc.w'\]\)"
                           if isinstance(fetch, str) else "fetch must be a list"):
            call(feed=feed, fetch=fetch)
    with pytest.raises(TypeError, match="fetch must be a list"):
        net.infer(feed=feed, fetch=logits)
    with pytest.raises(TypeError, match="fetch must be a list"):
        mg.Executor().run(net.ops("infer"), net.scopes["infer"], feed={"x": feed["x"]},
                          fetch="fc.w")


def test_a_feed_that_is_not_a_dict_is_an_error():
    net, logits, loss = small_net()
    with pytest.raises(TypeError, match="feed must be a dict"):
        net.infer(feed=[np.zeros((2, 4), np.float32)], fetch=[logits])


@pytest.mark.parametrize("feed, got", [
    (np.zeros((2, 4), np.float32), r"an array \(float32, shape \(2, 4\)\)"),
    (np.zeros((0,)), r"an array \(float64, shape \(0,\)\)"),
    (0, "int 0"), ([], r"list \[\]"), ((), r"tuple \(\)"), ("x", "str 'x'"),
])
def test_every_non_mapping_feed_is_a_type_error_saying_what_a_feed_is(feed, got):
    """An array used to fail on its truth value (a ValueError about any() / all()), and
    0, [] and () were taken for no feed at all."""
    net, logits, loss = small_net()
    for call, who in ((net.train, "train"), (net.infer, "infer")):
        with pytest.raises(TypeError, match=rf"^{who}: feed must be a dict \{{data name or "
                                            rf"data Variable: array\}}, e.g. feed=.*; got {got}$"):
            call(feed=feed, fetch=[loss if who == "train" else logits])
    with pytest.raises(TypeError, match=f"^Executor.run: feed must be a dict .*; got {got}$"):
        mg.Executor().run(net.ops("infer"), net.scopes["infer"], feed=feed, fetch=[logits])
    with pytest.raises(TypeError, match=f"^profile: feed must be a dict .*; got {got}$"):
        net.profile(feed, steps=1, mode="infer", fetch=[logits])
    x = np.zeros((2, 4), np.float32)
    assert net.infer(feed={"x": x}, fetch=[logits])[0].shape == (2, 3)     # a dict works


@pytest.mark.parametrize("shape", [(-1, 2.7), (-1, "4"), (-1, None), (True, 4), 4])
def test_a_data_shape_must_hold_ints(shape):
    """(-1, 2.7) silently became (-1, 2)."""
    net = mg.Net()
    with pytest.raises(TypeError, match="data 'x': shape must be"):
        L.data(net, "x", shape=shape)
    assert "x" not in net.data_vars


@pytest.mark.parametrize("dtype", [object, str, "U5", "S3", "V8", "M8[s]"])
def test_a_data_dtype_must_be_numeric(dtype):
    net = mg.Net()
    with pytest.raises(TypeError, match="data 'x': dtype must be"):
        L.data(net, "x", shape=(-1, 4), dtype=dtype)
    assert "x" not in net.data_vars
    L.data(net, "x", shape=(-1, 4), dtype="float64")       # and the name is still free


@pytest.mark.parametrize("place", ["cpu", 0, object()])
def test_a_net_needs_a_place_object(place):
    with pytest.raises(TypeError, match="Net: place must be"):
        mg.Net(place=place)
    with pytest.raises(TypeError, match="Executor: place must be"):
        mg.Executor(place)
