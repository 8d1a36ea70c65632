"""The device probes of benchmarks/gpu_check.py, each run in a process of its own:

    python benchmarks/gpu_probes.py versions   # Python, numpy, pycuda, the driver, NCCL, torch
    python benchmarks/gpu_probes.py load       # every kernel entry point on GPU 0, registers
    python benchmarks/gpu_probes.py thread     # a GPUPlace made and used on a worker thread

Exit status 0 when the probe passed. Needs a GPU (versions reports what it finds).
check_env (with required_versions: the pins of pyproject.toml's gpu extra) judges
the env step's output for gpu_check.py.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import platform
import re
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def show(label, get):
    """Print `label: get()`, or why it is unavailable."""
    try:
        print(f"{label}: {get()}")
    except Exception as e:  # anything a missing or broken library raises
        print(f"{label}: unavailable ({type(e).__name__}: {str(e)[:400]})")


def cuda_device():
    """The driver's CUDA version and GPU 0 as PyCUDA sees them."""
    import pycuda.driver as drv

    drv.init()
    v, dev = drv.get_driver_version(), drv.Device(0)
    return (f"driver CUDA {v // 1000}.{v % 1000 // 10}; {dev.name()}, compute capability "
            f"{dev.compute_capability()}; {drv.Device.count()} device(s)")


def nccl_version():
    """What nccl4py reports of itself and the libnccl it loaded."""
    import nccl

    get = getattr(nccl, "get_version", None) or importlib.import_module("nccl.core").get_version
    return get()


def torch_versions():
    """PyTorch and the CUDA, cuDNN and NCCL it was built with."""
    import torch

    gpu = torch.cuda.is_available()
    return (f"{torch.__version__}, CUDA {torch.version.cuda}, cuDNN "
            f"{torch.backends.cudnn.version()}, NCCL {torch.cuda.nccl.version() if gpu else '-'}"
            f", GPU available: {gpu}")


def gpu_library(name):
    """Where GPU library `name` (cublas / cudnn) loads from, or why it does not and
    what that costs (minigraph.kernels.cuda.libraries)."""
    from minigraph.kernels.cuda import cublas, cudnn, libraries

    lib = (cublas if name == "cublas" else cudnn).library()
    if lib is None:
        raise RuntimeError(f"{libraries.why(name)}; without it {libraries.COST[name]}")
    dists = [f"{d} {libraries.distribution_version(d)}" for _, _, d in libraries.WHEELS[name]
             if libraries.distribution_version(d)]
    return f"{lib.path} (CUDA {lib.cuda_major}; {lib.version}; {', '.join(dists) or 'no wheel'})"


def graph_capture():
    """Whether compiled plans can be replayed as CUDA graphs (cuda-bindings)."""
    from minigraph.kernels.cuda import graphs

    why = graphs.unavailable()
    if why is not None:
        raise RuntimeError(f"{why}; without it every step launches its kernels one by one")
    return f"cuda-bindings {importlib.metadata.version('cuda-bindings')}"


def versions():
    """Print the versions of everything the GPU code and the benchmarks use."""
    show("python", platform.python_version)
    for name in ("numpy", "pycuda", "nccl4py", "cupy", "mpi4py", "torch"):
        show(name, lambda name=name: importlib.metadata.version(name))
    show("pycuda device", cuda_device)
    show("NCCL (nccl4py)", nccl_version)
    show("cuBLAS", lambda: gpu_library("cublas"))
    show("cuDNN", lambda: gpu_library("cudnn"))
    show("CUDA graphs", graph_capture)
    show("torch build", torch_versions)
    return 0


def load():
    """Compile, load and fetch every entry point of every kernel module on GPU 0,
    printing each one's registers and static shared memory; 1 if any fails."""
    import minigraph as mg
    from minigraph.kernels.cuda import loader

    place = mg.GPUPlace(0)
    table, failed, count = loader.signature_table(), [], 0
    with place.activate():
        for module in loader.module_names():
            start, entries = time.perf_counter(), table.get(module) or {}
            if not entries:
                failed.append(f"{module}: no entry points in the signature table")
            for name, fmt in sorted(entries.items()):
                try:
                    res = getattr(loader.kernel(module, name, fmt), "resources", None)
                except Exception as e:  # a compile, load or prepare error: report, go on
                    failed.append(f"{module}.{name}: {type(e).__name__}: {e}")
                    continue
                count += 1
                print(f"  {module}.{name} ({fmt}): registers "
                      f"{getattr(res, 'regs_per_thread', '?')}, shared bytes "
                      f"{getattr(res, 'shared_bytes', '?')}")
            print(f"{module}: {len(entries)} entry points, {time.perf_counter() - start:.2f} s")
    print(f"{count} entry points loaded, {len(failed)} failed")
    print("\n".join(failed))
    return 1 if failed else 0


def thread():
    """Make GPUPlace(0) on a worker thread and copy an array through it (the
    pre-flight review's finding 1: the memory pool needs a current context)."""
    import numpy as np

    import minigraph as mg

    got = {}

    def work():
        try:
            place = mg.GPUPlace(0)
            got["value"] = place.to_host(place.to_device(np.arange(4.0))).tolist()
        except BaseException as e:  # reported below
            got["error"] = f"{type(e).__name__}: {e}"
    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    if got.get("value") != [0.0, 1.0, 2.0, 3.0]:
        print(f"a place made and used on a worker thread failed: {got}")
        return 1
    print("a place made and used on a worker thread: ok")
    return 0


# ---- the env step's verdict (benchmarks/gpu_check.py) --------------------------------------

def required_versions(pyproject=ROOT / "pyproject.toml"):
    """{package: (extra or None, minimum version tuple or None)} of pyproject.toml's
    gpu extra (read as text: no TOML parser needed)."""
    text = Path(pyproject).read_text()
    found = re.search(r"^gpu\s*=\s*\[(.*?)\]\s*$", text, re.M | re.S)
    wanted = {}
    for spec in re.findall(r'"([^"]+)"', found.group(1) if found else ""):
        name = re.match(r"[A-Za-z0-9_.-]+", spec)[0]
        extra = re.search(r"\[([^\]]+)\]", spec)
        least = re.search(r">=\s*([\d.]+)", spec)
        wanted[name.lower()] = (extra[1] if extra else None,
                                version_tuple(least[1]) if least else None)
    return wanted


def version_tuple(text):
    """(2025, 1, 2) of "2025.1.2" (the leading numbers; None when there are none)."""
    numbers = re.match(r"\d+(?:\.\d+)*", text.strip())
    return tuple(int(n) for n in numbers[0].split(".")) if numbers else None


def check_env(outputs):
    """The env step's verdict: (problem or None, notes). A problem: pycuda older than
    the gpu extra's pin with a CUDA 13 toolkit (it cannot build against CUDA 13's
    headers), or minigraph not installed (every later step would fail). Warnings:
    nvcc newer than the driver, a compute mode other than Default, pycuda or nccl4py
    below their pins, no usable NCCL (backend='auto' then falls back to MPI), no
    cuBLAS, cuDNN or cuda-bindings (each line says what running without it costs)."""
    notes, problem = [], None
    driver = re.search(r"CUDA Version\s*:\s*(\d+)\.(\d+)", outputs[0])
    nvcc = re.search(r"release (\d+)\.(\d+)", outputs[2])
    if driver and nvcc:
        notes.append(f"driver CUDA {driver[1]}.{driver[2]}, nvcc CUDA {nvcc[1]}.{nvcc[2]}")
        if int(nvcc[1]) > int(driver[1]):
            notes.append(f"WARNING: nvcc's CUDA major {nvcc[1]} is newer than the driver's "
                         f"{driver[1]}: kernels it builds will not load")
    if "Default" not in outputs[1]:
        notes.append("WARNING: compute mode is not Default (two ranks cannot share the GPU)")
    probe = outputs[4] if len(outputs) > 4 else ""
    installed = dict(re.findall(r"^(pycuda|nccl4py): (\S+)", probe, re.M))
    pins = {n: v for n, v in (required_versions() if probe else {}).items()
            if n in ("pycuda", "nccl4py")}          # the libraries: their own lines below
    for name, (extra, least) in pins.items():
        have = installed.get(name)
        have_v = version_tuple(have) if have else None
        pin = f"{name}{f'[{extra}]' if extra else ''}>={'.'.join(map(str, least or ()))}"
        if have_v is None:
            notes.append(f"WARNING: {name} is not installed (pip install '{pin}')")
        elif least and have_v < least:
            if name == "pycuda" and nvcc and int(nvcc[1]) >= 13:
                problem = (f"pycuda {have} cannot build against CUDA {nvcc[1]}'s headers: "
                           f"pip install '{pin}'")
            else:
                notes.append(f"WARNING: {name} {have} is older than the pin ({pin})")
    if re.search(r"No module named 'minigraph", probe):
        return ("minigraph is not installed in this interpreter (minigraph.kernels and "
                "minigraph.ops exist only through the install): pip install -e . in the "
                "repository root"), notes
    for label, hint in (("cuBLAS", "nvidia-cublas (CUDA 13 drivers) or nvidia-cublas-cu12"),
                        ("cuDNN", "nvidia-cudnn-cu13 or nvidia-cudnn-cu12"),
                        ("CUDA graphs", "cuda-bindings")):
        missing = re.search(rf"^{label}: unavailable \(\w+: (.*)\)$", probe, re.M)
        if missing:
            notes.append(f"WARNING: no {label} ({missing[1]}); pip install {hint}")
    if re.search(r"^NCCL \(nccl4py\): unavailable", probe, re.M):
        notes.append("WARNING: no usable NCCL (backend='auto' uses MPI): install the nccl4py "
                     "extra of the driver's CUDA major, nccl4py[cu12] or nccl4py[cu13]")
    return problem, notes


PROBES = {"versions": versions, "load": load, "thread": thread}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in PROBES:
        sys.exit(f"usage: python {sys.argv[0]} {{{'|'.join(PROBES)}}}")
    sys.exit(PROBES[sys.argv[1]]())
