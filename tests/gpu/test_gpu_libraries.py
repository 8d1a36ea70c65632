"""cuBLAS and cuDNN (kernels/cuda/cublas.py, cudnn.py, libraries.py) on the kernel
emulator with the strict stand-ins of tests/kernel_emulator/fake_libraries.py, and
the hand-written fallback: every path against the float64 references; the split-K
filter gradient deterministic; the TF32 switch; errors naming the op, the library
call and its status string; a missing library falling back."""
from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest
from kernel_emulator.fake_libraries import installed
from launcher_harness import rel_err, rng
from references import conv2d as conv2d_ref
from references import conv2d_grad as conv2d_grad_ref

import minigraph as mg
from minigraph.kernels.cuda import batched_matmul, cublas, cudnn, launch, libraries, matmul

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ for the emulator")


@pytest.fixture
def small_workspaces(monkeypatch):
    monkeypatch.setattr(cublas, "WORKSPACE_BYTES", 1 << 16)
    monkeypatch.setattr(cudnn, "FIND_WORKSPACE_BYTES", 1 << 16)


@pytest.fixture(params=["fallback", "cublas", "cublas+cudnn"])
def libs(request, device, small_workspaces):
    """The emulator with no library (the hand-written kernels), the cuBLAS stand-in, or
    both stand-ins; yields (device arrays, FakeCublas or None, FakeCudnn or None)."""
    if not device.emulated:
        pytest.skip("the stand-ins run on the emulator")
    on = request.param
    with installed(cublas_on=on != "fallback", cudnn_on=on == "cublas+cudnn") as (fb, fd):
        yield device, fb, fd


CONVS = [((2, 3, 7, 6), (4, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1),
         ((3, 4, 9, 8), (6, 2, 3, 2), (2, 1), (0, 1), (1, 2), 2),
         ((2, 1, 6, 7), (3, 1, 5, 5), (1, 2), (2, 2), (1, 1), 1)]


@pytest.mark.parametrize("x_shape,w_shape,stride,pad,dil,groups", CONVS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_conv2d_every_path_matches_the_reference(libs, x_shape, w_shape, stride, pad, dil,
                                                  groups, dtype):
    from minigraph.kernels.cuda import conv2d

    device, fb, fd = libs
    r = rng(3)
    x, w = r.normal(size=x_shape).astype(dtype), r.normal(size=w_shape).astype(dtype)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    want = conv2d_ref(x, w, stride, pad, dil, groups)
    out = conv2d.conv2d(device.put(x), device.put(w), stride, pad, dil, groups)
    assert rel_err(device.get(out), want) < tol
    d = r.normal(size=want.shape).astype(dtype)
    dx, dw = conv2d.conv2d_grad(device.put(x), device.put(w), device.put(d), stride, pad, dil,
                                groups)
    want_dx, want_dw = conv2d_grad_ref(x, w, d, stride, pad, dil, groups)
    assert rel_err(device.get(dx), want_dx) < tol and rel_err(device.get(dw), want_dw) < tol
    names = {c[0] for c in (fd.calls if fd else [])}
    assert ("cudnnConvolutionBackwardFilter" in names) == (fd is not None)
    if fb is not None and fd is None:
        assert {c[0] for c in fb.calls} >= {"cublasGemmStridedBatchedEx_64"}


def test_cudnn_picks_the_fastest_deterministic_algorithm_once_per_shape(libs):
    from minigraph.kernels.cuda import conv2d

    device, _, fd = libs
    if fd is None:
        pytest.skip("cuDNN stand-in only")
    x, w = device.put(rng(1).normal(size=(2, 3, 5, 5))), device.put(rng(2).normal(size=(4, 3, 3,
                                                                                         3)))
    for _ in range(3):
        conv2d.conv2d(x, w, 1, 1)
    finds = [c for c in fd.calls if c[0].startswith("cudnnFind")]
    assert len(finds) == 1
    plan = next(iter(mg.kernels.cuda.loader.cached("cudnn.plans", dict).values()))
    assert plan.algos[("forward", 2)] == (2, 4096)     # algorithm 1 is faster, not deterministic


def test_cudnn_calls_share_one_workspace_and_allocate_only_their_outputs(libs, monkeypatch):
    """Every call works in the device's one workspace (a CUDA graph then holds one, not
    one per convolution); once the algorithms are found, a forward pass allocates its
    output only and a backward pass its dx and dfilter only."""
    from minigraph.kernels.cuda import conv2d, loader

    device, _, fd = libs
    if fd is None:
        pytest.skip("cuDNN stand-in only")
    made, empty = [], loader.empty

    def counting(shape, dtype, *args, **kwargs):
        made.append((tuple(shape), np.dtype(dtype)))
        return empty(shape, dtype, *args, **kwargs)

    monkeypatch.setattr(loader, "empty", counting)
    shapes = [((2, 3, 5, 5), (4, 3, 3, 3), (2, 4, 3, 3)), ((2, 4, 6, 6), (2, 4, 1, 1),
                                                          (2, 2, 6, 6))]
    arrays = [(device.put(rng(1).normal(size=xs)), device.put(rng(2).normal(size=ws)))
              for xs, ws, _ in shapes]
    for _ in range(2):                          # the first round finds the algorithms
        made.clear()
        for x, w in arrays:
            out = conv2d.conv2d(x, w, 1, 0)
            conv2d.conv2d_grad(x, w, out, 1, 0)
    assert made == [(shape, np.dtype(np.float64)) for xs, ws, ys in shapes
                    for shape in (ys, xs, ws)]
    state = loader.current()
    spaces = [k for k in state.scratch if isinstance(k, tuple) and k[0] == "cudnn"]
    assert len(spaces) == 1 and state.scratch[spaces[0]].nbytes == 4096


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("relu,bias,residual", [(True, True, True), (True, True, False),
                                                (False, True, True), (True, False, False)])
def test_fused_conv2d_one_call_or_one_epilogue(libs, dtype, relu, bias, residual):
    from minigraph.kernels.cuda import conv2d

    device, fb, fd = libs
    r = rng(4)
    x, w = r.normal(size=(2, 3, 6, 6)).astype(dtype), r.normal(size=(4, 3, 3, 3)).astype(dtype)
    b = r.normal(size=4).astype(dtype)
    res = r.normal(size=(2, 4, 6, 6)).astype(dtype)
    want = conv2d_ref(x, w, 1, 1) + (b[None, :, None, None] if bias else 0) + \
        (res if residual else 0)
    want = np.maximum(want, 0) if relu else want
    got = conv2d.fused_conv2d(device.put(x), device.put(w), device.put(b) if bias else None,
                              device.put(res) if residual else None, relu, paddings=1)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    assert rel_err(device.get(got), want) < tol
    fused = [c for c in (fd.calls if fd else []) if "BiasActivation" in c[0]]
    assert bool(fused) == (fd is not None and relu and bias)


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (65, 17, 130), (3, 700, 5)])
def test_matmul_every_path_matches_the_reference(libs, m, k, n):
    device, fb, _ = libs
    r = rng(5)
    a, b = r.normal(size=(m, k)), r.normal(size=(k, n))
    for ta, tb in ((False, False), (True, False), (False, True)):
        aa, bb = (a.T.copy() if ta else a), (b.T.copy() if tb else b)
        got = matmul.matmul(device.put(aa), device.put(bb), trans_a=ta, trans_b=tb)
        assert rel_err(device.get(got), a @ b) < 1e-12
    acc = device.put(np.ones((m, n)))
    matmul.matmul(device.put(a), device.put(b), out=acc, accumulate=True)
    assert rel_err(device.get(acc), a @ b + 1) < 1e-12
    x, y = r.normal(size=(4, 3, 5)), r.normal(size=(2, 1, 5, 6))
    got = batched_matmul.batched(device.put(x), device.put(y))
    assert rel_err(device.get(got), np.matmul(x, y)) < 1e-12


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True)])
def test_a_product_over_nothing_is_zero_on_every_path(libs, ta, tb):
    """k = 0: the leading dimension of an empty operand is 0, which cuBLAS refuses; the
    product is zeros, and an accumulated one leaves the output as it was."""
    device, _, _ = libs
    a, b = np.ones((3, 0)), np.ones((0, 4))
    aa, bb = (a.T.copy() if ta else a), (b.T.copy() if tb else b)
    got = matmul.matmul(device.put(aa), device.put(bb), trans_a=ta, trans_b=tb)
    np.testing.assert_array_equal(device.get(got), np.zeros((3, 4)))
    acc = device.put(np.full((3, 4), 2.0))
    matmul.matmul(device.put(aa), device.put(bb), trans_a=ta, trans_b=tb, out=acc,
                  accumulate=True)
    np.testing.assert_array_equal(device.get(acc), np.full((3, 4), 2.0))
    got = batched_matmul.batched(device.put(np.ones((2, 3, 0))), device.put(np.ones((0, 4))))
    np.testing.assert_array_equal(device.get(got), np.zeros((2, 3, 4)))


def test_fused_fc_epilogue_is_one_launch(libs):
    device, _, _ = libs
    r = rng(6)
    x, y, b = r.normal(size=(5, 7)), r.normal(size=(7, 3)), r.normal(size=3)
    out = matmul.mul(device.put(x), device.put(y))
    matmul.bias_act(out, device.put(b), None, True)
    assert rel_err(device.get(out), np.maximum(x @ y + b, 0)) < 1e-12


# ---- the hand-written fallback: split K, in a fixed order --------------------------------


def test_split_slices_fill_the_device_and_split_past_32_bits():
    dev = launch.DeviceInfo("test", (9, 0), sm_count=132)
    assert matmul.split_slices(16, 144, 128 * 1024, 1, dev) == matmul.MAX_SLICES
    assert matmul.split_slices(2048, 2048, 4096, 1, dev) == 1          # enough tiles already
    assert matmul.split_slices(64, 64, 300, 1, dev) == 1               # K too short to split
    assert matmul.split_slices(1, 1, 5 * 2**31, 1, dev) >= 3           # no slice past 2**31


def test_the_filter_gradient_is_split_and_deterministic(device, monkeypatch):
    """Without cuBLAS the filter gradient is one product over every image and pixel, its
    K split over the grid and summed in a fixed order: the emulator runs blocks in an
    order shuffled per launch, and the results are bit for bit the same."""
    from minigraph.kernels.cuda import conv2d

    if not device.emulated:
        pytest.skip("the fallback is what the emulator runs")
    monkeypatch.setattr(matmul, "SPLIT_MIN_K", 16)
    r = rng(7)
    x = r.normal(size=(6, 3, 8, 8)).astype(np.float32)
    w = r.normal(size=(4, 3, 3, 3)).astype(np.float32)
    d = r.normal(size=(6, 4, 8, 8)).astype(np.float32)
    dev = mg.kernels.cuda.loader.device()
    assert matmul.split_slices(4, 27, 6 * 64, 1, dev) > 1
    runs = [device.get(conv2d.conv2d_grad(device.put(x), device.put(w), device.put(d), 1, 1,
                                          need_dx=False)[1]) for _ in range(3)]
    _, want = conv2d_grad_ref(x.astype(np.float64), w.astype(np.float64), d, 1, 1)
    assert rel_err(runs[0], want) < 1e-5
    assert all(np.array_equal(runs[0], r_) for r_ in runs[1:])


def test_split_k_with_beta_and_groups(device, monkeypatch):
    if not device.emulated:
        pytest.skip("the fallback is what the emulator runs")
    monkeypatch.setattr(matmul, "SPLIT_MIN_K", 16)
    r = rng(8)
    g, m, n, k = 3, 5, 6, 200
    a, b, c = r.normal(size=(g, m, k)), r.normal(size=(g, n, k)), r.normal(size=(g, m, n))
    A, B, C = device.put(a), device.put(b), device.put(c)
    run = matmul.kernel_plan(np.float64, False, True, m, n, k, k, k, n, beta=True, batches=g,
                             strides=(m * k, 0, n * k, 0, m * n, 0))
    run(int(A.gpudata), int(B.gpudata), int(C.gpudata))
    assert rel_err(device.get(C), c + a @ b.transpose(0, 2, 1)) < 1e-12


# ---- TF32, errors, a missing library -------------------------------------------------------


def test_tf32_is_off_by_default_and_one_switch_turns_it_on(libs):
    device, fb, _ = libs
    if fb is None:
        pytest.skip("the cuBLAS stand-in records the compute type")
    r = rng(9)
    a, b = r.normal(size=(64, 256)).astype(np.float32), r.normal(size=(256, 32)).astype(
        np.float32)
    want = a.astype(np.float64) @ b
    assert not mg.tf32_enabled()
    assert rel_err(device.get(matmul.matmul(device.put(a), device.put(b))), want) < 1e-6
    old = mg.set_tf32(True)
    try:
        err = rel_err(device.get(matmul.matmul(device.put(a), device.put(b))), want)
    finally:
        mg.set_tf32(old)
    assert 1e-5 < err < 3e-3                # TF32: ~1e-3 relative at most
    computes = [c for c in fb.calls if c[0] == "cublasGemmEx_64"]
    assert computes


def test_a_library_error_names_the_op_the_call_and_the_status(libs):
    device, fb, _ = libs
    if fb is None:
        pytest.skip("cuBLAS stand-in only")
    x, y = device.put(np.ones((3, 4))), device.put(np.ones((4, 2)))
    matmul.mul(x, y)
    handle = cublas.handle()
    fb.handles[handle.value]["workspace"] = None       # what an unset workspace returns
    with pytest.raises(mg.GPUError, match=r"mul .*cublasGemmEx_64 failed with "
                                          r"CUBLAS_STATUS_EXECUTION_FAILED"):
        matmul.mul(x, y)


def test_a_handle_is_bound_to_its_context(small_workspaces):
    from kernel_emulator.fake_libraries import fake_cublas

    where = ["first"]
    fake, lib = fake_cublas(context=lambda: where[0])
    made = ctypes.c_void_p()
    assert lib.fn("cublasCreate_v2")(ctypes.byref(made)) == 0
    where[0] = "second"
    assert lib.fn("cublasSetStream_v2")(made.value, 0) == 1       # NOT_INITIALIZED
    with pytest.raises(ctypes.ArgumentError):
        lib.fn("cublasSetStream_v2")(made.value, 1.5)
    with pytest.raises(mg.GPUError, match="cublasSetStream_v2 failed with "
                                          "CUBLAS_STATUS_NOT_INITIALIZED"):
        lib.call("test", "cublasSetStream_v2", made.value, 0)


def test_without_the_libraries_the_fallback_runs_and_why_is_said(device, monkeypatch):
    monkeypatch.setenv("MINIGRAPH_CUBLAS", "off")
    assert libraries.find("cublas") == "MINIGRAPH_CUBLAS=off keeps it out"
    monkeypatch.setenv("MINIGRAPH_CUBLAS", "")
    listed = libraries.find("cublas", major=12)
    assert all(major in (12, None) for _, major, _ in listed)
    assert "nvidia-cublas-cu12" in libraries.pip_hint("cublas", 12)
    assert "nvidia-cudnn-cu13" in libraries.pip_hint("cudnn", 13)
