"""Compiling the kernel modules once per process and launching them.

Every launcher goes through `kernel(module, name, fmt)` and `empty(shape,
dtype)`; both ask the current backend. The default backend is PyCUDA on the
current CUDA context (a `minigraph.GPUPlace` makes the device's primary
context current); PyCUDA is imported only when the first kernel or array is
asked for, so importing the launchers on a CPU-only machine imports nothing
from it. Tests may install another backend with `use_backend`.

Modules are compiled with nvcc for the device's own architecture (sm_XY from
its compute capability), -O3 and no fast-math (exact IEEE division and
square roots), with this directory on the include path for common.cuh;
one compile per (context, module) per process, on top of PyCUDA's disk cache.
"""
from __future__ import annotations

import functools
import importlib.resources
import pathlib

import numpy as np

from minigraph.kernels import launch
from minigraph.kernels.launch import DeviceInfo, KernelResources

NVCC_OPTIONS = ("-O3", "-std=c++17")


def kernel_dir():
    """The directory holding the .cu and .cuh files (a real directory: the
    package is installed unzipped)."""
    return pathlib.Path(str(importlib.resources.files(__package__)))


def module_names():
    """Every kernel module: the .cu files of this package, without the suffix."""
    return sorted(p.name[:-3] for p in importlib.resources.files(__package__).iterdir()
                  if p.name.endswith(".cu"))


def read_source(module):
    """The CUDA source of `module` (e.g. 'batch_norm')."""
    return importlib.resources.files(__package__).joinpath(f"{module}.cu").read_text()


def suffix(dtype):
    """The kernel-name suffix of a float dtype: 'f32' or 'f64'."""
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return "f32"
    if dtype == np.float64:
        return "f64"
    raise TypeError(f"GPU kernels take float32 or float64 arrays, got {dtype}")


def ptr(array):
    """The device address of an array (0 - a null pointer - for None, and for an
    empty GPUArray, which PyCUDA gives no allocation)."""
    if array is None or array.gpudata is None:
        return 0
    return int(array.gpudata)


class Kernel:
    """One compiled entry point: `launch(grid, block, *args)` enqueues it on the
    default stream (asynchronous: nothing waits for it)."""

    def __init__(self, name, fmt, launch, resources):
        self.name = name
        self.fmt = fmt
        self._launch = launch
        self.resources = resources

    def launch(self, grid, block, *args):
        if len(args) != len(self.fmt):
            raise TypeError(f"kernel {self.name}: expected {len(self.fmt)} arguments "
                            f"({self.fmt}), got {len(args)}")
        if min(grid) <= 0:
            return
        self._launch(tuple(int(g) for g in grid), tuple(int(b) for b in block), args)


class PyCudaBackend:
    """Kernels and arrays through PyCUDA on the current context."""

    def __init__(self):
        import pycuda.driver as drv
        import pycuda.gpuarray as gpuarray

        self.drv = drv
        self.gpuarray = gpuarray
        self._state = {}

    def _context_state(self):
        ctx = self.drv.Context.get_current()
        if ctx is None:
            raise RuntimeError("no CUDA context is current: create minigraph.GPUPlace(i) "
                               "before launching kernels")
        state = self._state.get(ctx)     # Context objects hash and compare by handle
        if state is None:
            from pycuda.tools import DeviceMemoryPool

            state = self._state[ctx] = {"device": _device_info(self.drv),
                                        "pool": DeviceMemoryPool(), "modules": {},
                                        "kernels": {}}
        return state

    def device(self):
        """DeviceInfo of the current context's device."""
        return self._context_state()["device"]

    def kernel(self, module, name, fmt):
        state = self._context_state()
        found = state["kernels"].get((module, name))
        if found is not None:
            return found
        mod = state["modules"].get(module)
        if mod is None:
            from pycuda.compiler import SourceModule

            mod = state["modules"][module] = SourceModule(
                read_source(module), options=list(NVCC_OPTIONS), arch=state["device"].arch,
                include_dirs=[str(kernel_dir())], no_extern_c=True)
        fn = mod.get_function(name)
        fn.prepare(fmt)
        res = KernelResources(regs_per_thread=fn.num_regs, shared_bytes=fn.shared_size_bytes)

        def launch(grid, block, args):
            fn.prepared_async_call(grid, block, None, *args)

        found = state["kernels"][(module, name)] = Kernel(name, fmt, launch, res)
        return found

    def empty(self, shape, dtype):
        """An uninitialised GPUArray from the context's memory pool (no cudaMalloc
        and no synchronisation once the pool holds a block of that size)."""
        pool = self._context_state()["pool"]
        return self.gpuarray.empty(tuple(shape), np.dtype(dtype), allocator=pool.allocate)


def _device_info(drv):
    dev = drv.Context.get_device()
    attrs = dev.get_attributes()
    a = drv.device_attribute

    def get(name, default):
        key = getattr(a, name, None)
        return attrs.get(key, default) if key is not None else default

    return DeviceInfo(
        name=dev.name(), compute_capability=tuple(dev.compute_capability()),
        sm_count=get("MULTIPROCESSOR_COUNT", 1),
        max_threads_per_block=get("MAX_THREADS_PER_BLOCK", 1024),
        max_threads_per_sm=get("MAX_THREADS_PER_MULTIPROCESSOR", 2048),
        max_blocks_per_sm=get("MAX_BLOCKS_PER_MULTIPROCESSOR", 16),
        regs_per_sm=get("MAX_REGISTERS_PER_MULTIPROCESSOR", 65536),
        shared_per_sm=get("MAX_SHARED_MEMORY_PER_MULTIPROCESSOR", 48 * 1024),
        max_grid=(get("MAX_GRID_DIM_X", 2**31 - 1), get("MAX_GRID_DIM_Y", 65535),
                  get("MAX_GRID_DIM_Z", 65535)),
        total_memory=dev.total_memory())


_backend = None


def backend():
    """The backend in use (PyCUDA unless a test installed another)."""
    global _backend
    if _backend is None:
        try:
            _backend = PyCudaBackend()
        except ImportError as e:
            raise RuntimeError(f"minigraph GPU kernels need pycuda and a CUDA driver "
                               f"(pip install 'minigraph[gpu]'): {e}") from e
    return _backend


def use_backend(new):
    """Install `new` as the backend (None: back to PyCUDA, lazily); returns the old one."""
    global _backend
    old, _backend = _backend, new
    _workspace_cache.clear()
    _error_flags.clear()
    return old


def device():
    """DeviceInfo of the device the kernels run on."""
    return backend().device()


def kernel(module, name, fmt):
    """The Kernel `name` of `module`, compiled once per context; `fmt` is its
    argument format (struct letters: P pointer, q int64, i int32, I uint32,
    Q uint64, d double, f float), checked against the PTX by the tests."""
    return backend().kernel(module, name, fmt)


def empty(shape, dtype):
    """An uninitialised device array."""
    return backend().empty(shape, dtype)


def launch_flat(module, signatures, template, dtype, total, arrays, *scalars):
    """Launch the kernel named by `template` ('{t}' -> f32/f64 of `dtype`, '{w}'
    -> the pack width) over `total` elements: the device pointers of `arrays`,
    then `scalars`. Packs of 16 bytes when every array is aligned, else 1."""
    sfx = suffix(dtype)
    width = launch.vector_width(np.dtype(dtype).itemsize)
    if not launch.is_aligned(*(ptr(a) for a in arrays)):
        width = 1
    name = template.format(t=sfx, w=width)
    k = kernel(module, name, signatures[name])
    dev = device()
    threads = launch.block_threads(dev)
    grid = launch.flat_grid(-(-total // width), dev, threads, k.resources)
    k.launch((grid, 1, 1), (threads, 1, 1), *(ptr(a) for a in arrays), *scalars)


_workspace_cache = {}


def tickets(count):
    """A device array of at least `count` uint32 zeros for last-block-done
    counters. Kernels leave their tickets at zero when they finish, so one
    array serves every launch on the stream."""
    key = (id(backend()), _context_key())
    have = _workspace_cache.get(key)
    if have is None or have.size < count:
        from minigraph.kernels import fill

        have = empty((max(count, 1024, 2 * (have.size if have is not None else 0)),), np.uint32)
        fill.fill_constant(have, 0)
        _workspace_cache[key] = have
    return have


def _context_key():
    b = backend()
    return b.drv.Context.get_current() if isinstance(b, PyCudaBackend) else None


_error_flags = {}


def error_flag(what, make):
    """The device-side error record named `what` (e.g. "batch_norm") of the
    current backend, made by `make()` on first use (a
    softmax_with_cross_entropy.LabelStatus, a batch_norm.Guard: anything whose
    `check(what)` raises for what kernels flagged since its last check).
    `check_flags` checks every one of them."""
    found = _error_flags.get(what)
    if found is None:
        found = _error_flags[what] = make()
    return found


def check_flags():
    """Check every error_flag (one small synchronising read each) and raise the
    first error found, with the messages of any others appended; every flag
    is read and reset first, so nothing is reported twice."""
    errors = []
    for what, flag in list(_error_flags.items()):
        try:
            flag.check(what)
        except Exception as e:  # each flag raises its own error type
            errors.append(e)
    if errors:
        first = errors[0]
        if len(errors) > 1 and first.args and isinstance(first.args[0], str):
            first.args = (first.args[0] + "".join(f"\nalso: {e}" for e in errors[1:]),
                          *first.args[1:])
        raise first


@functools.cache
def signature_table():
    """{module: {kernel name: format}} over every launcher module (for the tests)."""
    import importlib

    return {m: dict(importlib.import_module(f"{__package__}.{m}").SIGNATURES)
            for m in module_names()}
