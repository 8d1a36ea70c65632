"""The fake driver's devices, primary contexts, streams and events (see fake_pycuda.py,
which installs them as pycuda.driver's): each made in the context current on its
thread, and checked against it as PyCUDA and CUDA check."""
from __future__ import annotations

import itertools
import threading

from .fake_memory import FakeDriverError


class FakeContext:
    """A primary context as PyCUDA's Context object: retained (one object per
    retain_primary_context call, owned by the thread that made it), pushed and
    popped per thread like CUDA's."""

    cuda = None

    def __init__(self, device):
        self.device, self.valid = device, True
        self.owner = threading.current_thread()

    @property
    def retains(self):
        """The device's primary-context retain count."""
        return self.device.retains

    def push(self):
        c = self.device.cuda
        if not self.valid or self.device.retains <= 0:
            raise FakeDriverError(f"push of {self}, which is not retained")
        c.stack().append(self)
        c.count("push")
        c.log.append((threading.current_thread().name, "push", self.device.index))

    @staticmethod
    def pop():
        c = FakeContext.cuda
        s = c.stack()
        if not s:
            raise FakeDriverError("context::pop: cannot pop non-current context")
        ctx = s.pop()
        c.count("pop")
        c.log.append((threading.current_thread().name, "pop", ctx.device.index))
        return ctx

    @staticmethod
    def get_current():
        s = FakeContext.cuda.stack()
        return s[-1] if s else None

    @staticmethod
    def synchronize():
        c = FakeContext.cuda
        ctx = c.current("Context.synchronize")
        c.count("synchronize")
        c.log.append((threading.current_thread().name, "synchronize", ctx.device.index))
        c.synchronous("cuCtxSynchronize")
        c.check_sticky("cuCtxSynchronize")

    @staticmethod
    def get_device():
        """The device of the context current on this thread (PyCUDA's is static:
        cuCtxGetDevice), whichever Context object it is called on."""
        return FakeContext.cuda.current("Context.get_device (cuCtxGetDevice)").device

    def detach(self):
        c = self.device.cuda
        if not self.valid:
            raise FakeDriverError("context::detach: cannot detach from invalid context")
        if self in c.stack():
            raise FakeDriverError(f"detach of {self} while it is on this thread's stack")
        self.valid = False
        if self.owner is not threading.current_thread():
            c.count("leak_context")          # PyCUDA releases nothing from a foreign thread
            c.log.append((threading.current_thread().name, "detach_leaked", self.device.index))
            return
        self.device.retains -= 1
        c.count("detach")
        c.log.append((threading.current_thread().name, "detach", self.device.index))

    def __repr__(self):
        return f"<fake primary context of GPU {self.device.index}>"


class FakeDevice:
    def __init__(self, cuda, index):
        self.cuda, self.index, self.retains = cuda, index, 0

    def pci_bus_id(self):
        return f"0000:{self.index:02x}:00.0"

    def retain_primary_context(self):
        self.retains += 1
        self.cuda.count("retain")
        return FakeContext(self)

    def name(self):
        return f"fake GPU {self.index}"

    def compute_capability(self):
        return (9, 0)

    def get_attributes(self):
        return {"sm": self.cuda.sm_count, "tpb": 1024, "optin": 227 * 1024, "l2": 1 << 20}

    def get_attribute(self, attribute):
        return self.get_attributes()[attribute]

    def total_memory(self):
        return 2**30


def device_class(cuda):
    """pycuda.driver.Device for `cuda`: Device(i) is its i-th fake GPU."""
    class Device:
        def __new__(cls, index):
            return cuda.devices[index]

        @staticmethod
        def count():
            return len(cuda.devices)
    return Device


class FakeStream:
    """A Stream: made in the current context (its `ctx`), with an integer `handle`;
    launches and copies on it need that context current."""

    _handles = itertools.count(0x7000, 0x10)

    def __init__(self, cuda, flags=0):
        self.cuda, self.flags = cuda, flags
        self.ctx = cuda.current("Stream (cuStreamCreate)")
        self.handle = next(self._handles)
        cuda.count("stream_create")

    def synchronize(self):
        self.cuda.count("stream_synchronize")
        self.cuda.check_sticky("cuStreamSynchronize")

    def is_done(self):
        return True


class FakeEvent:
    """An Event: made in the current context (PyCUDA's are context-dependent),
    recorded there, destroyed like PyCUDA's (see FakeCuda.cleanup); synchronize
    waits while `hang` is set and raises a sticky error. time_till gives a made-up
    time: a microsecond per record call made in between (recording is a step of a
    clock, not a measurement)."""

    records = itertools.count(1)

    def __init__(self, cuda, flags=0):
        self.cuda, self.flags = cuda, flags
        self.ctx = cuda.current("Event")
        self.at = None
        cuda.count("event_create")

    def record(self, stream=None):
        ctx = self.cuda.current("Event.record")
        if self.cuda.strict and ctx is not self.ctx:
            raise FakeDriverError(f"Event.record: event of {self.ctx} with {ctx} current")
        self.cuda.check_stream("Event.record", stream, ctx)
        self.cuda.count("event_record")
        self.at = next(FakeEvent.records)
        return self

    def time_till(self, other):
        """Milliseconds from this event to `other` (both recorded; PyCUDA's raises
        otherwise)."""
        if self.at is None or other.at is None:
            raise FakeDriverError("cuEventElapsedTime: an event was never recorded")
        return (other.at - self.at) * 1e-3

    def time_since(self, other):
        return other.time_till(self)

    def query(self):
        self.cuda.count("event_query")
        self.cuda.check_sticky("cuEventQuery")
        return not self.cuda.hang.is_set()

    def synchronize(self):
        self.cuda.count("event_synchronize")
        self.cuda.log.append((threading.current_thread().name, "event_synchronize",
                              self.ctx.device.index))
        if self.cuda.hang.is_set():
            self.cuda.released.wait(60)
        self.cuda.check_sticky("cuEventSynchronize")
        return self

    def __del__(self):
        try:
            if self.cuda.cleanup("event", self.ctx):
                self.cuda.count("event_destroy")
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
