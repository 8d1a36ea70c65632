"""Compiling the CUDA kernel modules once per device and launching them.

Every launcher goes through `kernel(module, name, fmt)` and `empty(shape,
dtype)`; both work on the device current on this thread (minigraph.device:
the place a `with place.activate():` block entered, else the only GPU place).
A launch or an allocation outside such a block pushes and pops the device's
context around itself.

Modules are compiled with the `nvcc` first on PATH for the device's own
architecture (sm_XY), -O3 and no fast-math (exact IEEE division and square
roots), this directory on the include path for common.cuh; once per
(context, module) per process, on top of PyCUDA's disk cache. Before the first
compile the toolkit is compared with the driver (backend.check_toolkit).
The PyCUDA backend itself lives in backend.py.
"""
from __future__ import annotations

import functools
import importlib.resources
import pathlib
import threading

import numpy as np

from minigraph.device import GPUError, backend, current, entered, is_entered, thread_state
from minigraph.kernels.cuda import launch

NVCC_OPTIONS = ("-O3", "-std=c++17")
SCRATCH_SLACK = 16 << 20        # bytes a growing scratch buffer may take beyond the request


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


def ptr(array, name="array"):
    """The device address of an array (0 - a null pointer - for None, and for an
    empty GPUArray, which PyCUDA gives no allocation). ValueError, naming the
    array, unless it is C-contiguous: every kernel reads arrays as contiguous."""
    if array is None or array.gpudata is None:
        return 0
    if not array.flags.c_contiguous:
        raise ValueError(f"{name}: a {np.dtype(array.dtype)}{tuple(array.shape)} device array "
                         f"with strides {tuple(getattr(array, 'strides', ()))} is not "
                         "C-contiguous; the GPU kernels read arrays as contiguous (copy it)")
    return int(array.gpudata)


class Kernel:
    """One compiled entry point of one device: `launch(grid, block, *args)`
    enqueues it on that device's stream (DeviceState.stream; asynchronous:
    nothing waits for it), with the device's context current. `launch` (the backend's) takes
    (grid, block, args, shared=0); `enqueue`, when the backend has one, takes (grid, block,
    stream, *args, shared_size=0) and is what `launch` calls (PyCUDA's prepared_async_call).
    `shared`: bytes of dynamic shared memory a block gets; past 48 KiB a kernel needs
    `allow_shared` first (the backend's `allow_shared(nbytes)`: CUDA's function attribute
    MAX_DYNAMIC_SHARED_SIZE_BYTES)."""

    def __init__(self, name, fmt, launch, resources, state=None, enqueue=None,
                 allow_shared=None):
        self.name = name
        self.fmt = fmt
        self._launch = launch
        self.resources = resources
        self.state = state
        self._enqueue = enqueue
        self._allow_shared = allow_shared
        self.shared_allowed = 0

    def allow_shared(self, nbytes):
        """Let launches of this kernel ask for up to `nbytes` of dynamic shared memory
        (once per value, on the kernel's device)."""
        nbytes = int(nbytes)
        if nbytes <= self.shared_allowed:
            return
        if self._allow_shared is None:
            raise GPUError(f"kernel {self.name}: this backend cannot raise the dynamic "
                           "shared-memory limit")
        if self.state is None or is_entered(self.state):
            self._allow_shared(nbytes)
        else:
            with entered(self.state):
                self._allow_shared(nbytes)
        self.shared_allowed = nbytes

    def launch(self, grid, block, *args):
        if len(args) != len(self.fmt):
            raise TypeError(f"kernel {self.name}: expected {len(self.fmt)} arguments "
                            f"({self.fmt}), got {len(args)}")
        if min(grid) <= 0:
            return
        grid = tuple(int(g) for g in grid)
        block = tuple(int(b) for b in block)
        if self.state is None or is_entered(self.state):
            self._launch(grid, block, args)
        else:
            with entered(self.state):
                self._launch(grid, block, args)

    def prepared(self, grid, block, shared=0):
        """go(*args): `launch(grid, block, *args)` with the grid and block normalised
        and checked once, for launch plans that launch one configuration every
        step (nothing launched for a grid with a zero extent); `shared` bytes of
        dynamic shared memory per block (see allow_shared)."""
        grid = tuple(int(g) for g in grid)
        block = tuple(int(b) for b in block)
        shared = int(shared)
        if min(grid) <= 0:
            return _no_launch
        run, state, enqueue = self._launch, self.state, self._enqueue
        if shared:
            def run(grid, block, args, launch=run):
                launch(grid, block, args, shared)
        if state is None:
            return lambda *args: run(grid, block, args)
        if enqueue is None:
            def enqueue(grid, block, stream, *args, shared_size=0):
                run(grid, block, args)

        def go(*args):
            stack = getattr(thread_state, "stack", None)
            if stack and stack[-1] is state:
                enqueue(grid, block, state.stream, *args, shared_size=shared)
            else:
                with entered(state):
                    run(grid, block, args)
        return go


def _no_launch(*args):
    """The prepared launch of an empty grid."""


# ---- what launchers call ---------------------------------------------------------

def device():
    """DeviceInfo of the device the kernels run on."""
    return current().info


def kernel(module, name, fmt):
    """The Kernel `name` of `module`, compiled once per device context; `fmt` is
    its argument format (struct letters: P pointer, q int64, i int32, I uint32,
    Q uint64, d double, f float), checked against the PTX by the tests."""
    return backend().kernel(module, name, fmt)


def empty(shape, dtype):
    """An uninitialised device array on the current device (from its pool)."""
    stack = getattr(thread_state, "stack", None)
    if stack:                       # entered: the backend's array maker, if it made one
        make = stack[-1].arrays.get((shape, dtype)) if type(shape) is tuple else None
        if make is not None:
            return make()
    return backend().empty(shape, dtype)


def empty_group(shapes, dtype):
    """Uninitialised device arrays of `shapes` (a tuple of shape tuples) and
    `dtype`, carved from ONE pooled allocation of the current device: for
    outputs made and dropped together (batch norm's per-channel statistics).
    They never overlap, each starts on a 256-byte boundary, and the allocation
    goes back to the pool when the last of them is dropped. A backend without
    groups makes them one by one."""
    stack = getattr(thread_state, "stack", None)
    if stack:
        make = stack[-1].arrays.get(("group", shapes, dtype))
        if make is not None:
            return make()
    group = getattr(backend(), "empty_group", None)
    if group is None:
        return [empty(s, dtype) for s in shapes]
    return group(shapes, dtype)


def copy(array):
    """A new device array (from the current device's pool) holding a copy of
    device `array`, of any dtype; nothing crosses to the host."""
    return backend().copy(array)


def to_device(array):
    """A device copy of numpy `array` on the current device (from its pool)."""
    return backend().to_device(np.require(array, requirements="C"))


def cached(key, make):
    """A per-device launcher cache entry: `make()` once per device and key."""
    cache = current().cache
    found = cache.get(key)
    if found is None:
        found = cache[key] = make()
    return found


def launch_flat(module, signatures, template, dtype, total, arrays, *scalars):
    """Launch the kernel named by `template` ('{t}' -> f32/f64 of `dtype`, '{w}'
    -> the pack width) over `total` elements: the device pointers of `arrays`,
    then `scalars`. Packs of 16 bytes when every array is aligned, else 1."""
    pointers = pointers_of(arrays, module, template)
    aligned = launch.is_aligned(*pointers)
    configs = cached("loader.flat", dict)
    key = (module, template, dtype, total, aligned)
    go = configs.get(key)
    if go is None:
        width = launch.vector_width(np.dtype(dtype).itemsize) if aligned else 1
        name = template.format(t=suffix(dtype), w=width)
        k = kernel(module, name, signatures[name])
        dev = device()
        threads = launch.block_threads(dev)
        grid = launch.flat_grid(-(-total // width), dev, threads, k.resources)
        go = configs[key] = k.prepared((grid, 1, 1), (threads, 1, 1))
    go(*pointers, *scalars)


def flat_go(module, name, fmt, items, at_least=1):
    """The prepared launch (Kernel.prepared) of kernel `name` of `module` as a
    grid-stride loop over `items` work items (launch.flat_grid, at least
    `at_least` threads), made once per device, kernel and size."""
    gos = cached("loader.flat_go", dict)
    key = (module, name, items, at_least)
    go = gos.get(key)
    if go is None:
        k = kernel(module, name, fmt)
        dev = device()
        threads = launch.block_threads(dev)
        grid = launch.flat_grid(items, dev, threads, k.resources, at_least=at_least)
        go = cache_put(gos, key, k.prepared((grid, 1, 1), (threads, 1, 1)))
    return go


def rows_go(module, name, fmt, rows, row_length):
    """The prepared launch of a one-block-per-row kernel over `rows` rows of
    `row_length` values (launch.row_block_threads, launch.rows_grid), made once
    per device, kernel and size."""
    gos = cached("loader.rows_go", dict)
    key = (module, name, rows, row_length)
    go = gos.get(key)
    if go is None:
        k = kernel(module, name, fmt)
        dev = device()
        threads = launch.row_block_threads(row_length, dev)
        grid = launch.rows_grid(rows, threads, dev, k.resources)
        go = cache_put(gos, key, k.prepared((grid, 1, 1), (threads, 1, 1)))
    return go


def cache_put(cache, key, value, limit=4096):
    """cache[key] = value (returned), the cache emptied first when it holds `limit`
    entries: launcher caches keyed by shapes stay bounded."""
    if len(cache) >= limit:
        cache.clear()
    cache[key] = value
    return value


def address(array):
    """The device address of an array the loader made (empty, empty_group,
    copy, to_device, tickets: C-contiguous by construction), without ptr's
    contiguity check; 0 for None and for an empty array."""
    if array is None or array.gpudata is None:
        return 0
    return int(array.gpudata)


def pointers_of(arrays, module, name):
    """[ptr(a) for a in arrays], the error naming `module`.`name` and the array's
    place in `arrays` (the name is made only for an error)."""
    found = []
    for i, a in enumerate(arrays):
        if a is None or a.gpudata is None:
            found.append(0)
        elif a.flags.c_contiguous:
            found.append(int(a.gpudata))
        else:
            ptr(a, f"{module}.{name}: array {i}")
    return found


def scratch(count, dtype, owner=None):
    """The device address of room for `count` values of `dtype`, for temporaries
    that live between the launches of one launcher call (coefficients, split
    partials): one buffer per device and calling thread, grown as needed and
    handed out again at the thread's next call - safe, because one thread's
    launches run in order on the device's stream. No allocation once warm.
    A launcher holding scratch must not call another launcher that takes it.
    The buffer doubles when it grows, by at most SCRATCH_SLACK bytes more than
    asked for (conv2d's columns may take hundreds of MiB). `owner` (a name) gives
    a buffer of its own, besides the launchers' shared one (cuDNN's workspace)."""
    state = current()
    nbytes = max(int(count), 1) * np.dtype(dtype).itemsize
    key = threading.get_ident() if owner is None else (owner, threading.get_ident())
    have = state.scratch.get(key)
    if have is None or have.nbytes < nbytes:
        doubled = 2 * have.nbytes if have is not None else 0
        grown = max(nbytes, min(doubled, nbytes + SCRATCH_SLACK), 4096)
        have = state.scratch[key] = empty((grown,), np.uint8)
    return int(have.gpudata)



def tickets(count):
    """A device array of at least `count` uint32 zeros for last-block-done
    counters. Kernels leave their tickets at zero when they finish, so one
    array serves every launch on the device's stream."""
    state = current()
    have = state.tickets
    if have is None or have.size < count:
        from minigraph.kernels.cuda import fill

        have = empty((max(count, 1024, 2 * (have.size if have is not None else 0)),), np.uint32)
        fill.fill_constant(have, 0)
        state.tickets = have
    return have


def error_flag(what, make):
    """The device-side error record named `what` (e.g. "batch_norm") of the
    current device, made by `make()` on first use (a
    softmax_with_cross_entropy.LabelStatus, a batch_norm.Guard: anything whose
    `check(what)` raises for what kernels flagged since its last check).
    minigraph.device.check_flags checks every one of them."""
    flags = current().flags
    found = flags.get(what)
    if found is None:
        found = flags[what] = make()
    return found


def has_launcher(module):
    """True when kernels/<module>.cu has a launcher module beside it; without one
    it is map-only (every entry point declared with kernels/cuda/map.cuh's macros)."""
    return importlib.resources.files(__package__).joinpath(f"{module}.py").is_file()


@functools.cache
def signature_table():
    """{module: {kernel name: format}} of every kernel module: its map declarations
    (kernels/cuda/map.py reads them from the source) and its launcher's SIGNATURES."""
    import importlib

    from minigraph.kernels.cuda import map as maps

    table = {}
    for m in module_names():
        table[m] = dict(maps.signatures(m))
        if has_launcher(m):
            table[m].update(getattr(importlib.import_module(f"{__package__}.{m}"),
                                    "SIGNATURES", {}))
    return table
