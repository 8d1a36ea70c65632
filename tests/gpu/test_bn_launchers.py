"""The CUDA kernels and their launchers.

- Every kernels/*.cu compiles with `nvcc -arch=sm_90 -ptx` (skipped only
  where no nvcc exists), and every entry point's parameters match the format
  its launcher passes.
- The launchers import nothing from pycuda until a kernel is launched.
- Launch configurations come from shapes and device properties.
- Every launcher is compared with a numpy reference on two backends: the CPU
  emulator (tests/kernel_emulator: the real .cu compiled with g++ against a
  stand-in CUDA runtime; skipped where no g++ exists) and, marked `gpu`, a
  real GPU through PyCUDA (skipped where there is none).
"""
from __future__ import annotations

import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from minigraph.kernels import launch, loader

KERNEL_DIR = loader.kernel_dir()
CU_FILES = sorted(p.name for p in KERNEL_DIR.glob("*.cu"))


def find_nvcc():
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    for candidate in (shutil.which("nvcc"), os.path.join(home, "bin", "nvcc")):
        if candidate and os.path.exists(candidate):
            return candidate
    return None


NVCC = find_nvcc()
PTX_KIND = {"P": "u64", "q": "u64", "Q": "u64", "i": "u32", "I": "u32", "d": "f64", "f": "f32"}


# ---- compiling -------------------------------------------------------------------


@pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine")
@pytest.mark.parametrize("cu", CU_FILES)
def test_kernel_compiles_for_sm90_and_matches_its_launcher(cu, tmp_path):
    ptx = tmp_path / (cu[:-3] + ".ptx")
    done = subprocess.run([NVCC, "-arch=sm_90", "-ptx", "-I", str(KERNEL_DIR),
                           str(KERNEL_DIR / cu), "-o", str(ptx)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    entries = {name: re.findall(r"\.param\s+\.(\w+)", params) for name, params in
               re.findall(r"\.entry\s+(\w+)\s*\(([^)]*)\)", ptx.read_text())}
    signatures = loader.signature_table()[cu[:-3]]
    assert sorted(entries) == sorted(signatures), "kernels without a launcher entry, or back"
    for name, fmt in signatures.items():
        assert entries[name] == [PTX_KIND[c] for c in fmt], f"{name}: parameters vs {fmt!r}"


def test_every_module_has_a_launcher_beside_it_or_is_map_only():
    """A .cu is either beside its launcher .py, or map-only: every entry point
    declared with map.cuh's macros (kernels/map.py launches those)."""
    from minigraph.kernels import map as maps

    map_only = [cu for cu in CU_FILES if not (KERNEL_DIR / (cu[:-3] + ".py")).exists()]
    for cu in map_only:
        source = (KERNEL_DIR / cu).read_text()
        assert maps.declarations(source), f"{cu}: no launcher beside it and no map declarations"
        assert "__global__" not in source and 'extern "C"' not in source, \
            f"{cu}: no launcher beside it, but entry points of its own"
        assert not loader.has_launcher(cu[:-3])
    assert map_only, "no map-only module left to test the mechanism with"
    assert (KERNEL_DIR / "common.cuh").exists() and (KERNEL_DIR / "map.cuh").exists()


def test_map_signatures_come_from_the_declarations():
    from minigraph.kernels import map as maps

    source = ("#include \"map.cuh\"\n// MG_UNARY_MAP(commented, x, x)\n"
              "/* MG_UNARY_MAP(blocked, x,\n x) */\n"
              "MG_UNARY_MAP(neg, x, -x)\n"
              "MG_BINARY_MAP_S(axpy, a, b, s, s * a + b)\n")
    assert maps.declarations(source) == [("MG_UNARY_MAP", "neg"), ("MG_BINARY_MAP_S", "axpy")]
    sigs = maps.source_signatures(source)
    assert sigs == {**{f"neg_{v}": "PPq" for v in ("f32_w1", "f32_w4", "f64_w1", "f64_w2")},
                    **{f"axpy_{v}": "PPPqd" for v in ("f32_w1", "f32_w4", "f64_w1", "f64_w2")}}
    with pytest.raises(ValueError, match="'neg' is declared twice"):
        maps.source_signatures(source + "MG_UNARY_MAP(neg, x, x)\n")
    for module in loader.module_names():
        assert set(maps.signatures(module)) <= set(loader.signature_table()[module])


def test_launchers_import_nothing_from_pycuda():
    code = ("import sys, minigraph, minigraph.kernels\n"
            "from minigraph.kernels import loader\n"
            "import importlib\n"
            "for m in [m for m in loader.module_names() if loader.has_launcher(m)]"
            " + ['loader', 'launch', 'map']:\n"
            "    importlib.import_module('minigraph.kernels.' + m)\n"
            "loader.signature_table()\n"
            "bad = [m for m in sys.modules if m.split('.')[0] == 'pycuda']\n"
            "assert not bad, bad\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_launching_without_pycuda_is_a_clear_error():
    code = ("import numpy as np\n"
            "from minigraph.kernels import fill\n"
            "try:\n"
            "    fill.full((3,), 1.0, np.float32)\n"
            "except RuntimeError as e:\n"
            "    assert 'need pycuda' in str(e), e\n"
            "else:\n"
            "    raise AssertionError('no error')\n")
    try:
        import pycuda.driver  # noqa: F401
    except ImportError:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
    else:
        pytest.skip("pycuda is importable here")


def test_benchmark_is_import_safe():
    bench = pathlib.Path(__file__).parents[2] / "benchmarks" / "bn_gpu.py"
    code = (f"import runpy, sys\n"
            f"ns = runpy.run_path({str(bench)!r}, run_name='bench')\n"
            f"assert callable(ns['main'])\n"
            f"bad = [m for m in sys.modules if m.split('.')[0] in ('pycuda', 'torch')]\n"
            f"assert not bad, bad\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    done = subprocess.run([sys.executable, str(bench), "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--runs" in done.stdout


def test_row_block_size_agrees_with_the_header():
    header = (KERNEL_DIR / "common.cuh").read_text()
    assert f"ROW_THREADS = {launch.ROW_THREADS};" in header


# ---- launch configurations ----------------------------------------------------------

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


# ---- launchers against numpy: on the emulator and on a real GPU ------------------------


class Emulated:
    """Device arrays of the CPU emulator."""

    def __init__(self, ke):
        self.ke = ke

    def put(self, a, offset=0):
        return self.ke.to_device(np.require(a, requirements="C"), offset=offset)

    def get(self, a):
        return a.get()


class RealGPU:
    """PyCUDA GPUArrays on the current context."""

    def put(self, a, offset=0):
        import pycuda.gpuarray as gpuarray

        a = np.require(a, requirements="C")
        if not offset:
            return gpuarray.to_gpu(a)
        flat = gpuarray.to_gpu(np.concatenate([np.zeros(offset, a.dtype), a.ravel()]))
        return flat[offset:].reshape(a.shape)

    def get(self, a):
        return a.get()


@pytest.fixture(params=["emulator", pytest.param("gpu", marks=pytest.mark.gpu)])
def dev(request):
    """Where the launchers run: the emulator, or the GPU (skipped without one)."""
    if request.param == "gpu":
        request.getfixturevalue("gpu_place")
        old = loader.use_backend(None)
        yield RealGPU()
        loader.use_backend(old)
        return
    if shutil.which("g++") is None:
        pytest.skip("no g++ for the kernel emulator")
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import kernel_emulator

    old = loader.use_backend(kernel_emulator.EmuBackend(sm_count=2))
    yield Emulated(kernel_emulator)
    loader.use_backend(old)


@pytest.fixture
def force_splits(monkeypatch):
    """Let small tensors split one channel over many blocks (exercises the
    last-block merges)."""
    monkeypatch.setattr(launch, "MIN_UNITS_PER_THREAD", 1)


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert np.isfinite(got).all() or not np.isfinite(want).all(), "non-finite output"
    scale = np.linalg.norm(want.ravel())
    return np.linalg.norm((got - want).ravel()) / (scale if scale else 1.0)


TOL = {np.float32: 1e-5, np.float64: 1e-12}


def rng(seed=0):
    return np.random.default_rng(seed)


# ---- batch norm ----------------------------------------------------------------------

BN_SHAPES = [("NCHW", (4, 3, 5, 7)), ("NCHW", (8, 4, 8, 8)), ("NCHW", (5, 1, 1, 1)),
             ("NCHW", (6, 3)), ("NCHW", (2, 3, 4, 5, 3)), ("NHWC", (4, 5, 6, 8)),
             ("NHWC", (3, 7, 7, 3)), ("NHWC", (37, 1))]


def bn_axes(ndim, layout):
    return tuple(i for i in range(ndim) if i != (1 if layout == "NCHW" else ndim - 1))


def bn_shape(ndim, layout, channels):
    shape = [1] * ndim
    shape[1 if layout == "NCHW" else -1] = channels
    return shape


def bn_params(channels, dtype, seed=1):
    r = rng(seed)
    return [r.uniform(0.5, 1.5, channels).astype(dtype), r.normal(0, 1, channels).astype(dtype),
            r.normal(0, 1, channels).astype(dtype), r.uniform(0.5, 2, channels).astype(dtype)]


def bn_reference(x, scale, bias, mean, var, eps, layout):
    shape = bn_shape(x.ndim, layout, scale.size)
    x = x.astype(np.float64)
    return ((x - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps)
            * scale.astype(np.float64).reshape(shape) + bias.astype(np.float64).reshape(shape))


def estimates_after(est, batch, n, counter, momentum):
    """(mean, var) estimates after a batch (float64), by the design's rules."""
    mean, var = batch
    unbiased = var * n / (n - 1)
    if counter == 0:
        return mean, unbiased
    if momentum is None:
        w = 1.0 / (counter + 1)
        return est[0] + (mean - est[0]) * w, est[1] + (unbiased - est[1]) * w
    return (momentum * est[0] + (1 - momentum) * mean,
            momentum * est[1] + (1 - momentum) * unbiased)


def run_bn_training(dev, layout, shape, dtype, momentum, steps, offset=0, counter=True,
                    data=None):
    from minigraph.kernels import batch_norm

    channels = shape[1] if layout == "NCHW" else shape[-1]
    scale, bias, est_mean, est_var = bn_params(channels, dtype)
    d_scale, d_bias, d_mean, d_var = (dev.put(a, offset) for a in (scale, bias, est_mean,
                                                                     est_var))
    d_counter = dev.put(np.array(0, np.int64)) if counter else None
    est = (est_mean.astype(np.float64), est_var.astype(np.float64))
    eps = 1e-5
    guard = batch_norm.Guard()
    for step in range(steps):
        x = data(step) if data else rng(step).normal(0.5, 2.0, shape).astype(dtype)
        y, bm, bv = batch_norm.forward_train(dev.put(x, offset), d_scale, d_bias, d_mean, d_var,
                                             d_counter, momentum, eps, layout, guard=guard)
        axes = bn_axes(x.ndim, layout)
        mean, var = x.astype(np.float64).mean(axes), x.astype(np.float64).var(axes)
        n = x.size // channels
        tol = TOL[dtype]
        assert rel_err(dev.get(bm), mean) < tol
        assert rel_err(dev.get(bv), var) < tol * 10
        assert rel_err(dev.get(y), bn_reference(x, scale, bias, mean, var, eps, layout)) < tol
        est = estimates_after(est, (mean, var), n, step if counter else 1, momentum)
        assert rel_err(dev.get(d_mean), est[0]) < tol
        assert rel_err(dev.get(d_var), est[1]) < tol * 10
        if counter:
            assert int(dev.get(d_counter)) == step + 1
    assert guard.rejected() == 0
    return dev


@pytest.mark.parametrize("layout,shape", BN_SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bn_forward_train_updates_estimates_on_the_device(dev, layout, shape, dtype):
    run_bn_training(dev, layout, shape, dtype, momentum=0.9, steps=2)


@pytest.mark.parametrize("layout,shape", [("NCHW", (8, 2, 16, 16)), ("NCHW", (9, 3, 5, 7)),
                                          ("NHWC", (40, 9, 8)), ("NHWC", (300, 3))])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "unaligned"])
def test_bn_split_channels_merge_in_the_last_block(dev, force_splits, layout, shape, dtype,
                                                   offset):
    run_bn_training(dev, layout, shape, dtype, momentum=0.8, steps=2, offset=offset)


def test_bn_cumulative_average_and_no_counter(dev):
    run_bn_training(dev, "NCHW", (4, 3, 6, 6), np.float32, momentum=None, steps=3)
    run_bn_training(dev, "NHWC", (4, 6, 6, 4), np.float64, momentum=0.5, steps=2, counter=False)


@pytest.mark.parametrize("layout,shape", [("NCHW", (16, 2, 17, 13)), ("NHWC", (64, 9, 4)),
                                          ("NCHW", (4000, 1))])
def test_bn_offset_data_keeps_its_variance(dev, force_splits, layout, shape):
    from minigraph.kernels import batch_norm

    x = (1e4 + rng(3).standard_normal(shape)).astype(np.float32)
    channels = shape[1] if layout == "NCHW" else shape[-1]
    scale, bias, est_mean, est_var = (dev.put(a) for a in bn_params(channels, np.float32))
    y, bm, bv = batch_norm.forward_train(dev.put(x), scale, bias, est_mean, est_var, None, 0.9,
                                         1e-5, layout)
    axes = bn_axes(x.ndim, layout)
    var = x.astype(np.float64).var(axes)
    assert np.max(np.abs(dev.get(bv) / var - 1)) < 1e-3
    mean = x.astype(np.float64).mean(axes)
    ref = bn_reference(x, *bn_params(channels, np.float32)[:2], mean, var, 1e-5, layout)
    assert np.max(np.abs(dev.get(y) - ref)) < 1e-3


def test_bn_non_finite_batch_commits_nothing(dev):
    from minigraph.kernels import batch_norm

    shape, channels = (4, 3, 5, 5), 3
    params = bn_params(channels, np.float32)
    scale, bias, est_mean, est_var = (dev.put(a) for a in params)
    counter = dev.put(np.array(0, np.int64))
    guard = batch_norm.Guard()
    good = rng(0).normal(0, 1, shape).astype(np.float32)
    batch_norm.forward_train(dev.put(good), scale, bias, est_mean, est_var, counter, 0.9, 1e-5,
                             guard=guard)
    before = [dev.get(a) for a in (est_mean, est_var, counter)]
    bad = good.copy()
    bad[1, 2, 3, 4] = np.nan
    y, bm, bv = batch_norm.forward_train(dev.put(bad), scale, bias, est_mean, est_var, counter,
                                         0.9, 1e-5, guard=guard)
    bad[0, 0, 0, 0] = np.inf
    batch_norm.forward_train(dev.put(bad), scale, bias, est_mean, est_var, counter, 0.9, 1e-5,
                             guard=guard)
    for want, got in zip(before, (est_mean, est_var, counter), strict=True):
        np.testing.assert_array_equal(dev.get(got), want)
    assert np.isnan(dev.get(bm)[2])
    with pytest.raises(FloatingPointError, match=r"batch_norm: 2 training batch\(es\)"):
        guard.check()
    guard.check()                                     # reported once
    batch_norm.forward_train(dev.put(good), scale, bias, est_mean, est_var, counter, 0.9, 1e-5,
                             guard=guard)
    assert int(dev.get(counter)) == 2 and guard.rejected() == 0


def test_bn_training_needs_two_values_per_channel(dev):
    from minigraph.kernels import batch_norm

    params = [dev.put(a) for a in bn_params(3, np.float32)]
    with pytest.raises(ValueError, match="more than one value per channel"):
        batch_norm.forward_train(dev.put(np.ones((1, 3), np.float32)), *params, None, 0.9, 1e-5)
    with pytest.raises(ValueError, match=r"'scale' must be float32 of shape \(4,\)"):
        batch_norm.forward_train(dev.put(np.ones((2, 4), np.float32)), *params, None, 0.9, 1e-5)


@pytest.mark.parametrize("layout,shape", BN_SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bn_forward_infer(dev, layout, shape, dtype):
    from minigraph.kernels import batch_norm

    x = rng(5).normal(1, 3, shape).astype(dtype)
    channels = shape[1] if layout == "NCHW" else shape[-1]
    params = bn_params(channels, dtype)
    y = batch_norm.forward_infer(dev.put(x), *(dev.put(a) for a in params), 1e-3, layout)
    assert rel_err(dev.get(y), bn_reference(x, *params, 1e-3, layout)) < TOL[dtype]


def bn_grad_reference(x, dy, scale, mean, var, eps, layout, use_global):
    axes = bn_axes(x.ndim, layout)
    shape = bn_shape(x.ndim, layout, scale.size)
    x, dy = x.astype(np.float64), dy.astype(np.float64)
    mean, var, scale = (a.astype(np.float64).reshape(shape) for a in (mean, var, scale))
    invstd = 1 / np.sqrt(var + eps)
    xhat = (x - mean) * invstd
    dbias, dscale = dy.sum(axes), (dy * xhat).sum(axes)
    if use_global:
        dx = dy * scale * invstd
    else:
        dx = scale * invstd * (dy - dy.mean(axes, keepdims=True)
                               - xhat * (dy * xhat).mean(axes, keepdims=True))
    return dx, dscale, dbias


@pytest.mark.parametrize("layout,shape", BN_SHAPES + [("NCHW", (8, 2, 16, 16))])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("use_global", [False, True], ids=["batch", "global"])
def test_bn_backward(dev, force_splits, layout, shape, dtype, use_global):
    from minigraph.kernels import batch_norm

    r = rng(7)
    x = r.normal(2, 3, shape).astype(dtype)
    dy = r.normal(0, 1, shape).astype(dtype)
    axes = bn_axes(x.ndim, layout)
    channels = shape[1] if layout == "NCHW" else shape[-1]
    scale = r.uniform(0.5, 2, channels).astype(dtype)
    if use_global:
        mean, var = r.normal(0, 1, channels).astype(dtype), r.uniform(1, 2, channels).astype(dtype)
    else:
        mean, var = x.astype(np.float64).mean(axes).astype(dtype), \
            x.astype(np.float64).var(axes).astype(dtype)
    dx, dscale, dbias = batch_norm.backward(dev.put(x), dev.put(dy), dev.put(scale),
                                            dev.put(mean), dev.put(var), 1e-5, layout, use_global)
    want = bn_grad_reference(x, dy, scale, mean, var, 1e-5, layout, use_global)
    tol = TOL[dtype] * (100 if dtype == np.float32 else 1)    # dx cancels: sums of ~n terms
    for got, ref in zip((dx, dscale, dbias), want, strict=True):
        assert rel_err(dev.get(got), ref) < tol


def test_empty_arrays_launch_nothing(dev):
    from minigraph.kernels import activation, batch_norm, elementwise

    empty = dev.put(np.zeros((0, 3), np.float32))
    assert dev.get(activation.relu(empty)).shape == (0, 3)
    assert dev.get(elementwise.copy(empty)).shape == (0, 3)
    params = [dev.put(a) for a in bn_params(3, np.float32)]
    assert dev.get(batch_norm.forward_infer(empty, *params, 1e-5)).shape == (0, 3)


def test_bn_backward_skips_unwanted_outputs(dev):
    from minigraph.kernels import batch_norm

    x = rng(1).normal(size=(4, 3, 4, 4)).astype(np.float32)
    args = [dev.put(a) for a in (x, x, np.ones(3, np.float32), np.zeros(3, np.float32),
                                 np.ones(3, np.float32))]
    dx, dscale, dbias = batch_norm.backward(*args, 1e-5, need_dx=False, need_dscale=False)
    assert dx is None and dscale is None and dbias is not None


# ---- the other ops ---------------------------------------------------------------------


@pytest.mark.parametrize("dtype,value", [(np.float32, 2.5), (np.float64, -1e300),
                                         (np.int64, 2**40 + 3), (np.int32, -7), (np.uint8, 200),
                                         (np.bool_, 1), (np.float16, 0.1)])
def test_fill_constant(dev, dtype, value):
    from minigraph.kernels import fill

    out = fill.full((3, 37), value, dtype)
    np.testing.assert_array_equal(dev.get(out), np.full((3, 37), value, dtype))


def philox4x32(counter, key):
    """Random123's Philox4x32-10 in Python (checked against its known answers)."""
    c, k = list(counter), list(key)
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [((p1 >> 32) ^ c[1] ^ k[0]) & 0xFFFFFFFF, p1 & 0xFFFFFFFF,
             ((p0 >> 32) ^ c[3] ^ k[1]) & 0xFFFFFFFF, p0 & 0xFFFFFFFF]
        k = [(k[0] + 0x9E3779B9) & 0xFFFFFFFF, (k[1] + 0xBB67AE85) & 0xFFFFFFFF]
    return c


def test_philox_reference_matches_random123_known_answers():
    assert philox4x32([0, 0, 0, 0], [0, 0]) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert philox4x32([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
                      [0xA4093822, 0x299F31D0]) == [0xD16CFE09, 0x94FDCCEB, 0x5001E420,
                                                    0x24126EA1]


def test_uniform_is_philox_and_seeded(dev):
    from minigraph.kernels import fill

    seed = 0x1234567890
    got = dev.get(fill.uniform_random((10,), np.float32, 0.0, 1.0, seed))
    words = [w for i in range(3) for w in philox4x32([i, 0, 0, 0], [seed & 0xFFFFFFFF,
                                                                    seed >> 32])]
    np.testing.assert_array_equal(got, (np.array(words[:10]) >> 8) / 2.0**24)
    big = dev.get(fill.uniform_random((20001,), np.float64, -2.0, 3.0, 7))
    assert big.min() >= -2 and big.max() < 3 and abs(big.mean() - 0.5) < 0.05
    np.testing.assert_array_equal(big, dev.get(fill.uniform_random((20001,), np.float64, -2.0,
                                                                   3.0, 7)))
    assert not np.array_equal(big, dev.get(fill.uniform_random((20001,), np.float64, -2.0, 3.0,
                                                               8)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gaussian_moments(dev, dtype):
    from minigraph.kernels import fill

    g = dev.get(fill.gaussian_random((40001,), dtype, 1.5, 2.0, 3))
    assert g.dtype == dtype and np.isfinite(g).all()
    assert abs(g.mean() - 1.5) < 0.05 and abs(g.std() - 2.0) < 0.05


@pytest.mark.parametrize("x_shape,y_shape,axis", [((4, 3, 5, 6), (3,), 1), ((7, 9), (9,), -1),
                                                  ((2, 3, 4), (2, 3, 4), -1),
                                                  ((2, 3, 4, 5), (3, 4), 1),
                                                  ((6, 5), (6,), 0), ((33, 8), (), -1)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_elementwise_add_and_grad(dev, force_splits, x_shape, y_shape, axis, dtype):
    from minigraph.kernels import elementwise

    r = rng(2)
    x, y = r.normal(size=x_shape).astype(dtype), r.normal(size=y_shape).astype(dtype)
    start = len(x_shape) - len(y_shape) if axis == -1 else axis
    yb = y.reshape(y_shape + (1,) * (len(x_shape) - start - len(y_shape)))
    out = elementwise.add(dev.put(x), dev.put(y), axis)
    np.testing.assert_allclose(dev.get(out), x + yb, rtol=TOL[dtype])
    d = r.normal(size=x_shape).astype(dtype)
    dx, dy = elementwise.add_grad(dev.put(d), y_shape, axis)
    np.testing.assert_array_equal(dev.get(dx), d)
    axes = tuple(range(start)) + tuple(range(start + len(y_shape), len(x_shape)))
    assert rel_err(dev.get(dy), d.astype(np.float64).sum(axes).reshape(y_shape)) < TOL[dtype]


@pytest.mark.parametrize("count", [1, 3, 11])
def test_sum_of_n_tensors(dev, count):
    from minigraph.kernels import elementwise

    xs = [rng(i).normal(size=(5, 13)).astype(np.float32) for i in range(count)]
    out = elementwise.sum_n([dev.put(x) for x in xs])
    np.testing.assert_allclose(dev.get(out), np.sum(xs, axis=0), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("offset", [0, 1])
def test_relu_and_grad(dev, dtype, offset):
    from minigraph.kernels import activation

    x = rng(4).normal(size=(7, 19)).astype(dtype)
    x[0, 0] = np.nan
    out = activation.relu(dev.put(x, offset))
    np.testing.assert_array_equal(dev.get(out), np.maximum(x, 0))
    d = rng(5).normal(size=x.shape).astype(dtype)
    dx = activation.relu_grad(out, dev.put(d, offset))
    np.testing.assert_array_equal(dev.get(dx), np.where(np.maximum(x, 0) > 0, d, 0))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mean_and_grad(dev, dtype):
    from minigraph.kernels import mean

    x = (1e3 + rng(6).normal(size=(37, 211))).astype(dtype)
    out = mean.mean(dev.put(x))
    assert abs(float(dev.get(out)) - x.astype(np.float64).mean()) < 1e-3 * (dtype == np.float32
                                                                            or 1e-9)
    dx = mean.mean_grad((3, 5), dev.put(np.array(6.0, dtype)))
    np.testing.assert_allclose(dev.get(dx), np.full((3, 5), 6.0 / 15), rtol=TOL[dtype])


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (65, 17, 130), (3, 200, 5), (128, 64, 64)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_variants(dev, m, k, n, dtype):
    from minigraph.kernels import matmul

    r = rng(8)
    a, b = r.normal(size=(m, k)).astype(dtype), r.normal(size=(k, n)).astype(dtype)
    want = a.astype(np.float64) @ b
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert rel_err(dev.get(matmul.matmul(dev.put(a), dev.put(b))), want) < tol
    assert rel_err(dev.get(matmul.matmul(dev.put(a.T.copy()), dev.put(b), trans_a=True)),
                   want) < tol
    assert rel_err(dev.get(matmul.matmul(dev.put(a), dev.put(b.T.copy()), trans_b=True)),
                   want) < tol
    acc = dev.put(np.ones((m, n), dtype))
    matmul.matmul(dev.put(a), dev.put(b), out=acc, accumulate=True)
    assert rel_err(dev.get(acc), want + 1) < tol


def test_mul_and_grad(dev):
    from minigraph.kernels import matmul

    r = rng(9)
    x, y = r.normal(size=(4, 3, 5, 2)), r.normal(size=(10, 7))
    d = r.normal(size=(4, 3, 7))
    out = matmul.mul(dev.put(x), dev.put(y), x_num_col_dims=2)
    x2 = x.reshape(12, 10)
    assert rel_err(dev.get(out), (x2 @ y).reshape(4, 3, 7)) < 1e-12
    dx, dy = matmul.mul_grad(dev.put(x), dev.put(y), dev.put(d), x_num_col_dims=2)
    assert rel_err(dev.get(dx), (d.reshape(12, 7) @ y.T).reshape(x.shape)) < 1e-12
    assert rel_err(dev.get(dy), x2.T @ d.reshape(12, 7)) < 1e-12


def conv_reference(x, w, stride, pad, dil, groups):
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, pad, dil
    ho = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    wo = (wd + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    og = o // groups
    out = np.zeros((n, o, ho, wo))
    for g in range(groups):
        for i in range(kh):
            for j in range(kw):
                patch = xp[:, g * cg:(g + 1) * cg, i * dh:i * dh + sh * (ho - 1) + 1:sh,
                           j * dw:j * dw + sw * (wo - 1) + 1:sw]
                out[:, g * og:(g + 1) * og] += np.einsum("nchw,oc->nohw", patch,
                                                         w[g * og:(g + 1) * og, :, i, j])
    return out


def conv_grad_reference(x, w, d, stride, pad, dil, groups):
    """dx, dw by the adjoint of conv_reference (numpy, float64)."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    (sh, sw), (ph, pw), (dh, dw_) = stride, pad, dil
    ho, wo = d.shape[2:]
    xp = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    dxp = np.zeros_like(xp)
    dwt = np.zeros_like(w)
    og = o // groups
    for g in range(groups):
        dg = d[:, g * og:(g + 1) * og]
        for i in range(kh):
            for j in range(kw):
                sl = (slice(None), slice(g * cg, (g + 1) * cg),
                      slice(i * dh, i * dh + sh * (ho - 1) + 1, sh),
                      slice(j * dw_, j * dw_ + sw * (wo - 1) + 1, sw))
                dwt[g * og:(g + 1) * og, :, i, j] = np.einsum("nohw,nchw->oc", dg, xp[sl])
                dxp[sl] += np.einsum("nohw,oc->nchw", dg, w[g * og:(g + 1) * og, :, i, j])
    return dxp[:, :, ph:ph + h, pw:pw + wd], dwt


@pytest.mark.parametrize("x_shape,w_shape,stride,pad,dil,groups", [
    ((2, 3, 7, 6), (4, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1),
    ((3, 4, 9, 8), (6, 2, 3, 2), (2, 1), (0, 1), (1, 2), 2),
    ((1, 2, 5, 5), (2, 1, 1, 1), (2, 2), (0, 0), (1, 1), 2),
    ((2, 1, 6, 7), (3, 1, 5, 5), (1, 2), (2, 2), (1, 1), 1)])
def test_conv2d_and_grad(dev, x_shape, w_shape, stride, pad, dil, groups):
    from minigraph.kernels import conv2d

    r = rng(10)
    x, w = r.normal(size=x_shape), r.normal(size=w_shape)
    want = conv_reference(x, w, stride, pad, dil, groups)
    out = conv2d.conv2d(dev.put(x), dev.put(w), stride, pad, dil, groups)
    assert rel_err(dev.get(out), want) < 1e-12
    d = r.normal(size=want.shape)
    dx, dw = conv2d.conv2d_grad(dev.put(x), dev.put(w), dev.put(d), stride, pad, dil, groups)
    want_dx, want_dw = conv_grad_reference(x, w, d, stride, pad, dil, groups)
    assert rel_err(dev.get(dx), want_dx) < 1e-12
    assert rel_err(dev.get(dw), want_dw) < 1e-12


def test_conv2d_in_several_chunks(dev, monkeypatch):
    from minigraph.kernels import conv2d

    monkeypatch.setattr(launch, "COLS_BUDGET", 3 * 4 * 9 * 36 * 4)     # 3 images per chunk
    r = rng(11)
    x, w = r.normal(size=(7, 4, 6, 6)).astype(np.float32), r.normal(size=(5, 4, 3, 3)).astype(
        np.float32)
    out = conv2d.conv2d(dev.put(x), dev.put(w), 1, 1)
    want = conv_reference(x.astype(np.float64), w, (1, 1), (1, 1), (1, 1), 1)
    assert rel_err(dev.get(out), want) < 1e-5
    d = r.normal(size=want.shape).astype(np.float32)
    dx, dw = conv2d.conv2d_grad(dev.put(x), dev.put(w), dev.put(d), 1, 1)
    want_dx, want_dw = conv_grad_reference(x.astype(np.float64), w.astype(np.float64), d,
                                           (1, 1), (1, 1), (1, 1), 1)
    assert rel_err(dev.get(dx), want_dx) < 1e-5 and rel_err(dev.get(dw), want_dw) < 1e-5


def pool_reference(x, kind, k, s, p):
    n, c, h, w = x.shape
    ho, wo = (h + 2 * p[0] - k[0]) // s[0] + 1, (w + 2 * p[1] - k[1]) // s[1] + 1
    out = np.zeros((n, c, ho, wo))
    dmap = {}
    for oh in range(ho):
        for ow in range(wo):
            h0, w0 = oh * s[0] - p[0], ow * s[1] - p[1]
            hs, ws = slice(max(h0, 0), min(h0 + k[0], h)), slice(max(w0, 0), min(w0 + k[1], w))
            win = x[:, :, hs, ws]
            if kind == "avg":
                out[:, :, oh, ow] = win.mean(axis=(2, 3))
            else:
                flat = win.reshape(n, c, -1)
                out[:, :, oh, ow] = flat.max(axis=2)
                dmap[oh, ow] = (hs, ws, flat.argmax(axis=2))
    return out, dmap


def pool_grad_reference(x, d, kind, k, s, p):
    n, c, h, w = x.shape
    _, dmap = pool_reference(x, kind, k, s, p)
    dx = np.zeros_like(x)
    for oh in range(d.shape[2]):
        for ow in range(d.shape[3]):
            h0, w0 = oh * s[0] - p[0], ow * s[1] - p[1]
            hs, ws = slice(max(h0, 0), min(h0 + k[0], h)), slice(max(w0, 0), min(w0 + k[1], w))
            if kind == "avg":
                cnt = (hs.stop - hs.start) * (ws.stop - ws.start)
                dx[:, :, hs, ws] += d[:, :, oh, ow][:, :, None, None] / cnt
            else:
                win_w = ws.stop - ws.start
                arg = dmap[oh, ow][2]
                for ni in range(n):
                    for ci in range(c):
                        a = arg[ni, ci]
                        dx[ni, ci, hs.start + a // win_w, ws.start + a % win_w] += d[ni, ci, oh, ow]
    return dx


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("k,s,p", [((2, 2), (2, 2), (0, 0)), ((3, 3), (2, 1), (1, 1)),
                                   ((3, 2), (1, 1), (2, 1))])
def test_pool2d_and_grad(dev, kind, k, s, p):
    from minigraph.kernels import pool2d

    x = rng(12).normal(size=(2, 3, 7, 6))
    want, _ = pool_reference(x, kind, k, s, p)
    out = pool2d.pool2d(dev.put(x), kind, k, s, p)
    assert rel_err(dev.get(out), want) < 1e-12
    d = rng(13).normal(size=want.shape)
    dx = pool2d.pool2d_grad(dev.put(x), dev.put(d), kind, k, s, p)
    assert rel_err(dev.get(dx), pool_grad_reference(x, d, kind, k, s, p)) < 1e-12


def test_global_pooling_and_first_max(dev):
    from minigraph.kernels import pool2d

    x = rng(14).normal(size=(2, 3, 5, 4)).astype(np.float32)
    np.testing.assert_allclose(dev.get(pool2d.pool2d(dev.put(x), "avg", global_pooling=True)),
                               x.mean(axis=(2, 3), keepdims=True), rtol=1e-6)
    np.testing.assert_array_equal(dev.get(pool2d.pool2d(dev.put(x), "max", global_pooling=True)),
                                  x.max(axis=(2, 3), keepdims=True))
    ties = np.ones((1, 1, 4, 4), np.float32)
    dx = pool2d.pool2d_grad(dev.put(ties), dev.put(np.ones((1, 1, 2, 2), np.float32)), "max",
                            3, 2, 1)
    want = np.zeros((4, 4), np.float32)
    want[0, 0] = want[0, 1] = want[1, 0] = want[1, 1] = 1    # each window's first real element
    np.testing.assert_array_equal(dev.get(dx)[0, 0], want)
    with pytest.raises(ValueError, match=r"dout must be float32 of shape \(1, 1, 4, 4\)"):
        pool2d.pool2d_grad(dev.put(ties), dev.put(np.ones((1, 1, 2, 2), np.float32)), "max", 3,
                           1, 1)


@pytest.mark.parametrize("rows,classes", [(5, 10), (3, 1000), (1, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_with_cross_entropy(dev, rows, classes, dtype):
    from minigraph.kernels import softmax_with_cross_entropy as swce

    r = rng(15)
    logits = (r.normal(size=(rows, classes)) * 30).astype(dtype)
    label = r.integers(0, classes, rows).astype(np.int64)
    z = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    status = swce.LabelStatus()
    sm, loss = swce.forward(dev.put(logits), dev.put(label), status)
    assert rel_err(dev.get(sm), np.exp(logp)) < TOL[dtype]
    assert rel_err(dev.get(loss), -logp[np.arange(rows), label]) < TOL[dtype]
    dloss, dsm = r.normal(size=rows).astype(dtype), r.normal(size=(rows, classes)).astype(dtype)
    p = np.exp(logp)
    onehot = np.eye(classes)[label]
    want = (p - onehot) * dloss[:, None] + p * (dsm - (dsm * p).sum(axis=1, keepdims=True))
    got = swce.grad(dev.put(label), sm, dev.put(dloss), dev.put(dsm), status)
    assert rel_err(dev.get(got), want) < TOL[dtype] * 10
    got = swce.grad(dev.put(label), sm, dev.put(dloss), None, status)
    assert rel_err(dev.get(got), (p - onehot) * dloss[:, None]) < TOL[dtype] * 10
    status.check()


def test_bad_labels_are_flagged_not_hidden(dev):
    from minigraph.kernels import softmax_with_cross_entropy as swce

    status = swce.LabelStatus()
    _, loss = swce.forward(dev.put(np.zeros((3, 4), np.float32)),
                           dev.put(np.array([0, 4, 1], np.int64)), status)
    got = dev.get(loss)
    assert np.isnan(got[1]) and np.isfinite(got[[0, 2]]).all()
    with pytest.raises(ValueError, match=r"1 value\(s\) outside \[0, K\), e.g. at row 1"):
        status.check()
    status.check()


@pytest.mark.parametrize("dtype,lr_dtype", [(np.float32, np.float32), (np.float64, np.float32),
                                            (np.float32, np.float64)])
@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_and_momentum_in_place(dev, dtype, lr_dtype, nesterov):
    from minigraph.kernels import optimizer_ops

    r = rng(16)
    p, g, v = (r.normal(size=(3, 41)).astype(dtype) for _ in range(3))
    lr = np.array([0.1], lr_dtype)
    dp = dev.put(p)
    optimizer_ops.sgd(dp, dev.put(g), dev.put(lr))
    want = p - g * dtype(lr[0])
    np.testing.assert_allclose(dev.get(dp), want, rtol=TOL[dtype])
    dp, dv = dev.put(p), dev.put(v)
    optimizer_ops.momentum(dp, dev.put(g), dv, dev.put(lr), 0.9, nesterov)
    nv = dtype(0.9) * v + g
    step = g + dtype(0.9) * nv if nesterov else nv
    np.testing.assert_allclose(dev.get(dv), nv, rtol=TOL[dtype])
    np.testing.assert_allclose(dev.get(dp), p - dtype(lr[0]) * step, rtol=TOL[dtype])


def test_random_values_do_not_depend_on_the_device(dev):
    from minigraph.kernels import fill

    if isinstance(dev, RealGPU):
        pytest.skip("needs two emulated devices")
    import kernel_emulator

    first = dev.get(fill.uniform_random((999,), np.float32, 0, 1, 42))
    loader.use_backend(kernel_emulator.EmuBackend(sm_count=7))
    np.testing.assert_array_equal(dev.get(fill.uniform_random((999,), np.float32, 0, 1, 42)),
                                  first)
