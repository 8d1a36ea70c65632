"""Device memory and code of the fake PyCUDA (fake_pycuda.py): allocations that
know their context, DeviceMemoryPool (bound to the context current when it is
made), GPUArray, compile / module_from_buffer / SourceModule and their
functions (arguments packed with PyCUDA's rules)."""
from __future__ import annotations

import math
import threading
import types

import numpy as np

ALIGN = 256


class FakeDriverError(RuntimeError):
    """What the real driver would have returned as an error."""


class _Allocation:
    """Device memory: a host buffer (or, without kernels, just an address)."""

    def __init__(self, cuda, nbytes, ctx, pooled=None):
        self.cuda, self.nbytes, self.ctx, self.pool = cuda, int(nbytes), ctx, pooled
        if cuda.run_kernels:
            self.buf = np.zeros(self.nbytes + ALIGN, np.uint8)
            self.addr = self.buf.ctypes.data + (-self.buf.ctypes.data) % ALIGN
        else:
            self.buf = None
            self.addr = cuda.reserve(self.nbytes)
        cuda._track(self)

    def __int__(self):
        return self.addr

    def view(self, dtype, count, offset=0):
        start = self.addr - self.buf.ctypes.data + offset
        return self.buf[start:start + count * np.dtype(dtype).itemsize].view(dtype)

    def __del__(self):
        try:
            if self.pool is not None and self.pool.holding:
                if not self.pool.held_blocks and not self.cuda.stack():
                    # PyCUDA's pool binds its held blocks to the current context when
                    # it starts holding; with none, its C++ destructor throws: abort
                    self.cuda.aborted(f"a block returned to an empty DeviceMemoryPool on "
                                      f"thread {threading.current_thread().name} with no "
                                      "current context")
                self.pool.held.setdefault(self.nbytes, []).append(self.reborn())
            else:
                self.free()
        except Exception:    # interpreter shutdown
            pass

    def free(self):
        """cuMemFree in the allocation's context (see FakeCuda.cleanup: leaked
        when PyCUDA could not make that context current here)."""
        if self.cuda.cleanup("device_allocation", self.ctx):
            self.cuda.count("mem_free")
            self.cuda._untrack(self)

    def reborn(self):
        """The same memory as a new held block (this object is being collected)."""
        block = object.__new__(_Allocation)
        block.__dict__.update(self.__dict__)
        return block


class FakePool:
    """DeviceMemoryPool: blocks of a size come back to the pool when freed. Made
    with a context current (PyCUDA's allocator is context-dependent: without
    one it raises), and allocating only with that context current (strict): a
    pool used for another device would hand out that device's memory and free
    it in its own context."""

    def __init__(self, cuda):
        self.cuda, self.held, self.holding = cuda, {}, True
        self.ctx = cuda.current("DeviceMemoryPool")

    def allocate(self, nbytes):
        nbytes = max(int(nbytes), 1)
        ctx = self.cuda.current("pool.allocate")
        if self.cuda.strict and ctx is not self.ctx:
            raise FakeDriverError(f"DeviceMemoryPool of {self.ctx} allocating with {ctx} "
                                  "current")
        blocks = self.held.get(nbytes)
        if blocks:
            block = blocks.pop()
            block.pool = self
            return block
        self.cuda.count("mem_alloc")
        return _Allocation(self.cuda, nbytes, ctx, pooled=self)

    @property
    def held_blocks(self):
        """How many freed blocks the pool holds (PyCUDA's held_blocks)."""
        return sum(map(len, self.held.values()))

    def _free_held(self):
        for blocks in self.held.values():
            for b in blocks:
                b.pool = None
                b.free()
        self.held.clear()

    def free_held(self):
        self._free_held()

    def stop_holding(self):
        self.cuda.log.append((threading.current_thread().name, "free_pool",
                              self.ctx.device.index))
        self.holding = False
        self._free_held()


class FakeArray:
    """A GPUArray: shape, dtype, gpudata, flags, get/set/copy, the CUDA array interface.
    `FakeArray.made` counts the objects made, by the constructor or by `__new__`
    alone (minigraph's loader copies a model array's attributes into new ones)."""

    made = 0

    def __new__(cls, *args, **kwargs):
        FakeArray.made += 1
        return super().__new__(cls)

    def __init__(self, cuda, shape, dtype, allocator=None):
        self.cuda, self.base = cuda, None
        self.shape = tuple(int(d) for d in (shape if isinstance(shape, tuple | list) else
                                            (shape,)))
        self.dtype = np.dtype(dtype)
        self.size = math.prod(self.shape)
        self.nbytes = self.size * self.dtype.itemsize
        self.strides = _c_strides(self.shape, self.dtype.itemsize)
        if self.size == 0:
            self.gpudata = None
            return
        if allocator is None:
            cuda.count("mem_alloc")
            self.gpudata = _Allocation(cuda, self.nbytes, cuda.current("mem_alloc"))
        else:
            self.gpudata = allocator(self.nbytes)

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def flags(self):
        """As PyCUDA's (a memoised property): made on first use, kept in the
        instance, and holding the array it describes (compyte's ArrayFlags)."""
        found = self.__dict__.get("_flags")
        if found is None:
            found = self.__dict__["_flags"] = types.SimpleNamespace(
                array=self, c_contiguous=True, f_contiguous=self.ndim <= 1)
        return found

    @classmethod
    def from_host(cls, cuda, a, allocator=None):
        a = np.asarray(a)
        out = cls(cuda, a.shape, a.dtype, allocator)
        return out.set(a)

    def _memory(self):
        """(allocation, byte offset) of the data. A view's gpudata is an address in
        its base's allocation (as in PyCUDA, whose slices are such views); a graph's
        lease (an int) carries its allocation."""
        data = self.gpudata
        lent = getattr(data, "allocation", None)
        if lent is not None:
            return lent, 0
        if isinstance(data, int):
            owner = self.base
            while isinstance(owner.gpudata, int):
                owner = owner.base
            return owner.gpudata, data - owner.gpudata.addr
        return data, 0

    def _check_owner(self, what):
        ctx = self.cuda.current(what)
        self.cuda.check_sticky(what)
        if self.cuda.strict and self.gpudata is not None and self._memory()[0].ctx is not ctx:
            raise FakeDriverError(f"{what}: array of {self._memory()[0].ctx} used with {ctx} "
                                  "current")

    def _host(self):
        memory, offset = self._memory()
        return memory.view(self.dtype, self.size, offset).reshape(self.shape)

    def set(self, a):
        self._check_owner("memcpy_htod")
        self.cuda.synchronous("memcpy_htod")
        self.cuda.count("htod")
        if self.size and self.cuda.run_kernels:
            self._host()[...] = np.asarray(a, self.dtype).reshape(self.shape)
        return self

    def get(self):
        self._check_owner("memcpy_dtoh")
        self.cuda.synchronous("memcpy_dtoh")
        self.cuda.count("dtoh")
        if self.size == 0 or not self.cuda.run_kernels:
            return np.zeros(self.shape, self.dtype)
        return self._host().copy()

    def copy(self):
        self._check_owner("memcpy_dtod")
        out = FakeArray(self.cuda, self.shape, self.dtype)
        if self.size and self.cuda.run_kernels:
            out._host()[...] = self._host()
        return out

    def fill(self, value):
        """Every element = value (GPUArray.fill, on the device)."""
        self._check_owner("fill")
        self.cuda.count("launch")
        if self.size and self.cuda.run_kernels:
            self._host()[...] = value
        return self

    def __mul__(self, factor):
        out = self.copy()
        if self.size and self.cuda.run_kernels:
            out._host()[...] *= self.dtype.type(factor)
        return out

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "typestr": self.dtype.str, "strides": None,
                "data": (int(self.gpudata) if self.gpudata is not None else 0, False),
                "version": 3}


def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


class FakeModule:
    """A loaded module (module_from_buffer, or SourceModule = compile + load): loaded
    in the current context; its functions launch only there. `compile` makes a
    fake cubin naming the kernel module and the architecture, with no context
    (PyCUDA's compile runs nvcc, and needs none when given `arch`)."""

    def __init__(self, cuda, module, arch):
        self.cuda, self.module, self.arch = cuda, module, arch
        self.ctx = cuda.current("module_from_buffer (cuModuleLoadData)")
        cuda.count("module_load")

    @staticmethod
    def compile(cuda, source, options):
        from minigraph.kernels.cuda import loader

        cuda.count("compile")
        names = [m for m in loader.module_names() if loader.read_source(m) == source]
        assert len(names) == 1, "compile of an unknown source"
        cuda.compiled[names[0]] += 1
        return f"fake-cubin {names[0]} {options.get('arch')}".encode()

    @staticmethod
    def load(cuda, cubin):
        kind, module, arch = bytes(cubin).decode().split()
        assert kind == "fake-cubin", "module_from_buffer of something not a fake cubin"
        return FakeModule(cuda, module, arch)

    def get_function(self, name):
        return FakeFunction(self, name)

    def __del__(self):
        try:
            self.cuda.cleanup("module", self.ctx)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class FakeFunction:
    """A kernel function as PyCUDA's: prepared launches, and the one function attribute
    a launcher may set (MAX_DYNAMIC_SHARED_SIZE_BYTES, checked as the driver does:
    at most the device's opt-in limit less the static shared memory; without it a
    launch may ask for at most 48 KiB of dynamic shared memory)."""

    num_regs = 32
    shared_size_bytes = 0
    DEFAULT_DYNAMIC = 48 * 1024
    OPTIN = 227 * 1024

    def __init__(self, module, name):
        self.module, self.name, self.fmt = module, name, None
        self.max_dynamic = None

    def prepare(self, fmt):
        self.fmt = fmt

    def set_attribute(self, attribute, value):
        cuda = self.module.cuda
        cuda.current(f"cuFuncSetAttribute {self.name}")
        if attribute != "max_dynamic_shared":
            raise FakeDriverError(f"cuFuncSetAttribute {self.name}: attribute {attribute!r} "
                                  "is not settable here (CUDA_ERROR_INVALID_VALUE)")
        if type(value) is not int or not 0 <= value <= self.OPTIN - self.shared_size_bytes:
            raise FakeDriverError(f"cuFuncSetAttribute {self.name}: "
                                  f"MAX_DYNAMIC_SHARED_SIZE_BYTES={value!r} with "
                                  f"{self.shared_size_bytes} static bytes is more than the "
                                  f"device's opt-in {self.OPTIN} (CUDA_ERROR_INVALID_VALUE)")
        cuda.count("set_attribute")
        self.max_dynamic = value

    def prepared_async_call(self, grid, block, stream, *args, shared_size=0):
        import kernel_emulator

        cuda = self.module.cuda
        ctx = cuda.current(f"launch {self.name}")
        cuda.count("launch")
        cuda.check_stream(f"launch {self.name}", stream, ctx)
        kernel_emulator.pack_args(self.name, self.fmt, args)    # struct.error, as PyCUDA's
        kernel_emulator.check_geometry(self.name, tuple(grid), tuple(block))
        cuda.check_sticky(f"launch {self.name}")
        allowed = self.DEFAULT_DYNAMIC if self.max_dynamic is None else self.max_dynamic
        if type(shared_size) is not int or not 0 <= shared_size <= allowed:
            raise FakeDriverError(f"launch {self.name}: {shared_size!r} bytes of dynamic shared "
                                  f"memory, more than the {allowed} its function attribute "
                                  "allows (CUDA_ERROR_INVALID_VALUE)")
        if cuda.strict:
            if ctx is not self.module.ctx:
                raise FakeDriverError(f"launch {self.name}: module of {self.module.ctx} with "
                                      f"{ctx} current (invalid handle)")
            for kind, a in zip(self.fmt, args, strict=True):
                if kind == "P" and a and cuda.owner(int(a)) is not ctx:
                    raise FakeDriverError(f"launch {self.name}: pointer {int(a):#x} belongs to "
                                          f"{cuda.owner(int(a))}, not {ctx}")
        if cuda.run_kernels:
            k = cuda.emulator().kernel(self.module.module, self.name, self.fmt)

            def work():
                with cuda.emu_lock:
                    if self.max_dynamic is not None:
                        k._launch.allow_shared(self.max_dynamic)
                    k._launch(grid, block, args, shared_size)
            cuda.enqueue(stream, work)
