"""benchmarks/bn_gpu.py end to end on the fake PyCUDA (its kernels on the emulator) with
a numpy stand-in for PyTorch: every case's launches, the kernel marks between them, the
per-case copy reference and the three tables, so the first GPU run does not stop on a
slip. The times are made up (the fake's events tick once per record)."""
from __future__ import annotations

import contextlib
import importlib.util
import pathlib
import sys
import types

import kernel_emulator  # noqa: F401 - fake_pycuda imports it by name
import numpy as np
import pytest
from kernel_emulator.fake_pycuda import FakeCuda

BENCH = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bn_gpu.py"


class FakeTensor:
    """What bn_gpu.py does with a torch tensor, on a numpy array."""

    def __init__(self, a):
        self.a = np.asarray(a)

    def to(self, device):
        return FakeTensor(self.a.copy())

    def permute(self, *axes):
        return FakeTensor(np.transpose(self.a, axes))

    def requires_grad_(self, flag=True):
        return self

    def detach(self):
        return FakeTensor(self.a)

    def clone(self):
        return FakeTensor(self.a.copy())

    def contiguous(self):
        return FakeTensor(np.ascontiguousarray(self.a))

    def cpu(self):
        return self

    def numpy(self):
        return self.a


def fake_torch():
    """A module with the few names bn_gpu.py uses."""
    def batch_norm(x, mean, var, w, b, training, momentum=0.1, eps=1e-5):
        a = x.a
        axes = (0,) + tuple(range(2, a.ndim))
        shape = (1, -1) + (1,) * (a.ndim - 2)
        m, v = (a.mean(axes), a.var(axes)) if training else (mean.a, var.a)
        return FakeTensor((a - m.reshape(shape)) / np.sqrt(v.reshape(shape) + eps)
                          * w.a.reshape(shape) + b.a.reshape(shape))

    def grad(outputs, inputs, grad_outputs, retain_graph=False):
        return tuple(FakeTensor(np.zeros_like(t.a)) for t in inputs)

    torch = types.ModuleType("torch")
    torch.__version__ = "fake"
    torch.device = lambda kind, index: (kind, index)
    torch.from_numpy = FakeTensor
    torch.no_grad = contextlib.nullcontext
    torch.nn = types.SimpleNamespace(functional=types.SimpleNamespace(
        batch_norm=batch_norm, relu=lambda t: FakeTensor(np.maximum(t.a, 0))))
    torch.autograd = types.SimpleNamespace(grad=grad)
    torch.cuda = types.SimpleNamespace(set_device=lambda i: None)
    torch.backends = types.SimpleNamespace(cudnn=types.SimpleNamespace(version=lambda: 0))
    return torch


@pytest.fixture
def bench(monkeypatch):
    spec = importlib.util.spec_from_file_location("bn_gpu_under_test", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "CASES", [
        ((4, 8, 7, 7), "NCHW", "float32"), ((16, 32), "NCHW", "float32"),
        ((2, 3, 2, 4, 4), "NCHW", "float32"), ((4, 4, 3, 3), "NCHW", "float64"),
        ((2, 5, 5, 8), "NHWC", "float32")])
    monkeypatch.setattr(module, "HOLD_VALUES", 1024)
    hold = module.Timer.hold           # the fake's made-up times would ask for millions of copies
    monkeypatch.setattr(module.Timer, "hold", lambda self, ms, copy_ms: hold(self, 0, 1))
    from minigraph.kernels.cuda import bn_resident

    monkeypatch.setattr(bn_resident, "THREADS", 64)      # fewer fibers: the emulator is slow
    monkeypatch.setitem(sys.modules, "torch", fake_torch())
    return module


def test_the_gpu_benchmark_runs_every_case_and_prints_its_tables(bench, capsys, tmp_path):
    from minigraph.kernels.cuda import loader

    prepared, launch = loader.Kernel.prepared, loader.Kernel.launch
    try:
        with FakeCuda(sm_count=2).install():
            bench.main(["--runs", "20", "--warmup", "1", "--json", str(tmp_path / "r.json")])
    finally:
        loader.Kernel.prepared, loader.Kernel.launch = prepared, launch
    out = capsys.readouterr().out
    tables = out.split("\n\n")
    assert len(tables) == 3, out
    first = [line for line in tables[0].splitlines() if " | " in line]
    assert first[0].split()[-1] == "mg/torch" and len(first) == 1 + 5 * 3
    for line in first[1:]:
        float(line.split()[-1])                          # the ratio is the last column
    kernels = tables[1]
    assert "bn_resident_train_f32" in kernels and "bn_resident_grad_f64" in kernels
    assert "bn_stats_rows_f32" in kernels and "bn_rows_normalize_f32" in kernels
    assert "(not measured)" not in kernels
    fused = [line for line in tables[2].splitlines() if " | " in line]
    assert fused[0].split()[-1] == "mg/torch" and len(fused) == 1 + 5 * 3
    assert "max |y_fused - relu(y_pair)|" in tables[2]
    assert (tmp_path / "r.json").exists()


def test_the_sync_chain_runs_the_sync_kernels_in_a_world_of_one(monkeypatch, capsys):
    """benchmarks/sync_bn_gpu.py's one-layer chain takes the sync kernels (local
    statistics, the finish from sums, the gradient sums and the gradient from sums), not
    batch norm's, and prints each with its time."""
    from minigraph.kernels.cuda import loader

    monkeypatch.syspath_prepend(str(BENCH.parent))
    spec = importlib.util.spec_from_file_location("sync_bn_gpu_under_test",
                                                  BENCH.parent / "sync_bn_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import bn_gpu

    hold = bn_gpu.Timer.hold
    monkeypatch.setattr(bn_gpu.Timer, "hold", lambda self, ms, copy_ms: hold(self, 0, 1))
    prepared, launch = loader.Kernel.prepared, loader.Kernel.launch
    try:
        with FakeCuda(sm_count=2).install():
            module.chain(module.parse(["--repeat", "20", "--warmup", "1", "--shape", "4", "3",
                                       "5", "5"]))
    finally:
        loader.Kernel.prepared, loader.Kernel.launch = prepared, launch
    out = capsys.readouterr().out
    forward = next(line for line in out.splitlines() if line.startswith("| forward"))
    backward = next(line for line in out.splitlines() if line.startswith("| backward"))
    for name in ("bn_local_stats_", "bn_stats_from_sums_f32", "bn_normalize_f32"):
        assert name in forward, forward
    for name in ("bn_grad_sums_", "bn_grad_from_sums_f32", "bn_grad_dx_f32"):
        assert name in backward, backward
    assert "bn_resident" not in forward + backward


def test_the_sync_benchmark_says_when_mpiexec_is_missing(monkeypatch, tmp_path):
    """Its rows launch `mpiexec -n K` beside the interpreter: without one it stops with
    that said, before any row, not with a traceback."""
    monkeypatch.syspath_prepend(str(BENCH.parent))
    spec = importlib.util.spec_from_file_location("sync_bn_gpu_no_mpiexec",
                                                  BENCH.parent / "sync_bn_gpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "MPIEXEC", str(tmp_path / "mpiexec"))
    with pytest.raises(SystemExit, match="no mpiexec next to .*pip install mpi4py mpich"):
        module.main(["--no-chain"])
