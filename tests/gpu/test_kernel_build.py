"""Building the CUDA kernels, and what must hold before any of them runs.

- Every kernels/*.cu compiles with `nvcc -arch=sm_90 -ptx` (skipped only where no
  nvcc exists), and every entry point's parameters match the format its launcher
  passes (or, for a map-only module, the format kernels/cuda/map.py derives from its
  declarations). NVVM's optimizer is off (-Xcicc -O0): the entry points and their
  parameters do not depend on it, and it took half the compile time.
- Every .cu has a launcher beside it or is map-only; the loader's signature table
  holds the map-only modules.
- Importing minigraph, or any launcher, imports nothing from pycuda; launching
  without pycuda is a clear error; the GPU benchmark imports safely.
"""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from minigraph.kernels.cuda import launch, loader

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


# ---- compiling and signatures ------------------------------------------------------


@pytest.mark.skipif(NVCC is None, reason="no nvcc on this machine")
@pytest.mark.parametrize("cu", CU_FILES)
def test_kernel_compiles_for_sm90_and_matches_its_launcher(cu, tmp_path):
    ptx = tmp_path / (cu[:-3] + ".ptx")
    done = subprocess.run([NVCC, "-arch=sm_90", "-ptx", "-Xcicc", "-O0", "-I", str(KERNEL_DIR),
                           str(KERNEL_DIR / cu), "-o", str(ptx)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    entries = {name: re.findall(r"\.param\s+\.(\w+)", params) for name, params in
               re.findall(r"\.entry\s+(\w+)\s*\(([^)]*)\)", ptx.read_text())}
    signatures = loader.signature_table()[cu[:-3]]
    assert sorted(entries) == sorted(signatures), "kernels without a launcher entry, or back"
    for name, fmt in signatures.items():
        assert entries[name] == [PTX_KIND[c] for c in fmt], f"{name}: parameters vs {fmt!r}"


def test_every_module_has_a_launcher_beside_it_or_is_map_only():
    """A .cu is either beside its launcher .py, or map-only: every entry point
    declared with map.cuh's macros (kernels/cuda/map.py launches those)."""
    from minigraph.kernels.cuda import map as maps

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
    from minigraph.kernels.cuda import map as maps

    source = ("#include \"map.cuh\"\n// MG_UNARY_MAP(commented, x, x)\n"
              "/* MG_UNARY_MAP(blocked, x,\n x) */\n"
              "MG_UNARY_MAP(neg, x, -x)\n"
              "MG_BINARY_MAP_S(axpy, a, b, s, s * a + b)\n")
    assert maps.declarations(source) == [("MG_UNARY_MAP", "neg"), ("MG_BINARY_MAP_S", "axpy")]
    sigs = maps.source_signatures(source)
    assert sigs == {**{f"neg_{v}": "PPq" for v in ("f32_w1", "f32_w4", "f64_w1", "f64_w2")},
                    **{f"axpy_{v}": "PPPqd" for v in ("f32_w1", "f32_w4", "f64_w1", "f64_w2")}}
    two = maps.source_signatures("MG_UNARY_MAP_S2(clamp, x, lo, hi, x)\n"
                                 "MG_BINARY_MAP_S2(clamp_grad, x, d, lo, hi, d)\n")
    assert two["clamp_f32_w4"] == "PPqdd" and two["clamp_grad_f64_w1"] == "PPPqdd"
    with pytest.raises(ValueError, match="'neg' is declared twice"):
        maps.source_signatures(source + "MG_UNARY_MAP(neg, x, x)\n")
    for module in loader.module_names():
        assert set(maps.signatures(module)) <= set(loader.signature_table()[module])


def test_map_only_modules_are_in_the_signature_table():
    from minigraph.kernels.cuda import map as maps

    table = loader.signature_table()
    for module in ("sigmoid", "tanh", "gelu", "leaky_relu"):
        assert not loader.has_launcher(module)
        assert table[module] == maps.signatures(module)
    assert table["leaky_relu"]["leaky_relu_grad_f64_w2"] == "PPPqd"
    assert table["activation"]["relu_f32_w4"] == "PPq"


def test_row_block_size_agrees_with_the_header():
    header = (KERNEL_DIR / "common.cuh").read_text()
    assert f"ROW_THREADS = {launch.ROW_THREADS};" in header


# ---- import hygiene ------------------------------------------------------------------


def test_importing_minigraph_imports_nothing_from_pycuda():
    code = ("import sys, minigraph\n"
            "bad = [m for m in sys.modules if m.split('.')[0] == 'pycuda']\n"
            "assert not bad, bad\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_launchers_import_nothing_from_pycuda():
    code = ("import sys, minigraph, minigraph.kernels\n"
            "from minigraph.kernels.cuda import loader\n"
            "import importlib\n"
            "for m in [m for m in loader.module_names() if loader.has_launcher(m)]"
            " + ['loader', 'launch', 'map']:\n"
            "    importlib.import_module('minigraph.kernels.cuda.' + m)\n"
            "loader.signature_table()\n"
            "bad = [m for m in sys.modules if m.split('.')[0] == 'pycuda']\n"
            "assert not bad, bad\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_launching_without_pycuda_is_a_clear_error():
    code = ("import numpy as np\n"
            "from minigraph.kernels.cuda import fill\n"
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


# ---- kernels launched in place (pre-flight review finding 9) -------------------------------

def _top_level_split(text):
    """`text` split at the commas outside (), <>, {} and []."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += ch in "(<{[" and 1 or 0
        depth -= ch in ")>}]" and 1 or 0
        if ch == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    return parts + [text[start:].strip()]


def _restrict_on_aliased(source, entry, pair):
    """The parameters of the device function the entry point `entry` (in the
    preprocessed `source`) calls that receive the arguments at positions `pair`
    (in place: one buffer) and are declared __restrict__."""
    found = re.search(rf'extern "C" (?:__global__ )?void {entry}\s*\(([^)]*)\)\s*\{{', source)
    assert found, f"entry point {entry} not found"
    depth, end = 1, found.end()
    while depth:
        depth += {"{": 1, "}": -1}.get(source[end], 0)
        end += 1
    names = [p.split()[-1].lstrip("*&") for p in _top_level_split(found.group(1))]
    call = re.search(r"mg::(\w+)\s*(?:<[^;]*?>)?\s*\((.*)\)\s*;", source[found.end():end - 1],
                     re.S)
    assert call, f"{entry}: no mg:: call in its body"
    args = _top_level_split(call.group(2))
    at = [i for i, a in enumerate(args) if a in {names[k] for k in pair}]
    definition = re.search(rf"\bvoid\s+{call.group(1)}\s*\(([^)]*)\)\s*\{{", source)
    assert definition, f"{entry}: the definition of {call.group(1)} not found"
    params = _top_level_split(definition.group(1))
    return [params[i] for i in at if "__restrict__" in params[i]]


def test_kernels_launched_in_place_declare_no_restrict_on_the_shared_buffer(tmp_path):
    """Launchers that write into an input (the fused conv's bias, residual and relu,
    a mean's division, any map or broadcast with out=x) pass one buffer as two
    arguments. A __restrict__ on either lets the compiler read it through the
    read-only cache or reorder across them: nothing the kernels may rely on. The
    emulator records every launch with two pointer arguments at one address; the
    device functions behind those entry points must not declare them __restrict__."""
    import kernel_emulator
    import numpy as np
    from kernel_emulator import to_device

    from minigraph.kernels.cuda import activation, broadcast, elementwise
    from minigraph.kernels.cuda import reduce as reductions

    if shutil.which("g++") is None:
        pytest.skip("no g++ for the emulator")
    kernel_emulator.aliased.clear()
    rng = np.random.default_rng(0)
    with kernel_emulator.emulated_gpu():
        for dtype in (np.float32, np.float64):
            x = to_device(rng.normal(size=(2, 4, 3, 8)).astype(dtype))
            elementwise.add(x, to_device(rng.normal(size=4).astype(dtype)), axis=1, out=x)
            broadcast.add(x, to_device(rng.normal(size=(2, 4, 3, 8)).astype(dtype)), out=x)
            broadcast.add(x, to_device(rng.normal(size=(1, 4, 1, 8)).astype(dtype)), out=x)
            broadcast.multiply(x, to_device(rng.normal(size=(4, 1, 1)).astype(dtype)), out=x)
            activation.relu(x, out=x)
            reductions.reduce(x, "mean", axis=(0, 2, 3))
    assert {"relu_f32_w4", "relu_f64_w2"} <= {name for name, _ in kernel_emulator.aliased}
    modules = {name: m for m, entries in loader.signature_table().items() for name in entries}
    sources = {}
    bad = []
    for name, pair in sorted(kernel_emulator.aliased):
        module = modules[name]
        if module not in sources:
            done = subprocess.run(
                ["g++", "-std=c++17", "-E", "-P", "-I", str(KERNEL_DIR), "-include",
                 str(pathlib.Path(kernel_emulator.__file__).parent / "emu.h"), "-x", "c++",
                 str(KERNEL_DIR / f"{module}.cu")], capture_output=True, text=True, check=True)
            sources[module] = done.stdout
        restricted = _restrict_on_aliased(sources[module], name, pair)
        if restricted:
            bad.append(f"{module}.cu {name} (arguments {pair}, one buffer): {restricted}")
    assert not bad, "in-place kernels with __restrict__ on the shared buffer:\n" + "\n".join(bad)
