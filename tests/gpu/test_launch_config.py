"""kernels/cuda/launch.py: launch configurations from shapes and device properties
(occupancy, grids within one wave, reduction plans that split every channel,
vector widths, GEMM and convolution chunks, row-kernel blocks). Pure Python: runs
without g++, nvcc or a GPU."""
from __future__ import annotations

import math

import pytest

from minigraph.kernels.cuda import launch

H100 = launch.DeviceInfo("H100", (9, 0), sm_count=132)
SMALL = launch.DeviceInfo("small", (7, 5), sm_count=20, max_threads_per_sm=1024,
                          max_threads_per_block=512)


def test_device_arch_and_occupancy_come_from_the_device():
    assert H100.arch == "sm_90" and SMALL.arch == "sm_75"
    assert launch.blocks_per_sm(H100, 256) == 8
    assert launch.blocks_per_sm(SMALL, 256) == 4
    assert launch.blocks_per_sm(H100, 256, launch.KernelResources(64, 0)) == 4
    assert launch.blocks_per_sm(H100, 256, launch.KernelResources(32, 100 * 1024)) == 2
    assert launch.block_threads(SMALL, 1024) == 512


def test_flat_grid_covers_the_work_within_one_wave():
    assert launch.flat_grid(10, H100) == 1
    assert launch.flat_grid(10**9, H100) == 132 * 8
    assert launch.flat_grid(10**9, SMALL) == 20 * 4
    assert launch.flat_grid(10, H100, at_least=1000) == 4     # threads for a commit of 1000


@pytest.mark.parametrize("dev", [H100, SMALL], ids=["h100", "small"])
@pytest.mark.parametrize("shape,layout", [
    ((32, 256, 56, 56), "NCHW"), ((64, 64, 112, 112), "NCHW"), ((256, 512, 7, 7), "NCHW"),
    ((128, 2048, 7, 7), "NCHW"), ((32, 56, 56, 256), "NHWC"), ((7, 1, 1, 1), "NCHW"),
    ((3, 5), "NCHW"), ((1000, 3, 3, 3), "NHWC"), ((2, 3, 1, 1), "NCHW")])
@pytest.mark.parametrize("itemsize", [4, 8])
def test_reduce_plan_partitions_every_channel(dev, shape, layout, itemsize):
    pre, channels, post = launch.channel_view(shape, layout)
    plan = launch.reduce_plan(pre, channels, post, itemsize, True, dev)
    units = pre * plan.post_v if plan.kind == "planar" else pre
    assert plan.chunk * plan.splits >= units > plan.chunk * (plan.splits - 1)   # no empty split
    assert plan.grid[1] == plan.splits <= dev.max_grid[1]
    threads = math.prod(plan.block)
    assert threads % 32 == 0 and threads <= dev.max_threads_per_block
    if plan.kind == "planar":
        assert post > 1 and plan.post_v * plan.width == post and plan.grid[0] == channels
    else:
        tx, ty, _ = plan.block
        assert post == 1 and tx & (tx - 1) == 0 and tx <= 32 and channels % plan.width == 0
        assert plan.grid[0] * tx * plan.width >= channels
    per_block = plan.chunk * (plan.width if plan.kind == "planar" else 1)
    assert per_block <= launch.MAX_BLOCK_VALUES


def test_few_channels_still_fill_the_device():
    for dev in (H100, SMALL):
        pre, channels, post = launch.channel_view((64, 64, 112, 112), "NCHW")
        plan = launch.reduce_plan(pre, channels, post, 4, True, dev)
        resident = dev.sm_count * launch.blocks_per_sm(dev, 256)
        assert math.prod(plan.grid) >= 0.9 * resident
        pre, channels, post = launch.channel_view((64, 112, 112, 64), "NHWC")
        plan = launch.reduce_plan(pre, channels, post, 4, True, dev)
        assert math.prod(plan.grid) >= 0.9 * resident


def test_vector_width_needs_alignment_and_divisibility():
    pre, c, post = launch.channel_view((4, 3, 7, 7), "NCHW")
    assert launch.reduce_plan(pre, c, post, 4, True, H100).width == 1      # 49 % 4
    assert launch.reduce_plan(4, 3, 64, 4, True, H100).width == 4
    assert launch.reduce_plan(4, 3, 64, 4, False, H100).width == 1
    assert launch.reduce_plan(4, 3, 64, 8, True, H100).width == 2
    assert launch.reduce_plan(100, 6, 1, 4, True, H100).width == 1        # 6 % 4
    assert launch.reduce_plan(100, 8, 1, 4, True, H100).width == 4
    assert launch.is_aligned(256, 4096) and not launch.is_aligned(256, 4100)


def test_wave_quantisation_is_avoided():
    assert launch.best_splits(256, 528, 1, 100) == 2            # 512 blocks in one wave
    assert launch.wave_use(768, 528) < 0.75 and launch.wave_use(512, 528) > 0.96


def test_gemm_launches_respect_grid_limits():
    dev = launch.DeviceInfo("tiny-grid", (9, 0), 4, max_grid=(100, 2, 3))
    launches = launch.gemm_launches(300, 70, 3, dev)
    assert [(r0, rows) for r0, rows, *_ in launches] == [(0, 128), (128, 128), (256, 44)]
    assert all(grid == (2, math.ceil(rows / 64), 3) for _, rows, _, _, grid in launches)
    assert launch.gemm_launches(0, 5, 1, dev) == []


def test_conv_chunk_bounds_columns_and_grid():
    assert launch.conv_chunk(64, 10 * 2**20, 1, H100) == 25
    assert launch.conv_chunk(3, 10, 1, H100) == 3
    dev = launch.DeviceInfo("z", (9, 0), 4, max_grid=(2**31 - 1, 65535, 10))
    assert launch.conv_chunk(64, 10, 4, dev) == 2


def test_row_kernels_size_blocks_by_row_length():
    assert launch.row_block_threads(10, H100) == 32
    assert launch.row_block_threads(100, H100) == 128
    assert launch.row_block_threads(10**5, H100) == 256
    assert launch.rows_grid(5, 32, H100) == 5
    assert launch.rows_grid(10**6, 256, H100) == 132 * 8
