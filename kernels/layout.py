"""Image layouts of the 2-D ops (conv2d, fused_conv2d, pool2d): where a 4-D tensor
keeps its channels and its two spatial axes.

"NCHW": (N, C, H, W), each channel a plane of H x W values; "NHWC" (channels last):
(N, H, W, C), the C values of each pixel side by side. The filter of a convolution
is (O, C / groups, kh, kw) in both.
"""
from __future__ import annotations

LAYOUTS = ("NCHW", "NHWC")


def channel_axis(layout):
    """The channel axis of a 4-D tensor in `layout`: 1 (NCHW) or 3 (NHWC)."""
    return 1 if layout == "NCHW" else 3


def spatial_axes(layout):
    """The (height, width) axes of a 4-D tensor in `layout`."""
    return (2, 3) if layout == "NCHW" else (1, 2)


def image_shape(layout, n, c, h, w):
    """The shape of n images of c channels of h x w in `layout`."""
    return (n, c, h, w) if layout == "NCHW" else (n, h, w, c)


def nchw_sizes(layout, shape):
    """(n, c, h, w) of a 4-D shape in `layout`."""
    n, a, b, d = shape
    return (n, a, b, d) if layout == "NCHW" else (n, d, a, b)
