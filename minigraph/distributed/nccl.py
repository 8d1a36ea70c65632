"""The NCCL backend (nccl4py, `nccl.core`) for GPU arrays, bootstrapped over MPI.

Rank 0 makes an NCCL unique id (`get_unique_id().as_bytes`) and broadcasts
it over MPI; every rank then joins with `Communicator.init(nranks, rank,
unique_id)` with its place's context current - NCCL takes the current device
as the communicator's. Every call into NCCL runs under `place.activate()`
(the context rule, minigraph/place.py). Buffers go to NCCL as PyCUDA
GPUArrays: nccl4py reads them through `__cuda_array_interface__` (pointer,
shape, dtype) and finds their device from the pointer (the driver's
CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL), which must be the communicator's.
Outputs come from the device's memory pool. Host (numpy) arrays - a batch
size, a checkpoint's scalars - go through the bootstrap MPI communicator
instead: no device staging and no host wait on the GPU.

Collectives are enqueued on the stream the place's device owns (the one its
kernels go on: DeviceState.stream), so every later kernel is ordered after
them and the host does not wait. A
watchdog (two daemon threads per communicator) waits for each collective's
completion event (Event.synchronize: no polling) and checks NCCL's async
error. Each event is released with its context current on the watchdog's
thread (PyCUDA cannot destroy an object of a context that another thread
retained and that is not current: it warns and leaks it), and the timer
thread never holds one. An error while waiting (a sticky CUDA error raised by
the wait, NCCL's async error) is reported at once, naming the collective,
and ends the job as a timeout does; past the deadline - the communicator's
`timeout_s`, the same setting
as MPI's: init(timeout=...) or MINIGRAPH_COLLECTIVE_TIMEOUT, 60 s by default
- it reports the rank and the collective (#index and its `what=` label),
aborts the NCCL communicator and ends the whole job through MPI_Abort, so a
rank that died or took another path never leaves the others hanging. The
order check and host arrays go through the MPI communicator, whose own
deadline names the rank that did not arrive (minigraph/distributed/deadline.py);
the two share one call index (`progress`). At exit the watchdog drains and
the communicator is destroyed before the GPU contexts are released.

Nothing here imports pycuda or nccl4py until an NCCLComm is made.
"""
from __future__ import annotations

import atexit
import collections
import sys
import threading
import time

import numpy as np

from minigraph.distributed.comm import CollectiveError, Communicator, is_host_array

NCCL_NAMES = ("SUM", "Communicator", "UniqueId", "get_unique_id")


def nccl_available():
    """True when nccl4py imports with every name this backend uses
    (NCCL_NAMES from `nccl.core`)."""
    try:
        import nccl.core as core
    except Exception:      # ImportError, or a library that fails to load
        return False
    return all(hasattr(core, name) for name in NCCL_NAMES)


UNIQUE_ID_BYTES = 128         # NCCL_UNIQUE_ID_BYTES


class NCCLComm(Communicator):
    """Collectives on GPUArrays through NCCL; `host` is the MPIComm used to
    bootstrap, for the order check, host arrays and aborting the job.
    timeout_s: the deadline of each collective (None: the host's)."""

    backend = "nccl"

    def __init__(self, place, host, check_order=True, timeout_s=None):
        from nccl.core import SUM, UniqueId, get_unique_id
        from nccl.core import Communicator as NcclCommunicator

        timeout_s = host.timeout_s if timeout_s is None else timeout_s
        super().__init__(host.rank, host.size, host.local_rank, place, check_order, timeout_s)
        self.host = host
        self.progress = host.progress       # one call index for NCCL and MPI calls
        self.SUM = SUM
        uid = np.zeros(UNIQUE_ID_BYTES, np.uint8)
        if host.rank == 0:
            made = get_unique_id().as_bytes
            if len(made) != UNIQUE_ID_BYTES:
                raise RuntimeError(f"NCCL's unique id has {len(made)} bytes, expected "
                                   f"{UNIQUE_ID_BYTES}")
            uid[...] = np.frombuffer(made, np.uint8)
        uid = host.broadcast(uid, root=0, what="NCCL unique id")   # raw bytes, never pickled
        with place.activate():
            self.nccl = NcclCommunicator.init(nranks=host.size, rank=host.rank,
                                              unique_id=UniqueId.from_bytes(uid.tobytes()))
        self.watchdog = Watchdog(self)
        self._closed = False
        atexit.register(self.close)

    # ---- collectives: device arrays through NCCL, host arrays through MPI ------

    def _allreduce(self, x):
        if is_host_array(x):
            return self.host._allreduce(x)
        with self.place.activate():
            out = _empty(x.shape, x.dtype)
            if x.size:
                self.nccl.allreduce(x, out, self.SUM, stream=_stream())
                self.watchdog.add("allreduce", self.progress.current)
            return out

    def _allgather(self, x):
        if is_host_array(x):
            return self.host._allgather(x)
        with self.place.activate():
            return self._gather_device(x)

    def _gather_device(self, dev):
        out = _empty((self.size,) + tuple(dev.shape), dev.dtype)
        if dev.size:
            self.nccl.allgather(dev, out, stream=_stream())
            self.watchdog.add("allgather", self.progress.current)
        return out

    def _broadcast(self, x, root):
        if is_host_array(x):
            return self.host._broadcast(x, root)
        with self.place.activate():
            out = _empty(x.shape, x.dtype)
            if x.size:
                self.nccl.broadcast(x, out, root, stream=_stream())
                self.watchdog.add("broadcast", self.progress.current)
            return out

    def _allreduce_stats(self, x):
        """Allgather the ranks' (n, mean, M2) vectors and merge them in rank order
        on the device (kernels/cuda/batch_norm.cu merge_stats): NCCL has no custom ops."""
        if is_host_array(x):
            return self.host._allreduce_stats(x)
        from minigraph.kernels.cuda import batch_norm_sync

        with self.place.activate():
            return batch_norm_sync.merge_stats(self._gather_device(x))

    def _barrier(self):
        import pycuda.driver as drv

        self.watchdog.drain()                 # under the watchdog's deadline
        with self.place.activate():
            drv.Context.synchronize()
        self.host._barrier()                  # under the MPI deadline

    def abort(self, code=1):
        try:
            self.nccl.abort()
        finally:
            self.host.abort(code)

    def close(self):
        """Wait for every enqueued collective (under the watchdog's deadline), stop
        the watchdog and destroy the NCCL communicator (atexit does this before
        the GPU contexts are released). Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.watchdog.stop()
        except CollectiveError:
            return               # reported by failed(), which aborted the communicator
        try:
            with self.place.activate():
                self.nccl.destroy()
        except Exception as e:   # at exit: report, never hide the real outcome
            sys.stderr.write(f"minigraph.distributed: rank {self.rank}: NCCL destroy: {e}\n")

    def failed(self, kind, where, why):
        """Report a collective that failed or timed out - this rank, the NCCL call
        and the collective `where` = (index, label, ...) - then end the job (the
        communicator is broken: every later collective raises the same error)."""
        call = f"collective #{where[0]} '{where[1]}'" if where else "a collective"
        message = (f"minigraph.distributed: rank {self.rank} of {self.size}: NCCL {kind} "
                   f"of {call} {why}")
        if self.progress.broken is None:
            self.progress.broken = CollectiveError(message)
        sys.stderr.write(message + ". Aborting the job.\n")
        sys.stderr.flush()
        self.abort(1)


def _empty(shape, dtype):
    from minigraph.kernels.cuda import loader

    return loader.empty(tuple(shape), dtype)


class Watchdog:
    """Waits for a communicator's collectives off the main thread.

    `add(kind, where)` records a completion event on the place's stream
    (the caller holds the place's context) and queues it with the collective's
    (index, label, ...) for the messages. The waiter thread blocks on the
    events in order (Event.synchronize) and checks NCCL's async error after
    each, then releases the event, all with the place's context current; an
    exception there is reported through `comm.failed` (and `drain` raises it)
    instead of ending the thread silently. The timer thread sleeps until the
    oldest pending collective's deadline and, if it is still pending then,
    reports and aborts; it keeps the collective's number, never its event.
    """

    def __init__(self, comm):
        self.comm = comm
        self.pending = collections.deque()       # (event, deadline, kind, where, serial)
        self.lock = threading.Condition()
        self.wake_timer = threading.Event()
        self.stopped = False
        self.error = None                         # set once a collective failed
        self.threads = []
        self._serial = 0

    def add(self, kind, where=None):
        import pycuda.driver as drv

        event = drv.Event(drv.event_flags.DISABLE_TIMING)
        event.record(_device_stream())
        with self.lock:
            was_idle = not self.pending
            self._serial += 1
            self.pending.append((event, time.monotonic() + self.comm.timeout_s, kind, where,
                                 self._serial))
            del event
            self.lock.notify_all()
        if not self.threads:
            self._start()
        if was_idle:
            self.wake_timer.set()

    def _start(self):
        for target in (self._wait_loop, self._timer_loop):
            t = threading.Thread(target=target, name=f"nccl-{target.__name__[1:]}", daemon=True)
            t.start()
            self.threads.append(t)

    def _wait_loop(self):
        while True:
            with self.lock:
                while not self.pending and not self.stopped:
                    self.lock.wait()
                if not self.pending or self.error is not None:
                    return
                _, _, kind, where, _ = self.pending[0]
            why = None
            try:
                with self.comm.place.activate():
                    try:
                        self._wait_head()
                    except Exception as e:  # a sticky CUDA error, NCCL's own: reported below
                        # caught inside the context: the traceback holds the event
                        why = f"failed: {type(e).__name__}: {e}"
            except Exception as e:  # the context could not be made current
                why = f"failed: {type(e).__name__}: {e}"
            if why is not None:
                self._fail(kind, where, why)
                return

    def _wait_head(self):
        """Wait for the oldest pending collective, check NCCL's async error, and
        release its event (the caller holds the place's context)."""
        with self.lock:
            if not self.pending:
                return
            event, serial = self.pending[0][0], self.pending[0][4]
        try:
            event.synchronize()
            status = self.comm.nccl.get_async_error()
            if int(status) != 0:
                raise RuntimeError(f"NCCL async error {status}: "
                                   f"{self.comm.nccl.get_last_error()}")
            with self.lock:
                if self.pending and self.pending[0][4] == serial:
                    self.pending.popleft()
                self.lock.notify_all()
        finally:
            del event           # here, with its context current

    def _fail(self, kind, where, why):
        """Record the failure, release every pending event in its context, wake the
        waiters of drain, then report through the communicator (which ends the job)."""
        with self.lock:
            if self.error is not None:
                return
            self.error = why
        try:
            with self.comm.place.activate(), self.lock:
                self.pending.clear()
        finally:
            with self.lock:
                self.pending.clear()
                self.lock.notify_all()
            self.wake_timer.set()
            self.comm.failed(kind, where, why)

    def _timer_loop(self):
        while not self.stopped and self.error is None:
            with self.lock:
                head = self.pending[0][1:] if self.pending else None   # never the event
            if head is None:
                self.wake_timer.wait()
                self.wake_timer.clear()
                continue
            deadline, kind, where, serial = head
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                with self.lock:
                    still = bool(self.pending) and self.pending[0][4] == serial
                if still:
                    self._fail(kind, where,
                               f"did not finish within {self.comm.timeout_s:g} s (the "
                               "deadline: init(timeout=...) or "
                               "MINIGRAPH_COLLECTIVE_TIMEOUT); another rank probably "
                               "died, stalls, or runs different ops")
                    return
                continue
            self.wake_timer.wait(remaining)
            self.wake_timer.clear()

    def drain(self):
        """Block until every queued collective has completed; CollectiveError
        when one failed or timed out (already reported)."""
        with self.lock:
            while self.pending and self.error is None:
                self.lock.wait()
            if self.error is not None:
                raise CollectiveError(f"NCCL collective failed: {self.error}")

    def stop(self):
        """drain, then end both threads (also after a failure, which drain raises)."""
        try:
            self.drain()
        finally:
            with self.lock:
                self.stopped = True
                self.lock.notify_all()
            self.wake_timer.set()
            for t in self.threads:
                if t is not threading.current_thread():
                    t.join()
            self.threads = []


def _device_stream():
    """The stream of the device current on this thread (a PyCUDA Stream, or None)."""
    from minigraph.device import current

    return current().stream


def _stream():
    """The integer handle of the current device's stream, for nccl4py (0: the legacy
    default stream)."""
    from minigraph.device import current

    return current().stream_handle
