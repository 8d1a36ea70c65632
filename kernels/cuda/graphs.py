"""CUDA graphs: stream capture on a device's own stream, through the driver API of
NVIDIA's cuda-bindings (`cuda.bindings.driver`; PyCUDA has no stream capture). It
comes with nccl4py (the `gpu` extra); where it is missing, nothing is captured.

`Capture(state)` begins capturing the device's stream in relaxed mode (the
capturing thread may still allocate), and routes the device's allocations through a
`CaptureAllocator`: blocks taken from the memory pool during the capture belong to
the graph for its whole life (a block freed during the capture is lent again only
inside it, for an array of at most its size and at least half of it; after it, only
to the graph's own arrays), so replaying never writes memory that something else was
given since. `end()` instantiates the graph; `Graph.launch()` replays it on the
stream. Anything that synchronises during the capture (a host read, a copy on the
legacy stream) invalidates it: `end()` then raises CaptureError with the driver's
reason, and nothing captured has run.
"""
from __future__ import annotations

import bisect
import os
import weakref

from minigraph.device import GPUError

RELAXED = "CU_STREAM_CAPTURE_MODE_RELAXED"


class CaptureError(GPUError):
    """A stream capture failed or was invalidated; the message says why."""


def driver():
    """The cuda-bindings driver module, or None where it is not installed."""
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        try:
            from cuda import cuda as cu  # cuda-python before 12.6
        except ImportError:
            return None
    return cu


def unavailable():
    """Why nothing can be captured here (None: it can): MINIGRAPH_CUDA_GRAPHS=off, or
    no cuda-bindings."""
    if os.environ.get("MINIGRAPH_CUDA_GRAPHS", "").strip().lower() in ("off", "0", "no",
                                                                       "false"):
        return "MINIGRAPH_CUDA_GRAPHS=off"
    if driver() is None:
        return "cuda-bindings is not installed (pip install cuda-bindings; nccl4py brings it)"
    return None


def _check(cu, what, result):
    """The values after the CUresult of a cuda-bindings call; CaptureError unless it
    succeeded, with the driver's error name."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != cu.CUresult.CUDA_SUCCESS:
        name = cu.cuGetErrorName(err)
        text = name[1].decode() if isinstance(name, tuple) and isinstance(name[1], bytes) \
            else str(err)
        raise CaptureError(f"{what} failed: {text}")
    return rest[0] if len(rest) == 1 else rest


class Lease(int):
    """A block lent by a CaptureAllocator, as the address GPUArrays keep in gpudata
    (an int: PyCUDA takes it anywhere it takes a pointer). When its array is
    dropped the block goes back to the allocator, never to the memory pool."""

    def __new__(cls, owner, block, nbytes):
        lease = super().__new__(cls, int(block))
        lease.owner, lease.allocation, lease.nbytes = owner, block, nbytes
        return lease

    def __del__(self):
        owner = self.owner()
        if owner is not None:
            owner.give_back(self.allocation, self.nbytes)


class CaptureAllocator:
    """allocate(nbytes) for a graph: lends the smallest block its own arrays gave back
    that holds nbytes and is at most REUSE_SLACK times as large, else takes a new one
    from `take` (the pool's allocate); keeps every block it took in `blocks` for as
    long as it lives. Lending a block again is safe: the capture's work runs in order
    on one stream, as the step's work did."""

    REUSE_SLACK = 2

    def __init__(self, take):
        self.take, self.blocks, self.free, self.given = take, [], [], 0
        self._self = weakref.ref(self)

    def __call__(self, nbytes):
        nbytes = int(nbytes)
        i = bisect.bisect_left(self.free, (nbytes,))
        if i < len(self.free) and self.free[i][0] <= self.REUSE_SLACK * max(nbytes, 1):
            size, _, block = self.free.pop(i)
        else:
            size, block = nbytes, self.take(nbytes)
            self.blocks.append(block)
        return Lease(self._self, block, size)

    def give_back(self, block, nbytes):
        """A lent block of nbytes is free again (its array was dropped)."""
        self.given += 1
        bisect.insort(self.free, (nbytes, self.given, block))

    @property
    def nbytes(self):
        """Bytes taken from the pool."""
        return sum(getattr(b, "size", 0) or 0 for b in self.blocks)


class Graph:
    """An instantiated graph of one device: `launch()` replays it on the stream;
    `allocator` holds its memory; `keep` whatever else it must outlive."""

    def __init__(self, cu, state, graph, exe, allocator, keep):
        self.cu, self.state, self.graph, self.exe = cu, state, graph, exe
        self.allocator, self.keep = allocator, keep

    def launch(self):
        _check(self.cu, "cuGraphLaunch", self.cu.cuGraphLaunch(self.exe, _stream(self.cu,
                                                                                 self.state)))

    def close(self):
        """Destroy the executable graph and the graph (call with the context current)."""
        exe, graph, self.exe, self.graph = self.exe, self.graph, None, None
        if exe is not None:
            self.cu.cuGraphExecDestroy(exe)
        if graph is not None:
            self.cu.cuGraphDestroy(graph)


def _stream(cu, state):
    return cu.CUstream(state.stream_handle)


class Capture:
    """Capture everything enqueued on `state`'s stream between begin() and end() (see
    the module doc); call both with the device's context current."""

    def __init__(self, state):
        self.cu, self.state = driver(), state
        self.allocator = CaptureAllocator(state.allocate)
        self.saved_allocate = None
        self.before = (dict(state.scratch), state.tickets)

    def begin(self):
        if self.state.stream is None:
            raise CaptureError("the device has no stream of its own to capture")
        mode = getattr(self.cu.CUstreamCaptureMode, RELAXED)
        _check(self.cu, "cuStreamBeginCapture", self.cu.cuStreamBeginCapture(
            _stream(self.cu, self.state), mode))
        self.saved_allocate, self.state.allocate = self.state.allocate, self.allocator

    def _stop(self):
        if self.saved_allocate is not None:
            self.state.allocate, self.saved_allocate = self.saved_allocate, None
        return self.cu.cuStreamEndCapture(_stream(self.cu, self.state))

    def end(self):
        """The instantiated Graph; CaptureError (the capture ended) when the capture was
        invalidated or the graph cannot be instantiated."""
        graph = _check(self.cu, "cuStreamEndCapture", self._stop())
        try:
            instantiate = getattr(self.cu, "cuGraphInstantiate", None) or \
                self.cu.cuGraphInstantiateWithFlags
            exe = _check(self.cu, "cuGraphInstantiate", instantiate(graph, 0))
        except Exception:
            self.cu.cuGraphDestroy(graph)
            raise
        return Graph(self.cu, self.state, graph, exe, self.allocator, self.before)

    def abort(self):
        """End a capture that failed (its graph discarded); never raises."""
        try:
            found = self._stop()
            graph = found[1] if isinstance(found, tuple) and len(found) > 1 else None
            if graph is not None:
                self.cu.cuGraphDestroy(graph)
        except Exception:  # noqa: BLE001 - the capture is over either way
            pass
