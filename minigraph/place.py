"""Places: where arrays live and which kernels run.

A place's `kind` picks the kernel registered for an op ("cpu" or "gpu").
The GPU place imports PyCUDA only when it is created, so CPU-only machines
import nothing from it.

Errors on a GPU: kernels cannot raise, so a GPU kernel that meets bad data
(a label outside [0, K), non-finite batch-norm statistics) records it in a
flag on the device and carries on. `check_errors()` reads those flags and
raises; the Executor calls it when it fetches (where the host waits for the
device anyway), so such an error surfaces at the first fetch after the step
that caused it, not inside the step.
"""
from __future__ import annotations

import numpy as np


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

    def __eq__(self, other):
        return isinstance(other, CPUPlace)

    def __hash__(self):
        return hash("cpu")

    def __repr__(self):
        return "CPUPlace()"


class GPUError(RuntimeError):
    """No usable GPU: the message says whether pycuda, the driver or a device is missing."""


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

    def to_device(self, array):
        """`array` copied into a GPUArray on this device."""
        import pycuda.gpuarray as gpuarray

        self.context.push()
        try:
            return gpuarray.to_gpu(np.require(array, requirements="C"))  # 0-d stays 0-d
        finally:
            self._drv.Context.pop()

    def to_host(self, value):
        """`value` (a GPUArray) copied into a numpy array."""
        return value.get() if hasattr(value, "get") else np.asarray(value)

    def check_errors(self):
        """Raise what GPU kernels flagged on the device since the last check
        (see the module doc): one small synchronising read per flag."""
        from minigraph.kernels import loader

        loader.check_flags()

    def __eq__(self, other):
        return isinstance(other, GPUPlace) and other.device_id == self.device_id

    def __hash__(self):
        return hash(("gpu", self.device_id))

    def __repr__(self):
        return f"GPUPlace({self.device_id})"


_contexts = {}


def _load_driver():
    try:
        import pycuda.driver as drv
    except ImportError as e:
        reason = ("pycuda is not installed (pip install 'minigraph[gpu]')"
                  if "pycuda" in str(e) else f"the CUDA driver could not be loaded ({e})")
        raise GPUError(f"GPUPlace: no GPU available: {reason}") from e
    try:
        drv.init()
    except Exception as e:  # pycuda raises its own LogicError/RuntimeError types
        raise GPUError(f"GPUPlace: the CUDA driver failed to start: {e}") from e
    return drv


def _primary_context(device):
    key = device.pci_bus_id()
    if key not in _contexts:
        ctx = device.retain_primary_context()
        ctx.push()        # stays current for this process; NCCL and others share it
        _contexts[key] = ctx
    return _contexts[key]
