"""A fake PyCUDA for host-side tests and benchmarks on machines without a GPU.

`FakeCuda(devices=2).install()` puts stand-ins for pycuda, pycuda.driver,
pycuda.gpuarray, pycuda.tools and pycuda.compiler into sys.modules, so
minigraph.GPUPlace and the loader's real PyCUDA backend run on it. It keeps
what the driver and PyCUDA keep - a context stack per thread, primary-context
retain counts, which context owns each allocation, event, module and memory
pool, which thread owns each Context object - and checks what they would
reject:

- every allocation, copy, event, memory pool (DeviceMemoryPool binds to the
  context current when it is made) and kernel launch needs a current context;
  `Context.get_device()` is static and reads the current one;
- a pool allocates only with its own context current, a kernel runs only in
  the context its module was loaded in, every pointer it gets belongs to that
  context;
- a Context object belongs to the thread that retained it: an object of its
  context (event, allocation, module) destroyed on another thread while the
  context is not current there is not cleaned up - PyCUDA warns "... in
  out-of-thread context could not be cleaned up" and leaks it (`leaks` lists
  them) - and `detach()` from another thread releases nothing;
- a block freed into a memory pool that holds none, with no context current on
  the freeing thread, aborts the real process (the pool binds its held blocks
  to the current context; its C++ destructor throws): `aborts` lists each, and
  `install` fails its block on any;
- prepared_async_call packs its arguments as PyCUDA does (struct: a float for
  an int parameter, or a value out of range, raises struct.error) and
  refuses a grid or block the hardware would, and dynamic shared memory past
  48 KiB unless the function's MAX_DYNAMIC_SHARED_SIZE_BYTES attribute
  (Function.set_attribute, at most the device's 227 KiB opt-in) allows it;
- `fail(message)` makes a sticky error: every later synchronize, event wait,
  launch and copy raises it, as after an illegal address;
- `check_clean()` fails like PyCUDA's exit check when a thread's context
  stack is not empty.

Kernels either run on the CPU emulator (run_kernels=True: the real .cu files,
so results can be checked) or do nothing (a fake launcher, for timing the
host side). `counts` tallies driver calls (push, pop, mem_alloc, mem_free,
htod, dtoh, launch, compile, module_load, ...); `log` records (thread, event,
device).
"""
from __future__ import annotations

import bisect
import contextlib
import itertools
import sys
import threading
import types
import warnings
from collections import Counter

from .fake_context import FakeContext, FakeDevice, FakeEvent, FakeStream, device_class
from .fake_memory import FakeArray, FakeDriverError, FakeModule, FakePool


class FakeCuda:
    """One fake driver with `devices` GPUs (see the module doc)."""

    def __init__(self, devices=1, driver_version=13000, run_kernels=True, strict=True,
                 sm_count=2):
        self.driver_version = driver_version
        self.run_kernels, self.strict, self.sm_count = run_kernels, strict, sm_count
        self.counts = Counter()
        self.compiled = Counter()       # kernel module -> times compiled (pycuda.compiler)
        self.log = []
        self.devices = [FakeDevice(self, i) for i in range(devices)]
        self._tls = threading.local()
        self._stacks = {}
        self._owners = []           # sorted (start, end, ctx)
        self._top = 1 << 20            # the next fake address (kernels that do nothing)
        self._owners_lock = threading.Lock()    # of both: ranks on threads allocate at once
        self._emu = None
        self.emu_lock = threading.Lock()
        self.hang = threading.Event()   # set: events never complete until released
        self.released = threading.Event()
        self.sticky = None              # fail(): the message every later call raises
        self.leaks = []                 # (thread, kind, device) PyCUDA could not clean up
        self.aborts = []                # what would have ended the real process
        self.captures = {}              # stream handle -> [work] while it is being captured
        self.invalidated = {}           # stream handle -> why its capture was invalidated
        self.graphs = {}                # graph or exec handle -> [work]

    # ---- bookkeeping ---------------------------------------------------------------
    def count(self, what):
        self.counts[what] += 1

    def stack(self):
        s = getattr(self._tls, "stack", None)
        if s is None:
            s = self._tls.stack = []
            self._stacks[threading.get_ident()] = (threading.current_thread().name, s)
        return s

    def current(self, what="this call"):
        s = self.stack()
        if not s:
            raise FakeDriverError(f"{what}: no CUDA context is current on thread "
                                  f"{threading.current_thread().name} (explicit_context_"
                                  "dependent: no currently active context?)")
        return s[-1]

    def fail(self, message="an illegal memory access was encountered"):
        """A sticky error from now on (None: clear it)."""
        self.sticky = message

    def check_sticky(self, what):
        """FakeDriverError when a sticky error is set (see fail)."""
        if self.sticky is not None:
            raise FakeDriverError(f"{what} failed: {self.sticky}")

    def aborted(self, what):
        """Record what would have aborted the process (a C++ exception thrown in a
        destructor: std::terminate); `install` fails its block on any."""
        self.count("abort")
        self.aborts.append(what)

    def cleanup(self, kind, ctx):
        """True when PyCUDA can destroy an object of `ctx` on this thread (its
        scoped_context_activation): `ctx` is current here, or this thread owns
        it (PyCUDA pushes it around the clean-up). A dead context: False,
        silently. Otherwise PyCUDA warns and leaks the object: False, the leak
        recorded in `leaks` and counted as leak_<kind>."""
        if ctx is None or not ctx.valid or ctx.device.retains <= 0:
            return False
        s = self.stack()
        if (s and s[-1] is ctx) or ctx.owner is threading.current_thread():
            return True
        self.count(f"leak_{kind}")
        self.leaks.append((threading.current_thread().name, kind, ctx.device.index))
        warnings.warn(f"{kind} in out-of-thread context could not be cleaned up", UserWarning,
                      stacklevel=2)
        return False

    def _track(self, alloc):
        if self.strict:
            with self._owners_lock:     # insort runs the key, Python, between search and insert
                bisect.insort(self._owners, (alloc.addr, alloc.addr + alloc.nbytes, alloc.ctx),
                              key=lambda t: t[0])

    def _untrack(self, alloc):
        if self.strict:
            with self._owners_lock:
                i = bisect.bisect_left(self._owners, alloc.addr, key=lambda t: t[0])
                if i < len(self._owners) and self._owners[i][0] == alloc.addr:
                    del self._owners[i]

    def owner(self, address):
        """The context owning device `address`, or None."""
        with self._owners_lock:
            i = bisect.bisect_right(self._owners, address, key=lambda t: t[0]) - 1
            if i >= 0 and self._owners[i][0] <= address < max(self._owners[i][1],
                                                               self._owners[i][0] + 1):
                return self._owners[i][2]
        return None

    def check_clean(self):
        """AssertionError, like PyCUDA's abort at exit, if any thread still has a
        context pushed or a primary context is still retained."""
        for name, s in self._stacks.values():
            assert not s, f"thread {name}: the context stack was not empty: {s}"
        for d in self.devices:
            assert d.retains == 0, f"GPU {d.index}'s primary context is still retained " \
                                   f"({d.retains})"

    def reserve(self, nbytes):
        """A fresh device address range of `nbytes` (with a gap after it), for
        allocations that hold no host buffer (run_kernels=False)."""
        with self._owners_lock:
            addr = self._top
            self._top += -(-max(int(nbytes), 1) // 256) * 256 + 256 * 64
        return addr

    def enqueue(self, stream, work):
        """Run `work()` now, or record it when `stream` (a FakeStream or a handle) is
        being captured; returns True when recorded."""
        handle = getattr(stream, "handle", stream)
        if handle in self.captures:
            self.captures[handle].append(work)
            return True
        work()
        return False

    def synchronous(self, what):
        """A call that waits for the device (a host read, a copy on the legacy stream):
        invalidates every capture under way in this context and fails, as CUDA's
        cudaErrorStreamCaptureImplicit does."""
        if self.captures:
            for handle in self.captures:
                self.invalidated.setdefault(handle, f"{what} during the capture")
            raise FakeDriverError(f"{what}: operation not permitted when stream is capturing")

    def check_stream(self, what, stream, ctx):
        """FakeDriverError for a stream of another context (CUDA_ERROR_INVALID_HANDLE);
        counts the calls on the legacy default stream (None)."""
        if stream is None:
            self.count("legacy_stream")
        elif self.strict and stream.ctx is not ctx:
            raise FakeDriverError(f"{what}: stream of {stream.ctx} used with {ctx} current "
                                  "(invalid handle)")

    def memcpy_dtod(self, dest, src, nbytes, stream=None):
        """A device-to-device copy on the current context (both ends its memory)."""
        ctx = self.current("memcpy_dtod")
        self.check_sticky("memcpy_dtod")
        self.check_stream("memcpy_dtod", stream, ctx)
        self.count("dtod")
        if self.strict and not (self.owner(dest) is ctx and self.owner(src) is ctx):
            raise FakeDriverError(f"memcpy_dtod {src:#x} -> {dest:#x} outside {ctx}")
        if self.run_kernels:
            import ctypes

            self.enqueue(stream, lambda: ctypes.memmove(dest, src, nbytes))

    def emulator(self):
        """The one emulated device behind every fake GPU (made once, whichever thread
        asks first)."""
        with self.emu_lock:
            if self._emu is None:
                import kernel_emulator

                self._emu = kernel_emulator.EmuBackend(sm_count=self.sm_count)
        return self._emu

    # ---- installing ----------------------------------------------------------------
    @contextlib.contextmanager
    def install(self):
        """Use this fake as pycuda (and a fresh loader backend) inside the block;
        everything comes back afterwards. The toolkit check is skipped (it would
        run nvcc): tests of it call cuda_backend.check_toolkit directly. Contexts the
        block left retained are released at its end, as at exit."""
        import atexit

        from minigraph import device, place

        saved = {k: v for k, v in sys.modules.items() if k in ("pycuda", "cuda") or
                 k.startswith(("pycuda.", "cuda."))}
        for k in saved:
            del sys.modules[k]
        sys.modules.update(self.modules())
        sys.modules.update(self.bindings())
        old_backend = device.use_backend(None)
        old_places = dict(device.places)
        device.places.clear()
        old_ctx, old_main = dict(place._contexts), place._main_context
        place._contexts.clear()
        place._main_context = None
        from minigraph.kernels.cuda import backend as cuda_backend
        from minigraph.kernels.cuda import libraries

        real_check, cuda_backend.check_toolkit = cuda_backend.check_toolkit, self._check_toolkit
        self.real_check_toolkit = real_check
        no_blas, no_dnn = libraries.use("cublas", None), libraries.use("cudnn", None)
        no_blas.__enter__()         # never a real cuBLAS / cuDNN on a fake driver (tests
        no_dnn.__enter__()          # install the stand-ins of fake_libraries inside)
        try:
            yield self
        finally:
            no_dnn.__exit__(None, None, None)
            no_blas.__exit__(None, None, None)
            if place._contexts:
                place.release_gpus()
            atexit.unregister(place.release_gpus)
            if old_ctx:
                atexit.register(place.release_gpus)
            cuda_backend.check_toolkit = real_check
            device.use_backend(old_backend)
            device.places.clear()
            device.places.update(old_places)
            place._contexts.clear()
            place._contexts.update(old_ctx)
            place._main_context = old_main
            for k in [k for k in sys.modules if k in ("pycuda", "cuda") or
                      k.startswith(("pycuda.", "cuda."))]:
                del sys.modules[k]
            sys.modules.update(saved)
        if self.aborts:
            raise AssertionError(f"the real process would have aborted: {self.aborts}")

    def _check_toolkit(self, driver_version, nvcc="nvcc"):
        self.count("check_toolkit")
        return nvcc

    def modules(self):
        """{name: module} of the fake pycuda package."""
        cuda = self
        pkg = types.ModuleType("pycuda")
        pkg.__path__ = []
        drv = types.ModuleType("pycuda.driver")
        drv.init = lambda flags=0: cuda.count("init")
        drv.get_driver_version = lambda: cuda.driver_version
        drv.Device = device_class(cuda)
        drv.Context = FakeContext
        drv.Event = lambda flags=0: FakeEvent(cuda, flags)
        drv.Stream = lambda flags=0: FakeStream(cuda, flags)
        drv.event_flags = types.SimpleNamespace(DEFAULT=0, BLOCKING_SYNC=1, DISABLE_TIMING=2,
                                                INTERPROCESS=4)
        drv.memcpy_dtod_async = lambda dest, src, nbytes, stream=None: cuda.memcpy_dtod(
            int(dest), int(src), nbytes, stream)
        drv.module_from_buffer = lambda buffer, options=None, message_handler=None: \
            FakeModule.load(cuda, buffer)
        drv.device_attribute = types.SimpleNamespace(
            MULTIPROCESSOR_COUNT="sm", MAX_THREADS_PER_BLOCK="tpb",
            MAX_SHARED_MEMORY_PER_BLOCK_OPTIN="optin", L2_CACHE_SIZE="l2")
        drv.function_attribute = types.SimpleNamespace(
            MAX_DYNAMIC_SHARED_SIZE_BYTES="max_dynamic_shared")
        FakeContext.cuda = cuda
        ga = types.ModuleType("pycuda.gpuarray")
        ga.GPUArray = FakeArray
        ga.empty = lambda shape, dtype, allocator=None: FakeArray(cuda, shape, dtype, allocator)
        ga.empty_like = lambda a: FakeArray(cuda, a.shape, a.dtype)
        ga.to_gpu = lambda a, allocator=None: FakeArray.from_host(cuda, a, allocator)
        tools = types.ModuleType("pycuda.tools")
        tools.DeviceMemoryPool = lambda: FakePool(cuda)
        tools.clear_context_caches = lambda: cuda.count("clear_context_caches")
        comp = types.ModuleType("pycuda.compiler")
        comp.SourceModule = lambda source, **kw: FakeModule.load(cuda, FakeModule.compile(
            cuda, source, kw))
        comp.compile = lambda source, **kw: FakeModule.compile(cuda, source, kw)
        pkg.driver, pkg.gpuarray, pkg.tools, pkg.compiler = drv, ga, tools, comp
        return {"pycuda": pkg, "pycuda.driver": drv, "pycuda.gpuarray": ga,
                "pycuda.tools": tools, "pycuda.compiler": comp}

    def bindings(self):
        """{name: module} of a fake cuda-bindings (`cuda.bindings.driver`): stream
        capture, graphs, their launch - work enqueued on a capturing stream is
        recorded, and replayed by cuGraphLaunch."""
        cuda = self
        cu = types.ModuleType("cuda.bindings.driver")
        ok, invalid, illegal = "CUDA_SUCCESS", "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", \
            "CUDA_ERROR_ILLEGAL_STATE"
        cu.CUresult = types.SimpleNamespace(CUDA_SUCCESS=ok)
        cu.CUstreamCaptureMode = types.SimpleNamespace(CU_STREAM_CAPTURE_MODE_RELAXED=2)
        cu.CUstream = int
        cu.cuGetErrorName = lambda err: (ok, str(err).encode())
        handles = itertools.count(0x9000)

        def begin(stream, mode):
            cuda.current("cuStreamBeginCapture")
            cuda.count("capture_begin")
            if stream in cuda.captures or mode != 2:
                return (illegal,)
            cuda.captures[stream] = []
            return (ok,)

        def end(stream):
            work = cuda.captures.pop(stream, None)
            why = cuda.invalidated.pop(stream, None)
            if work is None:
                return (illegal, None)
            if why is not None:
                return (invalid, None)
            graph = next(handles)
            cuda.graphs[graph] = work
            return (ok, graph)

        def instantiate(graph, flags):
            if graph not in cuda.graphs:
                return (illegal, None)
            exe = next(handles)
            cuda.graphs[exe] = cuda.graphs[graph]
            return (ok, exe)

        def launch(exe, stream):
            cuda.current("cuGraphLaunch")
            cuda.check_sticky("cuGraphLaunch")
            cuda.count("graph_launch")
            for work in cuda.graphs[exe]:
                cuda.enqueue(stream, work)
            return (ok,)

        def destroy(handle):
            cuda.graphs.pop(handle, None)
            return (ok,)
        cu.cuStreamBeginCapture, cu.cuStreamEndCapture = begin, end
        cu.cuGraphInstantiate, cu.cuGraphLaunch = instantiate, launch
        cu.cuGraphExecDestroy = cu.cuGraphDestroy = destroy
        pkg, bindings = types.ModuleType("cuda"), types.ModuleType("cuda.bindings")
        pkg.__path__, bindings.__path__ = [], []
        pkg.bindings, bindings.driver = bindings, cu
        return {"cuda": pkg, "cuda.bindings": bindings, "cuda.bindings.driver": cu}
