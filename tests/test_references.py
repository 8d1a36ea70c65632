"""tests/references.py, the float64 references every suite compares with, checked
on their own: Philox against Random123's known answers, conv2d against direct
per-pixel dot products, every gradient as its forward's adjoint (or against central
differences), the batch-norm estimate rules, softmax's extremes."""
import numpy as np
import pytest
import references as ref

rng = np.random.default_rng(11)


def test_philox_known_answers():
    assert ref.philox4x32([0, 0, 0, 0], [0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C,
                                                    0x9B00DBD8]
    assert ref.philox4x32([0xFFFFFFFF] * 4, [0xFFFFFFFF] * 2) == [0x408F276D, 0x41C83B0E,
                                                                  0xA20BC7C6, 0x6D5451FD]
    assert ref.philox4x32([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
                          [0xA4093822, 0x299F31D0]) == [0xD16CFE09, 0x94FDCCEB, 0x5001E420,
                                                        0x24126EA1]


def test_dropout_keep_reads_philox_words_in_order():
    words = ref.philox4x32([0, 0, 2, 0], [7, 3]) + ref.philox4x32([1, 0, 2, 0], [7, 3])
    want = [(w >> 8) / 2.0**24 >= 0.3 for w in words[:6]]
    assert ref.dropout_keep(6, 0.3, 7, 3).tolist() == want
    assert ref.dropout_keep(0, 0.5, 1, 1).shape == (0,)


def test_unbroadcast():
    g = np.arange(24.0).reshape(2, 3, 4)
    assert np.array_equal(ref.unbroadcast(g, (3, 1)), g.sum(axis=(0, 2))[:, None])
    assert np.array_equal(ref.unbroadcast(g, (2, 3, 4)), g)
    assert ref.unbroadcast(g, ()) == g.sum()


def direct_conv(x, w, strides, paddings, dilations, groups):
    """conv2d by one dot product per output (n, o, h, w)."""
    (sh, sw), (ph, pw), (dh, dw) = (ref.pair(v) for v in (strides, paddings, dilations))
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    xp = np.zeros((n, c, h + 2 * ph, wd + 2 * pw))
    xp[:, :, ph:ph + h, pw:pw + wd] = x
    ho = ref.conv2d_out_size(h, kh, sh, ph, dh)
    wo = ref.conv2d_out_size(wd, kw, sw, pw, dw)
    out = np.zeros((n, o, ho, wo))
    per_group = o // groups
    for oc in range(o):
        g = oc // per_group
        for i in range(ho):
            for j in range(wo):
                patch = xp[:, g * cg:(g + 1) * cg, i * sh:i * sh + dh * (kh - 1) + 1:dh,
                           j * sw:j * sw + dw * (kw - 1) + 1:dw]
                out[:, oc, i, j] = (patch * w[oc]).sum(axis=(1, 2, 3))
    return out


CONVS = [((2, 3, 5, 5), (4, 3, 3, 3), 1, 0, 1, 1),
         ((1, 2, 7, 7), (3, 2, 3, 3), 1, (2, 1), 2, 1),
         ((2, 4, 5, 6), (6, 2, 3, 3), 1, 1, 1, 2),
         ((2, 2, 5, 7), (3, 2, 2, 3), (1, 2), (1, 0), (2, 1), 1),
         ((3, 4, 9, 8), (6, 2, 3, 2), (2, 1), (0, 1), (1, 2), 2)]


@pytest.mark.parametrize("x_shape,w_shape,strides,paddings,dilations,groups", CONVS)
def test_conv2d_is_the_direct_sum_and_its_grad_the_adjoint(x_shape, w_shape, strides, paddings,
                                                           dilations, groups):
    x, w = rng.standard_normal(x_shape), rng.standard_normal(w_shape)
    args = (strides, paddings, dilations, groups)
    out = ref.conv2d(x, w, *args)
    np.testing.assert_allclose(out, direct_conv(x, w, *args), rtol=1e-12, atol=1e-12)
    d = rng.standard_normal(out.shape)
    dx, dw = ref.conv2d_grad(x, w, d, *args)
    assert dx.shape == x.shape and dw.shape == w.shape
    np.testing.assert_allclose(np.vdot(out, d), np.vdot(x, dx), rtol=1e-12)
    np.testing.assert_allclose(np.vdot(out, d), np.vdot(w, dw), rtol=1e-12)


def direct_conv_nhwc(x, w, strides, paddings, dilations, groups):
    """conv2d of channels-last x (N, H, W, C) by one dot product per output (n, h, w, o),
    the window's channels last against the filter (O, C/G, kh, kw) moved to (kh, kw,
    C/G): no transpose of x or of the result."""
    (sh, sw), (ph, pw), (dh, dw) = (ref.pair(v) for v in (strides, paddings, dilations))
    n, h, wd, c = x.shape
    o, cg, kh, kw = w.shape
    xp = np.zeros((n, h + 2 * ph, wd + 2 * pw, c))
    xp[:, ph:ph + h, pw:pw + wd] = x
    ho = ref.conv2d_out_size(h, kh, sh, ph, dh)
    wo = ref.conv2d_out_size(wd, kw, sw, pw, dw)
    out = np.zeros((n, ho, wo, o))
    per_group = o // groups
    for oc in range(o):
        g = oc // per_group
        taps = w[oc].transpose(1, 2, 0)                          # (kh, kw, C/G)
        for i in range(ho):
            for j in range(wo):
                patch = xp[:, i * sh:i * sh + dh * (kh - 1) + 1:dh,
                           j * sw:j * sw + dw * (kw - 1) + 1:dw, g * cg:(g + 1) * cg]
                out[:, i, j, oc] = (patch * taps).sum(axis=(1, 2, 3))
    return out


@pytest.mark.parametrize("x_shape,w_shape,strides,paddings,dilations,groups", CONVS)
def test_conv2d_nhwc_is_the_direct_sum_and_its_grad_the_adjoint(x_shape, w_shape, strides,
                                                                paddings, dilations, groups):
    n, c, h, wd = x_shape
    x, w = rng.standard_normal((n, h, wd, c)), rng.standard_normal(w_shape)
    args = (strides, paddings, dilations, groups)
    out = ref.conv2d(x, w, *args, data_layout="NHWC")
    np.testing.assert_allclose(out, direct_conv_nhwc(x, w, *args), rtol=1e-12, atol=1e-12)
    d = rng.standard_normal(out.shape)
    dx, dw = ref.conv2d_grad(x, w, d, *args, data_layout="NHWC")
    assert dx.shape == x.shape and dw.shape == w.shape
    np.testing.assert_allclose(np.vdot(out, d), np.vdot(x, dx), rtol=1e-12)
    np.testing.assert_allclose(np.vdot(out, d), np.vdot(w, dw), rtol=1e-12)


def test_pool2d_nhwc_pools_each_channel_over_its_pixels():
    x = rng.standard_normal((2, 5, 6, 3))
    out = ref.pool2d(x, "max", 3, 2, 1, data_layout="NHWC")
    assert out.shape == (2, 3, 3, 3)
    np.testing.assert_array_equal(out[1, 1, 2], x[1, 1:4, 3:6].max(axis=(0, 1)))
    avg = ref.pool2d(x, "avg", 2, data_layout="NHWC")
    np.testing.assert_allclose(avg[0, 1, 2], x[0, 2:4, 4:6].mean(axis=(0, 1)), rtol=1e-12)
    d = rng.standard_normal(out.shape)
    dx = ref.pool2d_grad(x, d, "max", 3, 2, 1, data_layout="NHWC")
    np.testing.assert_allclose(np.vdot(out, d), np.vdot(x, dx), rtol=1e-12)


@pytest.mark.parametrize("pool_type", ["max", "avg"])
@pytest.mark.parametrize("attrs", [dict(ksize=2), dict(ksize=3, strides=2, paddings=1),
                                   dict(ksize=(3, 2), strides=(1, 2), paddings=(1, 0)),
                                   dict(global_pooling=True)])
def test_pool2d_grad_is_the_adjoint(pool_type, attrs):
    """Avg pooling is linear; max pooling copies each window's first maximum, so for
    both <pool2d(x), d> = <x, pool2d_grad(x, d)>."""
    x = rng.permutation(2 * 3 * 5 * 6).reshape(2, 3, 5, 6) / 10.0
    out = ref.pool2d(x, pool_type, **attrs)
    d = rng.standard_normal(out.shape)
    dx = ref.pool2d_grad(x, d, pool_type, **attrs)
    np.testing.assert_allclose(np.vdot(out, d), np.vdot(x, dx), rtol=1e-12)


def test_pool2d_windows_are_clipped_and_ties_go_to_the_first():
    x = np.arange(9.0).reshape(1, 1, 3, 3)
    np.testing.assert_array_equal(ref.pool2d(x, "avg", 2, 2, 1)[0, 0], [[0, 1.5], [4.5, 6]])
    ties = np.ones((1, 1, 2, 2))
    np.testing.assert_array_equal(ref.pool2d_grad(ties, np.full((1, 1, 1, 1), 5.0))[0, 0],
                                  [[5, 0], [0, 0]])


@pytest.mark.parametrize("layout,shape", [("NCHW", (3, 2, 2, 2)), ("NHWC", (4, 3, 2)),
                                          ("NCHW", (5, 3))])
@pytest.mark.parametrize("use_global_est", [False, True])
def test_batch_norm_grad_matches_central_differences(layout, shape, use_global_est):
    c = shape[1] if layout == "NCHW" else shape[-1]
    x, dy = rng.standard_normal(shape) * 2 + 1, rng.standard_normal(shape)
    scale, bias = rng.uniform(0.5, 1.5, c), rng.standard_normal(c)
    est = (rng.standard_normal(c), rng.uniform(0.5, 2.0, c))

    def loss(x, scale, bias):
        y = ref.batch_norm(x, *est, scale, bias, layout=layout,
                           use_global_est=use_global_est, epsilon=1e-3)["y"]
        return np.vdot(y, dy)

    stats = est if use_global_est else ref.batch_stats(x, layout)[:2]
    got = ref.batch_norm_grad(x, dy, scale, *stats, 1e-3, layout, use_global_est)
    args = [x, scale, bias]
    for k, want_shape in enumerate((x.shape, (c,), (c,))):
        num = np.zeros(want_shape)
        for i in np.ndindex(want_shape):
            hi, lo = [a.copy() for a in args], [a.copy() for a in args]
            hi[k][i] += 1e-6
            lo[k][i] -= 1e-6
            num[i] = (loss(*hi) - loss(*lo)) / 2e-6
        np.testing.assert_allclose(got[k], num, rtol=1e-6, atol=1e-7)


def test_batch_norm_estimate_rules():
    mean, var, n = np.array([1.0]), np.array([2.0]), 5
    first = ref.bn_estimates([9.0], [9.0], mean, var, n, 0, 0.9)
    np.testing.assert_allclose(first, ([1.0], [2.5]))                   # unbiased: 2 * 5 / 4
    later = ref.bn_estimates([9.0], [9.0], mean, var, n, 3, 0.9)
    np.testing.assert_allclose(later, ([0.9 * 9 + 0.1], [0.9 * 9 + 0.1 * 2.5]))
    average = ref.bn_estimates([9.0], [9.0], mean, var, n, 3, None)      # the 4th batch
    np.testing.assert_allclose(average, ([9 + (1 - 9) / 4], [9 + (2.5 - 9) / 4]))
    no_counter = ref.bn_estimates([9.0], [9.0], mean, var, n, None, 0.5)
    np.testing.assert_allclose(no_counter, ([5.0], [5.75]))
    with pytest.raises(ValueError, match="momentum None needs a counter"):
        ref.bn_estimates([9.0], [9.0], mean, var, n, None, None)
    out = ref.batch_norm(np.array([[1.0], [3.0]]), [0.0], [1.0], [2.0], [0.5], counter=0,
                         epsilon=0.0)
    np.testing.assert_allclose(out["y"], [[-1.5], [2.5]])
    assert out["num_batches"] == 1 and out["estimated_var"] == 2.0


def test_softmax_extremes():
    x = np.array([[1e308, 1e308, -1e308], [1000.0, 0.0, -1000.0]])
    np.testing.assert_array_equal(ref.softmax(x, 1)[0], [0.5, 0.5, 0.0])
    np.testing.assert_allclose(ref.softmax(x, 1).sum(axis=1), 1.0)
    np.testing.assert_allclose(ref.softmax(np.zeros((2, 4)), 0), np.full((2, 4), 0.5))
