"""Every option a timed choice can pick computes the same result
(kernels/cpu/choices.py): fused_fc on the native kernel and on BLAS, and conv2d,
its two gradients and fused_conv2d on direct, im2col and Winograd, forced one at a
time, against the float64 reference; a fixed product's native option is timed as
it then runs."""
import numpy as np
import pytest
from references import conv2d as conv_reference
from references import conv2d_grad as conv_grad_reference

from minigraph.kernels.cpu import choices, conv_im2col, conv_native, fc_native, native


def needs_native():
    if not native.enabled() or native.library("conv_native") is None:
        pytest.skip("no native kernels here")


def close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * max(1.0, np.abs(want).max()))


@pytest.mark.parametrize("columns", [1000, 10])        # panels; few columns (fc_cols.h)
@pytest.mark.parametrize("name", ["native", "blas"])
def test_fused_fc_gives_the_reference_whichever_option_runs(name, columns, fresh_choices):
    import minigraph as mg
    from minigraph.kernels.cpu import mul

    if fc_native._lib() is None:
        pytest.skip("no native kernels here")
    rng = np.random.default_rng(3)
    x = rng.standard_normal((64, 300)).astype(np.float32)
    w = rng.standard_normal((300, columns)).astype(np.float32)
    b = rng.standard_normal(columns).astype(np.float32)
    op = type("Op", (), {"attrs": {"x_num_col_dims": 1, "activation": "relu",
                         "weight_fixed": True, "normalize": False}})()
    with choices.forcing({"fc": name}), mg.kernels.cpu.blocks.num_threads(2):
        got = mul.fused_fc_cpu(op, {"x": x, "y": w, "bias": b}, None)["out"]
    close(got, np.maximum(x.astype(np.float64) @ w + b, 0))


def test_a_fixed_products_native_option_is_timed_as_it_runs(fresh_choices, monkeypatch):
    """The bound form times fc_native's call prepared once (the weight packed, the
    arguments made), as the chosen option then runs, not a preparation per call: a
    small product's would cost more than its arithmetic."""
    from minigraph.kernels.cpu import mul

    if fc_native._lib() is None:
        pytest.skip("no native kernels here")
    made = []
    real = fc_native.prepared_forward

    def counted(*args):
        made.append(args)
        return real(*args)
    monkeypatch.setattr(fc_native, "prepared_forward", counted)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    w = rng.standard_normal((128, 10)).astype(np.float32)
    out = np.empty((64, 10), np.float32)
    call = mul._fixed_product(x, w, None, False, out)        # timed: a fresh choice
    call()
    assert len(made) == 1
    close(out, x.astype(np.float64) @ w)


CONVS = [((16, 16, 14, 14), (32, 16, 3, 3), (1, 1), (1, 1)),   # Winograd, direct, im2col
         ((3, 8, 9, 9), (12, 8, 3, 3), (2, 2), (1, 1)),        # strided: direct, im2col
         ((2, 1, 28, 28), (32, 1, 3, 3), (1, 1), (1, 1))]      # one channel


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
@pytest.mark.parametrize("x_shape, w_shape, strides, paddings", CONVS)
def test_every_conv_option_gives_the_reference(x_shape, w_shape, strides, paddings, layout,
                                               fresh_choices, monkeypatch):
    """conv2d, its two gradients and fused_conv2d on each option the conv has (Winograd
    only where it takes the shape), against the float64 reference."""
    from minigraph.kernels.cpu import conv2d as kernels

    needs_native()
    monkeypatch.setattr(kernels, "MIN_CHOICE_WORK", 0)
    rng = np.random.default_rng(9)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = (rng.standard_normal(w_shape) * 0.3).astype(np.float32)
    attrs = {"strides": strides, "paddings": paddings, "dilations": (1, 1), "groups": 1,
             "data_layout": layout, "activation": "relu"}
    want = conv_reference(x.astype(np.float64), w.astype(np.float64), strides=strides,
                          paddings=paddings, dilations=(1, 1))
    d = rng.standard_normal(want.shape).astype(np.float32)
    wants = {"dx", "dfilter"}
    op = type("Op", (), {"attrs": attrs, "wants": lambda self, slot: slot in wants})()
    to = (lambda a: a.transpose(0, 2, 3, 1).copy()) if layout == "NHWC" else (lambda a: a)
    back = (lambda a: a.transpose(0, 3, 1, 2)) if layout == "NHWC" else (lambda a: a)
    dx_want, dw_want = conv_grad_reference(x.astype(np.float64), w.astype(np.float64),
                                           d.astype(np.float64), strides=strides,
                                           paddings=paddings)
    g = conv_im2col.geometry(x_shape, w_shape, strides, paddings, (1, 1), 1)
    names = ["direct", "im2col"] + (["winograd"] if conv_native.forward_winograd(g, 2) else [])
    assert names[-1] == "winograd" or strides != (1, 1) or x_shape[1] < 8
    for name in names:
        forced = {"conv2d": name, "conv2d_dx": name, "conv2d_dw": name, "fused_conv2d": name}
        with choices.forcing(forced):
            out = kernels.conv2d_cpu(op, {"x": to(x), "filter": w}, Ctx())["out"]
            fused = kernels.fused_conv2d_cpu(op, {"x": to(x), "filter": w}, Ctx())["out"]
            grads = kernels.conv2d_grad_cpu(op, {"x": to(x), "filter": w, "dout": to(d)}, Ctx())
        close(back(out), want)
        close(back(fused), np.maximum(want, 0))
        close(grads["dfilter"], dw_want)
        close(back(grads["dx"]), dx_want)


class Ctx:
    room = None
