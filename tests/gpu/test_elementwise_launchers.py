"""Launchers of the layer ops' kernels against numpy, on the emulator and (marked
gpu) a real GPU: broadcasting add/multiply and their reductions, copies,
concat, transpose, dropout (Philox masks bit for bit), softmax along any axis,
argmax and accuracy (labels flagged on the device)."""
from __future__ import annotations

import numpy as np
import pytest
import test_bn_launchers as test_kernels
from test_bn_launchers import TOL, rel_err, rng

from minigraph.kernels import broadcast, shape_ops, strided
from minigraph.ops.philox import philox_words, uniforms24

dev = test_kernels.dev            # the fixture: the emulator, or a GPU (marked gpu)
force_splits = test_kernels.force_splits

BROADCASTS = [((4, 3, 5), (3, 1)), ((2, 1, 4), (3, 1)), ((7,), (7,)), ((6, 5), (5,)),
              ((5, 1, 3, 1, 2), (4, 3, 6, 2)), ((3,), ()), ((2, 3), (1, 1)), ((1, 9), (4, 1)),
              ((2, 3, 4), (2, 1, 4)), ((8, 1), (8, 33)), ((1, 1, 37), (2, 3, 37))]


def reduce_ref(a, shape):
    """numpy: a (float64) summed down to `shape`."""
    a = a.sum(axis=tuple(range(a.ndim - len(shape))))
    return a.sum(axis=tuple(i for i, n in enumerate(shape) if n == 1), keepdims=True)


# ---- strided shapes (pure Python) --------------------------------------------------------


def test_collapse_merges_what_every_operand_steps_across():
    shape = (4, 3, 5)
    dims, (xs, ys) = strided.collapse(shape, strided.broadcast_strides(shape, shape),
                                      strided.broadcast_strides(shape, (3, 1)))
    assert dims == (4, 3, 5) and xs == (15, 5, 1) and ys == (0, 1, 0)
    dims, (xs, ys) = strided.collapse((2, 3, 4, 5), (60, 20, 5, 1), (0, 0, 5, 1))
    assert dims == (6, 20) and xs == (20, 1) and ys == (0, 1)
    assert strided.collapse((1, 1), (1, 1))[0] == ()
    assert strided.channel_view_of((6, 20), (0, 1)) == (6, 20, 1)
    assert strided.channel_view_of((2, 3, 4), (1, 0, 1)) is None
    assert strided.broadcast_shape("add", (2, 1, 4), (3, 1)) == (2, 3, 4)
    with pytest.raises(ValueError, match=r"add: shapes \(2, 3\) and \(4,\) do not broadcast"):
        strided.broadcast_shape("add", (2, 3), (4,))
    with pytest.raises(ValueError, match="7 dims after merging contiguous ones"):
        strided.padded("transpose", (2,) * 7, (1,) * 7)


# ---- add, multiply and their gradients ---------------------------------------------------


@pytest.mark.parametrize("x_shape,y_shape", BROADCASTS, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_broadcast_add_multiply_and_grads(dev, force_splits, x_shape, y_shape, dtype):
    r = rng(3)
    x, y = r.normal(size=x_shape).astype(dtype), r.normal(size=y_shape).astype(dtype)
    dx_, dy_ = dev.put(x), dev.put(y)
    np.testing.assert_array_equal(dev.get(broadcast.add(dx_, dy_)), x + y)
    np.testing.assert_array_equal(dev.get(broadcast.add(dy_, dx_)), y + x)
    np.testing.assert_array_equal(dev.get(broadcast.multiply(dx_, dy_)), x * y)
    d = r.normal(size=np.broadcast_shapes(x_shape, y_shape)).astype(dtype)
    gx, gy = broadcast.add_grad(x_shape, y_shape, dev.put(d))
    assert rel_err(dev.get(gx), reduce_ref(d.astype(np.float64), x_shape)) < TOL[dtype]
    assert rel_err(dev.get(gy), reduce_ref(d.astype(np.float64), y_shape)) < TOL[dtype]
    mx, my = broadcast.multiply_grad(dx_, dy_, dev.put(d))
    assert dev.get(mx).shape == x_shape and dev.get(my).shape == y_shape
    assert rel_err(dev.get(mx), reduce_ref((d * y).astype(np.float64), x_shape)) < TOL[dtype]
    assert rel_err(dev.get(my), reduce_ref((d * x).astype(np.float64), y_shape)) < TOL[dtype]
    only_dy = broadcast.multiply_grad(dx_, dy_, dev.put(d), need_dx=False)
    assert only_dy[0] is None and only_dy[1] is not None


@pytest.mark.parametrize("d_shape,shape", [((5, 7, 3), (5, 1, 3)), ((4, 6), (1, 1)),
                                           ((3, 4, 5, 6), (3, 1, 5, 1)), ((2, 3), (2, 3)),
                                           ((9, 300), (9, 1)), ((300, 9), (9,)),
                                           ((0, 4), (1, 4)), ((3, 1), (1, 1))], ids=str)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
def test_reduce_to_any_pattern(dev, force_splits, d_shape, shape, offset):
    d = rng(4).normal(size=d_shape)
    got = dev.get(broadcast.reduce_to(dev.put(d, offset), shape))
    assert got.shape == shape
    assert rel_err(got, reduce_ref(d, shape)) < 1e-12


def test_float32_sums_are_accumulated_in_double(dev):
    d = np.full((3, 100001), 0.1, np.float32)
    d[:, 0] = 1e6
    got = dev.get(broadcast.reduce_to(dev.put(d), (3, 1)))
    np.testing.assert_allclose(got, d.astype(np.float64).sum(axis=1, keepdims=True), rtol=1e-7)
    got = dev.get(broadcast.reduce_to(dev.put(d.reshape(3, 1, 100001)), (3, 1, 1)))
    assert got.shape == (3, 1, 1)


def test_broadcast_errors(dev):
    x32 = dev.put(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"add: shapes \(2, 3\) and \(2,\) do not broadcast"):
        broadcast.add(x32, dev.put(np.ones(2, np.float32)))
    with pytest.raises(ValueError, match="multiply: x and y must have one dtype"):
        broadcast.multiply(x32, dev.put(np.ones(3, np.float64)))
    with pytest.raises(ValueError, match=r"shape \(4,\) does not broadcast to \(2, 3\)"):
        broadcast.reduce_to(x32, (4,))


# ---- copies, concat, transpose -----------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.uint8, np.float16,
                                   np.int32, np.bool_])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
def test_copy_and_reshape_any_dtype(dev, dtype, offset):
    x = (rng(5).normal(size=(5, 7)) * 100).astype(dtype)
    np.testing.assert_array_equal(dev.get(shape_ops.copy(dev.put(x, offset))), x)
    np.testing.assert_array_equal(dev.get(shape_ops.reshape(dev.put(x, offset), (7, 5))),
                                  x.reshape(7, 5))
    with pytest.raises(ValueError, match=r"reshape: cannot reshape \(5, 7\) \(35 values\)"):
        shape_ops.reshape(dev.put(x), (6, 6))


@pytest.mark.parametrize("shapes,axis", [([(2, 3, 4), (2, 5, 4)], 1), ([(3, 4), (3, 4), (3, 8)], -1),
                                         ([(1, 4), (6, 4), (2, 4)], 0), ([(7,)], 0),
                                         ([(2, 0, 3), (2, 2, 3)], 1), ([(2, 2, 5), (2, 3, 5)], -2)],
                         ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_concat_and_its_slices(dev, shapes, axis, dtype):
    xs = [(rng(i).normal(size=s) * 10).astype(dtype) for i, s in enumerate(shapes)]
    want = np.concatenate(xs, axis)
    out = shape_ops.concat([dev.put(x) for x in xs], axis)
    np.testing.assert_array_equal(dev.get(out), want)
    for i, x in enumerate(xs):
        np.testing.assert_array_equal(dev.get(shape_ops.concat_slice(out, shapes, axis, i)), x)


def test_concat_packs_and_offsets(dev):
    xs = [rng(i).normal(size=(3, 8)).astype(np.float32) for i in range(3)]
    for offset in (0, 1, 2):
        out = shape_ops.concat([dev.put(x, offset) for x in xs], 1)
        np.testing.assert_array_equal(dev.get(out), np.concatenate(xs, 1))
    with pytest.raises(ValueError, match=r"concat: input 1 has shape \(3, 7\), input 0 has "
                                         r"\(3, 8\); they must agree on every dim but axis 0"):
        shape_ops.concat([dev.put(xs[0]), dev.put(np.ones((3, 7), np.float32))], 0)
    with pytest.raises(ValueError, match="axis 2 is out of range for rank 2"):
        shape_ops.concat([dev.put(xs[0])], 2)


@pytest.mark.parametrize("shape,perm", [((3, 4), (1, 0)), ((2, 3, 4), (2, 0, 1)),
                                        ((2, 3, 4, 5), (0, 2, 1, 3)), ((5, 1, 7), (2, 1, 0)),
                                        ((2, 3, 4), (0, 1, 2)), ((2, 2, 2, 2, 2, 2), (5, 3, 1, 4, 2, 0))],
                         ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64, np.uint8])
def test_transpose_and_back(dev, shape, perm, dtype):
    x = (rng(6).normal(size=shape) * 50).astype(dtype)
    out = shape_ops.transpose(dev.put(x), perm)
    np.testing.assert_array_equal(dev.get(out), x.transpose(perm))
    back = shape_ops.transpose(out, tuple(np.argsort(perm)))
    np.testing.assert_array_equal(dev.get(back), x)


def test_transpose_checks_the_permutation(dev):
    with pytest.raises(ValueError, match=r"perm \(0, 0\) is not a permutation"):
        shape_ops.transpose(dev.put(np.ones((2, 3))), (0, 0))


# ---- dropout -------------------------------------------------------------------------------


def dropout_ref(x, p, seed, step):
    keep = uniforms24(philox_words(x.size, 2, seed + (step << 32))) >= p
    keep = keep.reshape(x.shape)
    factor = x.dtype.type(1.0 / (1.0 - p))
    return x * (keep.astype(x.dtype) * factor), keep.astype(np.uint8)


@pytest.mark.parametrize("shape", [(1,), (7,), (4, 9), (3, 5, 17), (2, 64)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "offset"])
def test_dropout_masks_are_the_cpus_bit_for_bit(dev, shape, dtype, offset):
    from minigraph.kernels import dropout

    x = rng(7).normal(size=shape).astype(dtype)
    step = dev.put(np.array(5, np.int64))
    for k, (p, seed) in enumerate([(0.5, 123), (0.1, 2**32 - 1), (0.9, 0), (0.0, 7)]):
        out, mask = dropout.dropout(dev.put(x, offset), step, p, seed)
        want, want_mask = dropout_ref(x, p, seed, 5 + k)
        np.testing.assert_array_equal(dev.get(mask), want_mask)
        np.testing.assert_array_equal(dev.get(out), want)
        assert int(dev.get(step)) == 6 + k
    d = rng(8).normal(size=shape).astype(dtype)
    dx = dropout.dropout_grad(mask, dev.put(d, offset), 0.0)
    np.testing.assert_array_equal(dev.get(dx), d)
    _, mask = dropout.dropout(dev.put(x), step, 0.3, 9)
    dx = dropout.dropout_grad(mask, dev.put(d), 0.3)
    np.testing.assert_array_equal(dev.get(dx), d * (dev.get(mask).astype(dtype)
                                                    * dtype(1.0 / 0.7)))


def test_dropout_keeps_about_1_minus_p_and_steps_change_masks(dev):
    from minigraph.kernels import dropout

    x = np.ones(40001, np.float32)
    step = dev.put(np.array(0, np.int64))
    first = dev.get(dropout.dropout(dev.put(x), step, 0.25, 1)[1])
    second = dev.get(dropout.dropout(dev.put(x), step, 0.25, 1)[1])
    assert abs(first.mean() - 0.75) < 0.01 and not np.array_equal(first, second)
    out, mask = dropout.dropout(dev.put(x), step, 0.25, 1, want_mask=False)
    assert mask is None and int(dev.get(step)) == 3
    out, _ = dropout.dropout(dev.put(np.ones(0, np.float32)), step, 0.5, 1)
    assert int(dev.get(step)) == 4                     # counts every training call
    with pytest.raises(ValueError, match=r"p must be in \[0, 1\), got 1.0"):
        dropout.dropout(dev.put(x), step, 1.0, 1)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*32\)"):
        dropout.dropout(dev.put(x), step, 0.5, 2**32)


# ---- softmax, argmax, accuracy ---------------------------------------------------------------


def softmax_ref(x, axis):
    z = x.astype(np.float64)
    e = np.exp(z - z.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


@pytest.mark.parametrize("shape,axis", [((5, 10), -1), ((3, 1000), 1), ((4, 7, 5), 1),
                                        ((2, 3, 4, 5), 0), ((6,), 0), ((3, 1), -1), ((1, 6, 2), -2)],
                         ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_and_grad_along_any_axis(dev, shape, axis, dtype):
    from minigraph.kernels import softmax

    x = (rng(9).normal(size=shape) * 20).astype(dtype)
    out = softmax.softmax(dev.put(x), axis)
    want = softmax_ref(x, axis)
    assert rel_err(dev.get(out), want) < TOL[dtype]
    d = rng(10).normal(size=shape).astype(dtype)
    o = dev.get(out).astype(np.float64)
    want_dx = o * (d - (d * o).sum(axis=axis, keepdims=True))
    assert rel_err(dev.get(softmax.softmax_grad(out, dev.put(d), axis)), want_dx) < TOL[dtype]


def test_softmax_nan_and_extremes(dev):
    from minigraph.kernels import softmax

    x = np.array([[1.0, np.nan, 2.0], [1000.0, -1000.0, 1000.0]], np.float32)
    for axis in (1, 0):
        got = dev.get(softmax.softmax(dev.put(x), axis))
        with np.errstate(invalid="ignore"):
            np.testing.assert_allclose(got, softmax_ref(x, axis), rtol=1e-6)


@pytest.mark.parametrize("shape,axis", [((5, 10), -1), ((3, 700), 1), ((4, 7, 5), 1),
                                        ((2, 3, 4), 0), ((6,), 0), ((3, 1), 1)], ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_argmax_takes_the_first_maximum(dev, shape, axis, dtype):
    from minigraph.kernels import argmax

    x = rng(11).integers(0, 4, size=shape).astype(dtype)      # many ties
    got = dev.get(argmax.argmax(dev.put(x), axis))
    np.testing.assert_array_equal(got, np.argmax(x, axis))
    assert got.dtype == np.int64
    x = rng(12).normal(size=shape).astype(dtype)
    x.flat[::5] = np.nan
    np.testing.assert_array_equal(dev.get(argmax.argmax(dev.put(x), axis)), np.argmax(x, axis))


@pytest.mark.parametrize("rows,classes", [(7, 3), (50, 10), (1, 1), (3, 500)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_accuracy(dev, rows, classes, dtype):
    from minigraph.kernels import argmax

    logits = rng(13).integers(0, 3, size=(rows, classes)).astype(dtype)
    label = rng(14).integers(0, classes, rows).astype(np.int64)
    status = argmax.LabelStatus()
    got = dev.get(argmax.accuracy(dev.put(logits), dev.put(label), status))
    assert got.dtype == np.float32 and got.shape == ()
    assert got == np.float32((np.argmax(logits, 1) == label).mean())
    status.check()


def test_accuracy_flags_bad_labels_and_empty_batches(dev):
    from minigraph.kernels import argmax

    status = argmax.LabelStatus()
    logits = np.eye(4, dtype=np.float32)
    got = dev.get(argmax.accuracy(dev.put(logits), dev.put(np.array([0, 1, 7, -1])), status))
    assert got == np.float32(0.5)
    with pytest.raises(ValueError, match=r"accuracy: input 'label' had 2 value\(s\) outside "
                                         r"\[0, K\), e.g. at row [23]"):
        status.check()
    status.check()                                   # reported once
    empty = argmax.accuracy(dev.put(np.zeros((0, 4), np.float32)),
                            dev.put(np.zeros(0, np.int64)), status)
    assert np.isnan(dev.get(empty))
