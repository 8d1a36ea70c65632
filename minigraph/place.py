"""Places: where arrays live and which kernels run.

A place's `kind` picks the kernel registered for an op ("cpu" or "gpu").
The GPU place imports PyCUDA only when it is created, so CPU-only machines
import nothing from it.

The context rule (GPU): a CUDA context is current per thread. Everything
minigraph does on a GPU - compiling, allocating, launching, copying, NCCL
calls - runs with its place's context current: `place.activate()` pushes it
for a block and pops it after (nested blocks push nothing), and a launch or
copy made outside such a block pushes and pops it around itself. So any thread
may run a net, and two GPUs in one process each run their own kernels (with
two GPU places, work outside `activate` is an error, not a guess). The first
GPU place made on the main thread also leaves its primary context current
there, so plain PyCUDA calls (GPUArray.get()) work on the main thread, as
with pycuda.autoprimaryctx; at exit `release_gpus` undoes all of it in the
order the driver needs.

Errors on a GPU: kernels cannot raise, so a GPU kernel that meets bad data
(a label outside [0, K), non-finite batch-norm statistics) records it in a
flag on the device and carries on. `check_errors()` reads those flags and
raises; the Executor calls it when it fetches (where the host waits for the
device anyway), so such an error surfaces at the first fetch after the step
that caused it, not inside the step.
"""
from __future__ import annotations

import atexit
import contextlib
import sys
import threading

import numpy as np

from minigraph import device
from minigraph.device import GPUError

_NO_DEVICE = contextlib.nullcontext()


class CPUPlace:
    """Host memory; arrays are numpy arrays; kernels are numpy code."""

    kind = "cpu"

    def to_device(self, array):
        """`array` as an array of this place (a numpy array)."""
        return np.asarray(array)

    def to_host(self, value):
        """`value` as a numpy array."""
        return np.asarray(value)

    def check_errors(self):
        """Nothing to do: CPU kernels raise at once."""

    def copy(self, value):
        """A new array holding a copy of `value` (an array of this place)."""
        return np.array(value, copy=True)

    def activate(self):
        """A context manager that does nothing (host memory needs no context)."""
        return _NO_DEVICE

    def __eq__(self, other):
        return isinstance(other, CPUPlace)

    def __hash__(self):
        return hash("cpu")

    def __repr__(self):
        return "CPUPlace()"


class GPUPlace:
    """One NVIDIA GPU through PyCUDA, on the device's primary context."""

    kind = "gpu"

    def __init__(self, device_id=0):
        self.device_id = int(device_id)
        self._drv = _load_driver()
        count = self._drv.Device.count()
        if count == 0:
            raise GPUError("GPUPlace: the CUDA driver found no GPU on this machine")
        if not 0 <= self.device_id < count:
            raise GPUError(f"GPUPlace({self.device_id}): only {count} GPU(s) present")
        self.device = self._drv.Device(self.device_id)
        self.context = _primary_context(self.device)
        device.register_place(self)

    def activate(self):
        """A context manager: this GPU's context is current on the calling thread
        inside the block (pushed on entry, popped on exit; see the module doc)."""
        return device.activate(self)

    def to_device(self, array):
        """`array` copied into a GPUArray on this device, from its memory pool
        (0-d stays 0-d)."""
        with self.activate():
            return device.backend().to_device(np.require(array, requirements="C"))

    def to_host(self, value):
        """`value` (a GPUArray) copied into a numpy array."""
        if not hasattr(value, "get"):
            return np.asarray(value)
        with self.activate():
            return value.get()

    def check_errors(self):
        """Raise what GPU kernels flagged on this device since the last check
        (see the module doc): one small synchronising read per flag."""
        with self.activate():
            device.check_flags()

    def copy(self, value):
        """A new device array from the memory pool holding a copy of `value`, of
        any dtype (a device-to-device copy: nothing crosses to the host)."""
        with self.activate():
            return device.backend().copy(value)

    def __eq__(self, other):
        return isinstance(other, GPUPlace) and other.device_id == self.device_id

    def __hash__(self):
        return hash(("gpu", self.device_id))

    def __repr__(self):
        return f"GPUPlace({self.device_id})"


_contexts = {}          # PCI bus id -> the retained primary Context of that device
_lock = threading.Lock()
_main_context = None    # the one left current on the main thread, if any


def _load_driver():
    try:
        import pycuda.driver as drv
    except ImportError as e:
        raise GPUError(f"GPUPlace: no GPU available: {_import_failure(e)}") from e
    try:
        drv.init()
    except Exception as e:  # pycuda raises its own LogicError/RuntimeError types
        raise GPUError(f"GPUPlace: the CUDA driver failed to start: {e}") from e
    return drv


def _import_failure(e):
    """Why `import pycuda.driver` failed: not installed, no driver, or a broken pycuda."""
    import importlib.util

    try:
        installed = importlib.util.find_spec("pycuda") is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        return "pycuda is not installed (pip install 'minigraph[gpu]')"
    if "libcuda" in str(e):
        return f"the CUDA driver could not be loaded ({e})"
    return (f"pycuda is installed but broken ({type(e).__name__}: {e}); rebuild it for this "
            "CUDA toolkit and Python (pip install --force-reinstall --no-cache-dir pycuda)")


def _primary_context(device):
    """The device's primary context, retained once per process. The first one
    retained on the main thread is also pushed there (see the module doc); the
    first retain registers `release_gpus` to run at exit."""
    global _main_context
    key = device.pci_bus_id()
    with _lock:
        ctx = _contexts.get(key)
        if ctx is None:
            ctx = device.retain_primary_context()
            if not _contexts:
                atexit.register(release_gpus)
            _contexts[key] = ctx
            if _main_context is None and threading.current_thread() is threading.main_thread():
                ctx.push()
                _main_context = ctx
    return ctx


def release_gpus():
    """Give back every primary context this process retained (registered with
    atexit; safe to call again). Per device: push its context, synchronize,
    drop the device state for it (kernels, modules, error flags, caches) and
    give its memory pool back, pop; then pop the context left current on the
    main thread, clear PyCUDA's context caches and detach each context. GPU
    places made before are unusable afterwards; new ones retain afresh."""
    global _main_context
    import pycuda.driver as drv

    with _lock:
        contexts = list(_contexts.values())
        main, _main_context = _main_context, None
        _contexts.clear()
    for ctx in reversed(contexts):
        ctx.push()
        try:
            try:
                drv.Context.synchronize()
            except Exception as e:  # a sticky launch error: report it, finish the teardown
                sys.stderr.write(f"minigraph: GPU error found at exit: {e}\n")
            device.forget_place(ctx)
        finally:
            drv.Context.pop()
    if main is not None and threading.current_thread() is threading.main_thread() and \
            drv.Context.get_current() == main:
        drv.Context.pop()
    try:
        from pycuda.tools import clear_context_caches

        clear_context_caches()
    except ImportError:
        pass
    for ctx in contexts:
        ctx.detach()
