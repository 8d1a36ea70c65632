"""What the stand-ins for cuBLAS and cuDNN share (fake_libraries.py says what
they check): FakeLibrary, whose handles belong to the context they were made in and
whose functions take the declared ctypes types; host() views emulated device memory;
tf32() rounds as tensor cores do; DTYPES are the libraries' data type codes."""
from __future__ import annotations

import ctypes

import numpy as np

from minigraph import device
from minigraph.kernels.cuda import libraries

DTYPES = {0: np.float32, 1: np.float64}


def default_context():
    """The device current on this thread (minigraph's notion; the emulator has no driver)."""
    return device.current().key


def typed_call(name, fn, argtypes):
    """fn wrapped to convert its arguments through the declared ctypes types first."""
    def call(*args):
        if len(args) != len(argtypes):
            raise TypeError(f"{name}: {len(argtypes)} arguments expected, got {len(args)}")
        for i, (t, a) in enumerate(zip(argtypes, args)):
            try:
                t.from_param(a)
            except TypeError as e:
                raise ctypes.ArgumentError(f"{name}: argument {i + 1}: {e}") from None
        return fn(*args)
    call.__name__ = name
    return call


def write_out(ref, value):
    """Write `value` where a byref()/pointer argument points."""
    target = getattr(ref, "_obj", ref)
    if isinstance(target, ctypes._Pointer):
        target = target.contents
    target.value = value


def host(pointer, dtype, count):
    """A numpy view of `count` values of `dtype` at host address `pointer`."""
    if count <= 0:
        return np.zeros(0, dtype)
    return np.ctypeslib.as_array((np.ctypeslib.as_ctypes_type(dtype) * count).from_address(
        int(pointer)))


def tf32(a):
    """float32 values rounded to TF32 (10 explicit mantissa bits, round to nearest)."""
    bits = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    bits = ((bits + 0x1000) & 0xFFFFE000).astype(np.uint32)
    return bits.view(np.float32)


class FakeLibrary:
    def __init__(self, context):
        self.context = context or default_context
        self.calls = []
        self.handles = {}           # handle value -> {"context", "stream", "workspace"}
        self._next = iter(range(0x1000, 1 << 40, 0x100))

    def _handle(self, value):
        h = self.handles.get(value)
        if h is None or h["context"] != self.context():
            return None
        return h

    def _record(self, name, value):
        h = self.handles.get(value) or {}
        self.calls.append((name, h.get("stream"), h.get("context")))

    def library(self, name, prototypes, c_types, status_names, version):
        functions = {}
        for fname, (_, params) in prototypes.items():
            impl = getattr(self, fname)
            functions[fname] = typed_call(fname, impl, [c_types[p] for p in params])
        lib = libraries.Library(name, self, f"fake {name}", 13, version, None, functions)
        lib.status_string = lambda code: status_names.get(int(code), f"status {int(code)}")
        return lib
