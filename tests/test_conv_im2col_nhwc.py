"""The numpy engine of the channels-last convolutions (kernels/cpu/conv_im2col_nhwc.py)
on its own: its chunks (one image each crosses every boundary), dx alone and dfilter
alone against the pair, the epilogue on each chunk; the op-level checks against the
float64 reference and finite differences are in test_conv2d.py."""
import numpy as np
import pytest
from helpers import helper_test_op
from test_conv2d import CASES, conv_reference, engine_geometry, nhwc_case

from minigraph.kernels.cpu import conv_im2col as conv_cpu

rng = np.random.default_rng(3)


@pytest.mark.parametrize("x_shape, w_shape, attrs", CASES[:6] + CASES[12:14])
def test_conv2d_nhwc_engine_in_one_image_chunks(x_shape, w_shape, attrs, monkeypatch):
    """The NHWC engine's chunks: with one image per chunk every boundary is crossed."""
    monkeypatch.setattr(conv_cpu, "CHUNK_BYTES", 1)
    shape, attrs = nhwc_case(x_shape, attrs)
    x, w = rng.standard_normal(shape), rng.standard_normal(w_shape)
    helper_test_op("conv2d", {"x": x, "filter": w}, attrs, conv_reference,
                   grad_wrt=("x", "filter"))


def test_conv2d_nhwc_engine_alone_and_with_the_epilogue():
    """conv_im2col_nhwc directly: dx alone and dfilter alone equal the pair; the
    epilogue (bias on the last axis, residual, relu) on each chunk."""
    from minigraph.kernels.cpu import conv_im2col_nhwc as engine

    for x_shape, w_shape, attrs in (CASES[3], CASES[6], CASES[10]):
        shape, attrs = nhwc_case(x_shape, attrs)
        x, w = rng.standard_normal(shape), rng.standard_normal(w_shape)
        g = engine_geometry(x_shape, w_shape, {k: v for k, v in attrs.items()
                                                if k != "data_layout"})
        want = conv_reference(x, w, **attrs)["out"]
        b, r = rng.standard_normal(g.o), rng.standard_normal(want.shape)
        got = engine.forward(x, w, g, bias=b, residual=r, relu=True)
        np.testing.assert_allclose(got, np.maximum(want + b + r, 0), rtol=1e-12, atol=1e-12)
        d = rng.standard_normal(want.shape)
        dx, dw = engine.backward(x, w, d, g)
        only_dx, none = engine.backward(x, w, d, g, need_dw=False)
        none2, only_dw = engine.backward(x, w, d, g, need_dx=False)
        assert none is None and none2 is None
        np.testing.assert_array_equal(only_dx, dx)
        np.testing.assert_array_equal(only_dw, dw)
