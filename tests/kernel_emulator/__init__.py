"""A CPU emulator for the CUDA kernels in kernels/, for tests on machines with no GPU.

`EmuBackend` compiles a kernel module's real .cu source with g++ against
emu.h (a stand-in for the CUDA runtime: cooperative fibers per block, see
there) and plugs into minigraph.kernels.cuda.loader in place of PyCUDA, so the real
launchers run unchanged on `EmuArray`s (host buffers shaped like GPUArrays,
poisoned with NaN bytes and fenced with canaries that are checked after
every launch). It checks the kernels' logic - indexing, reductions, the
last-block merges, the launch plans - and what the hardware and PyCUDA
refuse: arguments are packed with PyCUDA's rules (struct: a float for an int
parameter, or a value out of range, raises struct.error), grids and blocks
must fit the hardware's limits, a block's static shared memory (measured: the
__shared__ variables a block changed) plus the dynamic shared memory its
launch asked for must fit in SHARED_LIMIT bytes - or, after
`Kernel.allow_shared(n)` raised the kernel's limit (CUDA's function
attribute MAX_DYNAMIC_SHARED_SIZE_BYTES), the dynamic part must fit in n and
both in OPTIN_LIMIT (sm_90's 227 KiB) - a block must not write outside its
dynamic shared memory, and every access must be aligned to its type (16
bytes for a pack). Not checked:
speed, the memory model, anything else a real GPU would add (races between
blocks, float contraction). Kernels launched with two pointer arguments at
one address (in place) are recorded in `aliased`.
`EmuPlace` is a GPU place on top of it (`emulated_gpu()` installs both), so
the Executor runs the ops' GPU kernel bindings on it.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import struct
import subprocess
import threading
import weakref
from types import SimpleNamespace

import numpy as np

from minigraph import device
from minigraph.kernels.cuda import loader
from minigraph.kernels.cuda.launch import DeviceInfo, KernelResources
from minigraph.place import GPUPlace

from .toolchain import C_TYPES, BuildError, build  # noqa: F401 (BuildError, build: its API)

SHARED_LIMIT = 48 * 1024      # bytes of shared memory a block may have (static + dynamic)
OPTIN_LIMIT = 227 * 1024      # ... once the kernel's function attribute allows more (sm_90)
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_BLOCK = (1024, 1024, 64)
PAD = 64                      # canary bytes on each side of an array
CANARY = 0xA5
POISON = 0xFF                 # fresh arrays: NaN for floats, -1 for ints

class EmulatorError(RuntimeError):
    """A launch failed in the emulator (deadlock, out-of-bounds write, misaligned
    access, a grid, block or shared memory the hardware refuses)."""


_live = weakref.WeakSet()
# Ranks run on threads (test_nccl.py), but a library's runtime state (fibers, barriers,
# shared memory) is one, and ctypes lets go of the GIL: one launch at a time, and _live
# is changed and listed under the same lock (a set changed while listed raises).
_launch_lock = threading.Lock()
aliased = set()           # (kernel name, (i, j)): pointer arguments i and j were one address


class EmuArray:
    """A host buffer that launchers treat as a device array (gpudata, shape,
    dtype, size, get()); `offset` elements shift its start (to test unaligned
    data)."""

    def __init__(self, shape, dtype, fill=POISON, offset=0):
        self.shape = tuple(int(d) for d in (shape if isinstance(shape, tuple | list)
                                            else (shape,)))
        self.dtype = np.dtype(dtype)
        self.size = math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize
        shift = offset * self.dtype.itemsize
        self._raw = np.empty(self.nbytes + shift + 3 * PAD, np.uint8)
        self._start = (-self._raw.ctypes.data) % PAD + PAD + shift
        self._raw[:] = CANARY
        self._raw[self._start:self._start + self.nbytes] = fill
        self.gpudata = self._raw.ctypes.data + self._start
        self.flags = SimpleNamespace(c_contiguous=True)
        with _launch_lock:
            _live.add(self)

    @property
    def ndim(self):
        return len(self.shape)

    def _view(self):
        return self._raw[self._start:self._start + self.nbytes].view(self.dtype).reshape(
            self.shape)

    def get(self):
        """A numpy copy of the contents."""
        return self._view().copy()

    def set(self, values):
        """Copy `values` (of this shape) in."""
        self._view()[...] = np.asarray(values, dtype=self.dtype).reshape(self.shape)
        return self

    def copy(self):
        """A new EmuArray with the same contents (GPUArray.copy, a device-to-device
        copy: not counted as a host transfer, unlike set/get)."""
        out = EmuArray(self.shape, self.dtype)
        out._view()[...] = self._view()
        return out

    def __mul__(self, factor):
        """A new EmuArray of self * scalar in this dtype (GPUArray's own arithmetic,
        which the collective ops use for their scaling)."""
        return EmuArray(self.shape, self.dtype).set(self._view() * self.dtype.type(factor))

    def check(self):
        """EmulatorError if anything wrote outside the array."""
        head = self._raw[self._start - PAD:self._start]
        tail = self._raw[self._start + self.nbytes:self._start + self.nbytes + PAD]
        if (head != CANARY).any() or (tail != CANARY).any():
            raise EmulatorError(f"a kernel wrote outside an array of shape {self.shape}")


def to_device(values, offset=0):
    """An EmuArray holding a copy of numpy `values`."""
    values = np.asarray(values)
    return EmuArray(values.shape, values.dtype, offset=offset).set(values)


_build_lock = threading.Lock()


@functools.cache
def _shared_variables(lib_path):
    """[(offset in the library, size)] of its __shared__ variables: the function
    statics (mangled _ZZ...) in .bss (no initialiser: CUDA gives shared memory
    none), as `objdump -t` lists them; and the offset of emu_launch."""
    done = subprocess.run(["objdump", "-t", str(lib_path)], capture_output=True, text=True,
                          check=True)
    found, launch_at = [], None
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[-1].startswith("_ZZ") and parts[-3].startswith(".bss"):
            found.append((int(parts[0], 16), int(parts[-2], 16)))
        elif len(parts) >= 5 and parts[-1] == "emu_launch":
            launch_at = int(parts[0], 16)
    return found, launch_at


def load(path):
    """The library `build` made, loaded, with its __shared__ variables handed to
    the runtime (emu_set_shared)."""
    lib = ctypes.CDLL(str(path))
    lib.emu_launch.restype = ctypes.c_int
    lib.emu_launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 6 + [
        ctypes.c_void_p, ctypes.c_uint, ctypes.c_char_p, ctypes.c_int,
        ctypes.c_ulonglong, ctypes.c_ulonglong, ctypes.POINTER(ctypes.c_ulonglong)]
    variables, launch_at = _shared_variables(str(path))
    base = ctypes.cast(lib.emu_launch, ctypes.c_void_p).value - launch_at
    addresses = (ctypes.c_ulonglong * max(len(variables), 1))(*(base + at for at, _ in variables))
    sizes = (ctypes.c_ulonglong * max(len(variables), 1))(*(n for _, n in variables))
    with _launch_lock:          # a library loaded again is the same state: not mid-launch
        lib.emu_set_shared(len(variables), addresses, sizes)
    return lib


class EmuKernel:
    """One entry point of a loaded library: `(grid, block, args, shared=0)` runs it
    with `shared` bytes of dynamic shared memory (see the module doc for what a
    launch checks); `allow_shared(n)` is CUDA's cuFuncSetAttribute(
    MAX_DYNAMIC_SHARED_SIZE_BYTES, n)."""

    def __init__(self, lib, name, fmt, seed):
        self.name, self.fmt = name, fmt
        self._lib = lib
        self._fn = ctypes.cast(getattr(lib, f"emu_wrap_{name}"), ctypes.c_void_p)
        self._seed = seed
        self.shared_used = 0      # the most static shared memory a block of it touched
        self.max_dynamic = None   # the function attribute, once set (None: the default)
        self.launches = 0         # launches that ran

    def allow_shared(self, nbytes):
        """Let launches ask for up to `nbytes` of dynamic shared memory (the function
        attribute); EmulatorError past OPTIN_LIMIT, as CUDA refuses it."""
        nbytes = int(nbytes)
        if not 0 <= nbytes <= OPTIN_LIMIT - self.shared_used:
            raise EmulatorError(f"{self.name}: MAX_DYNAMIC_SHARED_SIZE_BYTES={nbytes} with "
                                f"{self.shared_used} bytes of static shared memory: more than "
                                f"the {OPTIN_LIMIT} a block may opt in to")
        self.max_dynamic = nbytes

    def __call__(self, grid, block, args, shared=0):
        values = [C_TYPES[c][1](v) for c, v in zip(self.fmt, pack_args(self.name, self.fmt,
                                                                       args))]
        pointers = [(i, v.value) for i, (c, v) in enumerate(zip(self.fmt, values))
                    if c == "P" and v.value]
        for n, (i, p) in enumerate(pointers):
            for j, q in pointers[n + 1:]:
                if p == q:
                    aliased.add((self.name, (i, j)))
        check_geometry(self.name, grid, block)
        shared = int(shared)
        allowed = SHARED_LIMIT if self.max_dynamic is None else self.max_dynamic
        if shared < 0 or shared > allowed:
            how = ("the function attribute MAX_DYNAMIC_SHARED_SIZE_BYTES allows "
                   f"{self.max_dynamic}" if self.max_dynamic is not None else
                   f"a block may have {SHARED_LIMIT} without raising the function attribute "
                   "MAX_DYNAMIC_SHARED_SIZE_BYTES")
            raise EmulatorError(f"{self.name}: launched with {shared} bytes of dynamic shared "
                                f"memory; {how}")
        argv = (ctypes.c_void_p * len(values))(
            *(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values))
        err = ctypes.create_string_buffer(1024)
        used = ctypes.c_ulonglong(0)
        limit = SHARED_LIMIT if self.max_dynamic is None else OPTIN_LIMIT
        with _launch_lock:
            self._seed[0] += 1
            self.launches += 1
            rc = self._lib.emu_launch(self._fn, *grid, *block, argv, self._seed[0], err,
                                      len(err), limit, shared, ctypes.byref(used))
            self.shared_used = max(self.shared_used, used.value)
        if rc:
            raise EmulatorError(f"{self.name}: {err.value.decode()}")
        if self.max_dynamic is not None and self.shared_used + self.max_dynamic > OPTIN_LIMIT:
            raise EmulatorError(f"{self.name}: {self.shared_used} bytes of static shared memory "
                                f"and MAX_DYNAMIC_SHARED_SIZE_BYTES={self.max_dynamic}: more "
                                f"than the {OPTIN_LIMIT} a block may opt in to")
        with _launch_lock:
            live = list(_live)
        for a in live:
            a.check()


def pack_args(name, fmt, args):
    """The values a kernel `name` with argument format `fmt` receives for `args`,
    packed as PyCUDA packs them (its struct module: an int parameter takes an
    int or an object with __index__ - a float raises - and must be in range;
    a float parameter takes anything float() takes). struct.error names the
    kernel and the argument."""
    if len(args) != len(fmt):
        raise TypeError(f"{name}: {len(fmt)} arguments ({fmt!r}), got {len(args)}")
    try:
        return list(struct.unpack(fmt, struct.pack(fmt, *args)))
    except struct.error:
        pass
    for i, (c, a) in enumerate(zip(fmt, args)):      # which one: PyCUDA's error does not say
        try:
            struct.pack(c, a)
        except struct.error as e:
            raise struct.error(f"{name}: argument {i} ({c!r}) = {a!r} ({type(a).__name__}): "
                               f"{e}") from None
    raise AssertionError("unreachable: the arguments pack one by one but not together")


def check_geometry(name, grid, block):
    """EmulatorError unless `grid` and `block` (3-tuples of ints) are a launch the
    hardware accepts (MAX_GRID, MAX_BLOCK, 1024 threads a block)."""
    gx, gy, gz = grid
    bx, by, bz = block
    if (0 < gx <= MAX_GRID[0] and 0 < gy <= MAX_GRID[1] and 0 < gz <= MAX_GRID[2] and
            0 < bx <= MAX_BLOCK[0] and 0 < by <= MAX_BLOCK[1] and 0 < bz <= MAX_BLOCK[2] and
            bx * by * bz <= 1024 and
            int is type(gx) is type(gy) is type(gz) is type(bx) is type(by) is type(bz)):
        return
    for what, dims, limits in (("grid", grid, MAX_GRID), ("block", block, MAX_BLOCK)):
        if any(type(d) is not int or not 1 <= d <= m for d, m in zip(dims, limits)):
            raise EmulatorError(f"{name}: {what} {tuple(dims)}: each of x, y, z must be an int "
                                f"in [1, {list(limits)}]")
    if math.prod(block) > 1024:
        raise EmulatorError(f"{name}: block {tuple(block)} has {math.prod(block)} threads, more "
                            "than 1024")


class EmuBackend:
    """The loader backend of the emulator; `device` describes a small made-up GPU
    (few multiprocessors keep grids small and still split reductions)."""

    def __init__(self, sm_count=2, seed=1):
        self.info = DeviceInfo(name="emulated", compute_capability=(9, 0), sm_count=sm_count,
                               total_memory=2**30)
        self.state = device.DeviceState("emulated", self.info, None)
        self._libs = {}
        self._kernels = {}
        self._seed = [seed]

    def device(self):
        return self.info

    def state_of(self, place):
        """Every emulated place shares the one emulated device."""
        return self.state

    def default_state(self):
        return self.state

    def push(self, state):
        """No contexts to push on the emulator."""

    def pop(self, state):
        """No contexts to pop on the emulator."""

    def _lib(self, module):
        if module not in self._libs:
            with _build_lock:
                if module not in self._libs:
                    self._libs[module] = load(build(module, loader.signature_table()[module]))
        return self._libs[module]

    def kernel(self, module, name, fmt):
        key = (module, name)
        kernel = self._kernels.get(key)
        if kernel is None:
            expected = loader.signature_table()[module].get(name)
            if expected != fmt:
                raise EmulatorError(f"{module}.{name}: launched with format {fmt!r}, "
                                    f"SIGNATURES says {expected!r}")
            run = EmuKernel(self._lib(module), name, fmt, self._seed)
            # setdefault is atomic: ranks on threads asking at once all get the first one
            # made, so one function attribute (allow_shared) and one tally serve them all
            kernel = self._kernels.setdefault(key, loader.Kernel(
                name, fmt, run, KernelResources(32, 0), allow_shared=run.allow_shared))
        return kernel

    def empty(self, shape, dtype):
        return EmuArray(shape, dtype)

    def to_device(self, array):
        return to_device(array)

    def copy(self, array):
        return array.copy()

    def build_all(self):
        """Compile every kernel module (a test that they all build with g++ too)."""
        for module in loader.module_names():
            self._lib(module)


class EmuPlace(GPUPlace):
    """A GPU place on the emulator: kind "gpu", so ops run their GPU kernel
    bindings; feeds become EmuArrays; fetches and device error flags go
    through GPUPlace's own to_host and check_errors. Needs an EmuBackend
    installed in the loader (see `emulated_gpu`)."""

    def __init__(self, device_id=0):
        self.device_id = int(device_id)       # no driver, no context

    def to_device(self, array):
        """`array` copied into a new EmuArray."""
        return to_device(np.require(array, requirements="C"))

    __eq__ = object.__eq__
    __hash__ = object.__hash__

    def __repr__(self):
        return f"EmuPlace({self.device_id})"


@contextlib.contextmanager
def emulated_gpu(sm_count=2):
    """Install an EmuBackend in the loader and yield an EmuPlace; the previous
    backend comes back afterwards."""
    old = device.use_backend(EmuBackend(sm_count=sm_count))
    try:
        yield EmuPlace()
    finally:
        device.use_backend(old)
