"""Compiling a kernel module for the emulator: its real .cu source with g++ against
emu.h, call wrappers for its entry points and the emulator's runtime, into one
shared library cached by content in <tmp>/minigraph-kernel-emulator.

runtime.cpp does not depend on the module, so its object is compiled once per
cache (it took more than half of building every module: 65 of 123 s) and linked
into each library, which keeps its own copy of the runtime's state."""
from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile

from minigraph.kernels.cuda import loader

HERE = pathlib.Path(__file__).parent
CXX = shutil.which("g++")
CXX_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-fno-strict-aliasing", "-w")
KERNEL_FLAGS = ("-fsanitize=alignment",)       # the kernel module only: handled in runtime.cpp
LINK_FLAGS = ("-shared", "-Wl,--no-undefined")

C_TYPES = {"P": ("void*", ctypes.c_void_p), "q": ("long long", ctypes.c_longlong),
           "Q": ("unsigned long long", ctypes.c_ulonglong), "i": ("int", ctypes.c_int),
           "I": ("unsigned", ctypes.c_uint), "d": ("double", ctypes.c_double),
           "f": ("float", ctypes.c_float)}


class BuildError(RuntimeError):
    """g++ refused a kernel module, its wrappers or the runtime."""


def cache_dir():
    """The directory the libraries and the runtime's object are cached in."""
    out_dir = pathlib.Path(tempfile.gettempdir()) / "minigraph-kernel-emulator"
    out_dir.mkdir(exist_ok=True)
    return out_dir


def _compile(cmd, what):
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise BuildError(f"g++ failed on {what}:\n{done.stderr[-4000:]}")


def _digest(paths, *texts):
    digest = hashlib.sha256()
    for p in paths:
        digest.update(p.read_bytes())
    for text in texts:
        digest.update(text.encode())
    return digest.hexdigest()[:16]


def runtime_object():
    """runtime.cpp compiled (with emu.h) once per content and flags; the object's
    path. Written under a name of its own and renamed into place, so processes that
    build it at once each find a whole object."""
    key = _digest([HERE / "runtime.cpp", HERE / "emu.h"], " ".join(CXX_FLAGS))
    obj = cache_dir() / f"runtime-{key}.o"
    if not obj.exists():
        part = obj.with_name(f"{obj.name}.{os.getpid()}.part")
        _compile([CXX, *CXX_FLAGS, "-I", str(HERE), "-c", str(HERE / "runtime.cpp"),
                  "-o", str(part)], "runtime.cpp")
        os.replace(part, obj)
    return obj


def build(module, signatures, kdir=None):
    """Compile <kdir>/<module>.cu (kdir: kernels/cuda) with emu.h and call wrappers
    for `signatures` ({entry point: format}); the library's path (cached by
    content)."""
    kdir = pathlib.Path(kdir) if kdir is not None else loader.kernel_dir()
    sources = [kdir / f"{module}.cu", *sorted(kdir.glob("*.cuh")), HERE / "emu.h",
               HERE / "runtime.cpp"]
    wrappers = ["#include <stddef.h>"]
    for name, fmt in sorted(signatures.items()):
        params = ", ".join(C_TYPES[c][0] for c in fmt)
        args = ", ".join(f"*({C_TYPES[c][0]}*)a[{i}]" for i, c in enumerate(fmt))
        wrappers.append(f'extern "C" void {name}({params});')
        wrappers.append(f'extern "C" void emu_wrap_{name}(void** a) {{ {name}({args}); }}')
    wrapper_src = "\n".join(wrappers) + "\n"
    key = _digest(sources, wrapper_src, " ".join(CXX_FLAGS + KERNEL_FLAGS + LINK_FLAGS))
    lib = cache_dir() / f"{module}-{key}.so"
    if lib.exists():
        return lib
    runtime = runtime_object()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        (tmp / "wrappers.cpp").write_text(wrapper_src)
        include = ["-I", str(kdir), "-I", str(HERE)]
        _compile([CXX, *CXX_FLAGS, *KERNEL_FLAGS, *include, "-x", "c++", "-include",
                  str(HERE / "emu.h"), "-c", str(kdir / f"{module}.cu"), "-o",
                  str(tmp / "kernels.o")], f"{module}.cu")
        _compile([CXX, *CXX_FLAGS, *include, "-c", str(tmp / "wrappers.cpp"), "-o",
                  str(tmp / "wrappers.o")], f"{module}.cu")
        _compile([CXX, *LINK_FLAGS, str(tmp / "kernels.o"), str(tmp / "wrappers.o"),
                  str(runtime), "-o", str(tmp / lib.name)], f"{module}.cu")
        shutil.move(str(tmp / lib.name), lib)
    return lib
