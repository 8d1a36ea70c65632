"""kernels/conv2d.py against the float64 references, on the emulator and (marked gpu)
a real GPU: strides, paddings, dilations, groups, non-square filters, the forward
and both gradients; a batch processed in several column chunks."""
from __future__ import annotations

import numpy as np
import pytest
from launcher_harness import rel_err, rng
from references import conv2d as conv2d_ref
from references import conv2d_grad as conv2d_grad_ref

from minigraph.kernels.cuda import launch


@pytest.mark.parametrize("x_shape,w_shape,stride,pad,dil,groups", [
    ((2, 3, 7, 6), (4, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1),
    ((3, 4, 9, 8), (6, 2, 3, 2), (2, 1), (0, 1), (1, 2), 2),
    ((1, 2, 5, 5), (2, 1, 1, 1), (2, 2), (0, 0), (1, 1), 2),
    ((2, 1, 6, 7), (3, 1, 5, 5), (1, 2), (2, 2), (1, 1), 1)])
def test_conv2d_and_grad(device, x_shape, w_shape, stride, pad, dil, groups):
    from minigraph.kernels.cuda import conv2d

    r = rng(10)
    x, w = r.normal(size=x_shape), r.normal(size=w_shape)
    want = conv2d_ref(x, w, stride, pad, dil, groups)
    out = conv2d.conv2d(device.put(x), device.put(w), stride, pad, dil, groups)
    assert rel_err(device.get(out), want) < 1e-12
    d = r.normal(size=want.shape)
    dx, dw = conv2d.conv2d_grad(device.put(x), device.put(w), device.put(d), stride, pad, dil,
                                groups)
    want_dx, want_dw = conv2d_grad_ref(x, w, d, stride, pad, dil, groups)
    assert rel_err(device.get(dx), want_dx) < 1e-12
    assert rel_err(device.get(dw), want_dw) < 1e-12


def test_conv2d_in_several_chunks(device, monkeypatch):
    from minigraph.kernels.cuda import conv2d

    monkeypatch.setattr(launch, "COLS_BUDGET", 3 * 4 * 9 * 36 * 4)     # 3 images per chunk
    r = rng(11)
    x, w = r.normal(size=(7, 4, 6, 6)).astype(np.float32), r.normal(size=(5, 4, 3, 3)).astype(
        np.float32)
    out = conv2d.conv2d(device.put(x), device.put(w), 1, 1)
    want = conv2d_ref(x.astype(np.float64), w, (1, 1), (1, 1), (1, 1), 1)
    assert rel_err(device.get(out), want) < 1e-5
    d = r.normal(size=want.shape).astype(np.float32)
    dx, dw = conv2d.conv2d_grad(device.put(x), device.put(w), device.put(d), 1, 1)
    want_dx, want_dw = conv2d_grad_ref(x.astype(np.float64), w.astype(np.float64), d,
                                       (1, 1), (1, 1), (1, 1), 1)
    assert rel_err(device.get(dx), want_dx) < 1e-5 and rel_err(device.get(dw), want_dw) < 1e-5


@pytest.mark.parametrize("x_shape,w_shape,stride,pad,dil,groups", [
    ((2, 3, 7, 6), (4, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1),
    ((3, 4, 9, 8), (6, 2, 3, 2), (2, 1), (0, 1), (1, 2), 2),
    ((1, 2, 5, 5), (2, 1, 1, 1), (2, 2), (0, 0), (1, 1), 2),
    ((2, 1, 6, 7), (3, 1, 5, 5), (1, 2), (2, 2), (1, 1), 1)])
def test_conv2d_nhwc_and_grad(device, x_shape, w_shape, stride, pad, dil, groups):
    """kernels/conv2d_nhwc.py: channels-last x and dout, the NCHW filter."""
    from minigraph.kernels.cuda import conv2d_nhwc

    r = rng(16)
    x, w = r.normal(size=x_shape).transpose(0, 2, 3, 1).copy(), r.normal(size=w_shape)
    want = conv2d_ref(x, w, stride, pad, dil, groups, data_layout="NHWC")
    out = conv2d_nhwc.conv2d_nhwc(device.put(x), device.put(w), stride, pad, dil, groups)
    assert out.shape == want.shape and rel_err(device.get(out), want) < 1e-12
    d = r.normal(size=want.shape)
    dx, dw = conv2d_nhwc.conv2d_nhwc_grad(device.put(x), device.put(w), device.put(d), stride,
                                          pad, dil, groups)
    want_dx, want_dw = conv2d_grad_ref(x, w, d, stride, pad, dil, groups, data_layout="NHWC")
    assert rel_err(device.get(dx), want_dx) < 1e-12
    assert rel_err(device.get(dw), want_dw) < 1e-12
    only_dw = conv2d_nhwc.conv2d_nhwc_grad(device.put(x), device.put(w), device.put(d), stride,
                                           pad, dil, groups, need_dx=False)
    assert only_dw[0] is None and rel_err(device.get(only_dw[1]), want_dw) < 1e-12


def test_conv2d_nhwc_in_several_chunks(device, monkeypatch):
    from minigraph.kernels.cuda import conv2d_nhwc

    monkeypatch.setattr(launch, "COLS_BUDGET", 3 * 4 * 9 * 36 * 4)     # 3 images per chunk
    r = rng(17)
    x = r.normal(size=(7, 6, 6, 4)).astype(np.float32)
    w = r.normal(size=(5, 4, 3, 3)).astype(np.float32)
    out = conv2d_nhwc.conv2d_nhwc(device.put(x), device.put(w), 1, 1)
    want = conv2d_ref(x.astype(np.float64), w, 1, 1, data_layout="NHWC")
    assert rel_err(device.get(out), want) < 1e-5
    d = r.normal(size=want.shape).astype(np.float32)
    dx, dw = conv2d_nhwc.conv2d_nhwc_grad(device.put(x), device.put(w), device.put(d), 1, 1)
    want_dx, want_dw = conv2d_grad_ref(x.astype(np.float64), w.astype(np.float64), d, 1, 1,
                                       data_layout="NHWC")
    assert rel_err(device.get(dx), want_dx) < 1e-5 and rel_err(device.get(dw), want_dw) < 1e-5
