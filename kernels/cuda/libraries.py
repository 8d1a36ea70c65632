"""cuBLAS and cuDNN: finding their shared libraries, loading them with ctypes, their
status codes, and one handle per device context.

Where a library comes from. The `gpu` extra installs NVIDIA's wheels: cuBLAS from
`nvidia-cublas` (the CUDA 13 line: nvidia/cu13/lib/libcublas.so.13) or
`nvidia-cublas-cu12` (nvidia/cublas/lib/libcublas.so.12), cuDNN 9 from
`nvidia-cudnn-cu13` or `nvidia-cudnn-cu12` (both nvidia/cudnn/lib/libcudnn.so.9; the
installed distribution says which CUDA major it was built for). Like nccl4py's
cu12 / cu13 extras, a CUDA-12 build runs on drivers for CUDA 12 and 13, a CUDA-13
build only on drivers for CUDA 13: `find` takes the newest CUDA major the driver
supports among those installed, then a library of that soname on the loader's own
path (a system CUDA install). MINIGRAPH_CUBLAS / MINIGRAPH_CUDNN = "off" keeps a
library out (the hand-written kernels run instead); a path there loads that file.

Nothing here imports a library until the first GPU product or convolution asks for
it; then `library(name)` loads it once per process (None when it cannot: `why(name)`
says why). Each DeviceState keeps its handles in `state.libraries` (made with its
context current, bound to its stream, destroyed when the state is released).

Errors: a library call that fails raises GPUError naming the op, the library
call and the library's own status string (`Library.call`).
"""
from __future__ import annotations

import ctypes
import importlib.metadata
import importlib.util
import os
import threading
from dataclasses import dataclass, field

from minigraph.device import GPUError, current, entered

# (CUDA major, path under site-packages, the wheel's distribution) per library
WHEELS = {
    "cublas": ((13, "nvidia/cu13/lib/libcublas.so.13", "nvidia-cublas"),
               (12, "nvidia/cublas/lib/libcublas.so.12", "nvidia-cublas-cu12")),
    "cudnn": ((13, "nvidia/cudnn/lib/libcudnn.so.9", "nvidia-cudnn-cu13"),
              (12, "nvidia/cudnn/lib/libcudnn.so.9", "nvidia-cudnn-cu12")),
}
SONAMES = {"cublas": ((13, "libcublas.so.13"), (12, "libcublas.so.12")),
           "cudnn": ((None, "libcudnn.so.9"),)}
PIP = {"cublas": {13: "nvidia-cublas", 12: "nvidia-cublas-cu12"},
       "cudnn": {13: "nvidia-cudnn-cu13", 12: "nvidia-cudnn-cu12"}}
# what running without a library costs (gpu_check.py --only env prints it)
COST = {"cublas": "matrix products (fc, mul, matmul, the im2col convolutions) run on the "
                  "hand-written scalar fp32 GEMM: no tensor cores, a few times slower",
        "cudnn": "convolutions run as im2col + matrix products (cuBLAS where it loads): "
                 "more memory traffic and slower than cuDNN's kernels"}


@dataclass
class Library:
    """A loaded library: `name` (cublas / cudnn), the ctypes handle `lib`, where it
    came from, its CUDA major, version, and `status_string(code)`."""

    name: str
    lib: object
    path: str
    cuda_major: int | None
    version: str
    status_string: object = None
    functions: dict = field(default_factory=dict)

    def fn(self, name):
        """The library function `name`, typed from its module's declarations."""
        found = self.functions.get(name)
        if found is None:
            raise GPUError(f"{self.name}: {name} was not declared")
        return found

    def call(self, op, name, *args):
        """Call `name(*args)`; GPUError naming `op`, the call and the library's
        status string unless it returns 0 (success)."""
        code = self.fn(name)(*args)
        if code:
            raise GPUError(f"{op}: {name} failed with {self.status_string(code)} "
                           f"(status {int(code)}, {self.name} {self.version})")


def declare(lib, prototypes, c_types):
    """{name: the ctypes function `name` of `lib`, its result and argument types set
    from `prototypes` ({name: (C result type, [C parameter types])}) through
    `c_types` ({C type: ctypes type})}. AttributeError for a function the library
    lacks (an older version: it is then not used)."""
    found = {}
    for name, (result, params) in prototypes.items():
        fn = getattr(lib, name)
        fn.restype = c_types[result]
        fn.argtypes = [c_types[p] for p in params]
        found[name] = fn
    return found


_lock = threading.Lock()
_loaded = {}        # name -> Library or None (could not load), once per process
_why = {}           # name -> why it is not loaded
_overrides = {}     # name -> a stand-in Library (tests' fakes), see use()


def driver_major():
    """The CUDA major version the driver supports (pycuda's get_driver_version), or
    None where pycuda is not importable."""
    try:
        import pycuda.driver as drv
    except ImportError:
        return None
    return int(drv.get_driver_version()) // 1000


def site_dirs():
    """The folders the `nvidia` namespace package spans (where NVIDIA's wheels put
    their libraries), as their parents (site-packages)."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return []
    return [os.path.dirname(d) for d in spec.submodule_search_locations]


def distribution_version(dist):
    """The installed version of distribution `dist`, or None."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def candidates(name, major=None):
    """[(path or soname, CUDA major, distribution or None)] to try for library `name`
    in order: the installed wheels, newest CUDA major first, none newer than
    `major` (the driver's; None: any), then sonames on the loader's path."""
    found = []
    for cuda, rel, dist in WHEELS[name]:
        if major is not None and cuda > major:
            continue
        if distribution_version(dist) is None:
            continue
        for base in site_dirs():
            path = os.path.join(base, rel)
            if os.path.exists(path):
                found.append((path, cuda, dist))
                break
    for cuda, soname in SONAMES[name]:
        if major is None or cuda is None or cuda <= major:
            found.append((soname, cuda, None))
    return found


def _setting(name):
    """MINIGRAPH_<NAME> as ("off", None), ("path", the path) or (None, None)."""
    setting = os.environ.get(f"MINIGRAPH_{name.upper()}", "").strip()
    if setting.lower() in ("off", "0", "no", "false"):
        return "off", setting
    return ("path", setting) if setting else (None, None)


def find(name, major=None):
    """[(path or soname, CUDA major, distribution)] `load` tries for library `name`,
    or a str saying why there is none (MINIGRAPH_<NAME> read first, see the module
    doc)."""
    kind, setting = _setting(name)
    if kind == "off":
        return f"MINIGRAPH_{name.upper()}={setting} keeps it out"
    if kind == "path":
        return [(setting, None, None)]
    return candidates(name, major)


def load(name, declare, status_string, version_of):
    """The Library `name` loaded and declared (declare(lib) -> {function: typed
    ctypes function}), or None with the reason in why(name). Loaded once per
    process; a stand-in installed with `use` wins."""
    if name in _overrides:
        return _overrides[name]
    if name in _loaded:
        return _loaded[name]
    with _lock:
        if name not in _loaded:
            _loaded[name] = _try_load(name, declare, status_string, version_of)
    return _loaded[name]


def _try_load(name, declare, status_string, version_of):
    major = driver_major()
    listed = find(name, major)
    if isinstance(listed, str):
        _why[name] = listed
        return None
    tried = []
    for path, cuda, _ in listed:
        try:
            lib = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            functions = declare(lib)
        except (OSError, AttributeError) as e:
            tried.append(f"{path}: {e}")
            continue
        library = Library(name, lib, path, cuda, "?", None, functions)
        library.status_string = lambda code, f=functions: status_string(f, code)
        library.version = version_of(functions)
        return library
    driver = f" for a driver of CUDA {major}" if major is not None else ""
    _why[name] = (f"not installed{driver} ({pip_hint(name, major)})"
                  if all("cannot open shared object" in t for t in tried) else
                  "; ".join(tried))
    return None


def why(name):
    """Why library `name` did not load (after a failed load), else None."""
    return _why.get(name)


def pip_hint(name, major=None):
    """The pip command that installs library `name` for a driver of CUDA `major`."""
    dist = PIP[name][13 if (major or 13) >= 13 else 12]
    return f"pip install {dist}"


_epoch = [0]        # bumped by `use`: launch plans made before are stale


def plan_key():
    """What a product's or convolution's cached launch plan depends on besides its
    shapes: the libraries in use (stand-ins come and go in tests) and the TF32
    switch (minigraph.device.set_tf32)."""
    from minigraph.device import tf32_enabled

    return _epoch[0], tf32_enabled()


class use:
    """Context manager (tests): `use(name, library)` makes `library` (a stand-in
    with the same functions, or None: the library is missing) what every
    device loads as `name` inside the block, with fresh handles."""

    def __init__(self, name, library):
        self.name, self.library = name, library

    def __enter__(self):
        self.had = self.name in _overrides
        self.old = _overrides.get(self.name)
        _overrides[self.name] = self.library
        _epoch[0] += 1
        return self.library

    def __exit__(self, *exc):
        if self.had:
            _overrides[self.name] = self.old
        else:
            _overrides.pop(self.name, None)
        _epoch[0] += 1
        return False


def handle_of(name, make):
    """The handle of library `name` for the current device: `make(state)` once per
    device context and stand-in (with the context current), kept in
    state.libraries; None where the library is not used."""
    state = current()
    if state.context is None and name not in _overrides:
        return None             # an emulated device: only stand-ins, never a real library
    key = (name, id(_overrides.get(name)) if name in _overrides else None)
    found = state.libraries.get(key, False)
    if found is False:
        with entered(state):
            found = state.libraries[key] = make(state)
    return found


def release(state):
    """Destroy every library handle of `state` (call with its context current)."""
    for handle in list(state.libraries.values()):
        close = getattr(handle, "close", None)
        if close is not None:
            try:
                close()
            except GPUError:
                pass
    state.libraries.clear()
