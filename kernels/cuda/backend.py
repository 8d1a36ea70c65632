"""The PyCUDA backend of the loader: one DeviceState per CUDA context, kernels
compiled with nvcc after checking the toolkit against the driver.

A DeviceState is made with its context pushed: PyCUDA's DeviceMemoryPool binds
to the context current when it is made (and raises with none), and
`Context.get_device()` is static - it reads the current context - so building
them for a place first used on a worker thread, or for a second GPU while the
first one's context is current, would fail or give the wrong device.

A pool keeps a block between blocks of work: PyCUDA's pool binds the blocks it
holds to the context current when it starts holding (when a block comes back
to an empty pool), and throws from the freed array's C++ destructor when there
is none - which aborts the process. An array can be dropped on any thread,
inside `activate` or not, so leaving a block of work (`pop`) first puts one
block of a size no float array has back into an empty pool; only an allocation
of that size on another thread in between could take it out again.

Each kernel module is compiled once per process and architecture (`cubin`:
pycuda.compiler.compile, which runs `nvcc --preprocess` for its disk cache's
key on every call) and loaded once per context (module_from_buffer).

Imported by minigraph.device.backend() when the first kernel or array is asked for;
pycuda itself is imported only when a PyCudaBackend is made.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import threading
import weakref

import numpy as np

from minigraph.device import DeviceState, GPUError, current, entered, is_entered, places
from minigraph.kernels.cuda import loader
from minigraph.kernels.cuda.launch import DeviceInfo, KernelResources

ARRAY_MAKERS = 1024     # (shape, dtype) array makers kept per device
GROUP_ALIGN = 256       # bytes: where each array of an empty_group starts (cudaMalloc's alignment)
HELD_BYTES = 5          # the block a pool keeps between blocks of work (no array asks for 5 bytes
                        # but a 5-element uint8 or bool one)

# pycuda.compiler.compile -> {(module, arch): the compiled module's bytes}, for this
# process (keyed by the compiler too, so a stand-in pycuda never shares entries)
_cubins = weakref.WeakKeyDictionary()
_cubin_lock = threading.Lock()


def cubin(module, arch, nvcc):
    """The compiled bytes of kernel module `module` for `arch` (e.g. "sm_90"),
    built once per process (PyCUDA's disk cache underneath) with the nvcc that
    `nvcc()` returns - called only when it has to compile (the toolkit check);
    no context needed."""
    from pycuda.compiler import compile as nvcc_compile

    built = _cubins.get(nvcc_compile)
    found = built.get((module, arch)) if built is not None else None
    if found is None:
        with _cubin_lock:
            built = _cubins.setdefault(nvcc_compile, {})
            found = built.get((module, arch))
            if found is None:
                found = built[module, arch] = nvcc_compile(
                    loader.read_source(module), nvcc=nvcc(), options=list(loader.NVCC_OPTIONS),
                    arch=arch, include_dirs=[str(loader.kernel_dir())], no_extern_c=True)
    return found


class PyCudaBackend:
    """Kernels and arrays through PyCUDA, one DeviceState per CUDA context."""

    def __init__(self):
        import pycuda.driver as drv
        import pycuda.gpuarray as gpuarray

        self.drv = drv
        self.gpuarray = gpuarray
        self._states = {}          # Context (hashes and compares by handle) -> DeviceState
        self._lock = threading.Lock()
        self._compile_lock = threading.Lock()
        self._nvcc = None

    def state_of(self, place):
        """The DeviceState of a GPUPlace (made on first use)."""
        return self._state_for(place.context)

    def _state_for(self, ctx):
        state = self._states.get(ctx)
        if state is None:
            with self._lock:
                state = self._states.get(ctx)
                if state is None:
                    from pycuda.tools import DeviceMemoryPool

                    ctx.push()              # the pool and get_device take the current context
                    try:
                        pool = DeviceMemoryPool()
                        info = _device_info(self.drv, self.drv.Context.get_device())
                        stream = self.drv.Stream()      # the device's own (blocking) stream
                    finally:
                        self.drv.Context.pop()
                    state = DeviceState(ctx, info, pool.allocate, ctx)
                    state.pool = pool
                    state.stream = stream
                    self._states[ctx] = state
        return state

    def default_state(self):
        """The only GPU place's device; with no place, the context current on this
        thread; otherwise an error (see the module doc)."""
        if len(places) == 1:
            return self._state_for(next(iter(places)))
        if places:
            raise GPUError(f"{len(places)} GPU places in this process "
                           f"({', '.join(map(repr, places.values()))}) and none is "
                           "active on this thread: run the work under `with place.activate():` "
                           "(the Executor does this for its place)")
        ctx = self.drv.Context.get_current()
        if ctx is None:
            raise GPUError("no CUDA context is current: create minigraph.GPUPlace(i) before "
                           "launching kernels")
        return self._state_for(ctx)

    def push(self, state):
        state.context.push()

    def pop(self, state):
        pool = state.pool
        if pool is not None and not pool.held_blocks:
            keep = pool.allocate(HELD_BYTES)    # freed at once, into the pool, context current
            del keep
        self.drv.Context.pop()

    def kernel(self, module, name, fmt):
        state = current()
        found = state.kernels.get((module, name))
        if found is not None:
            return found
        with entered(state), self._compile_lock:
            mod = state.modules.get(module)
            if mod is None:
                image = cubin(module, state.info.arch, self._checked_nvcc)
                mod = state.modules[module] = self.drv.module_from_buffer(image)
            fn = mod.get_function(name)
            fn.prepare(fmt)
        res = KernelResources(regs_per_thread=fn.num_regs, shared_bytes=fn.shared_size_bytes)

        enqueue, stream = fn.prepared_async_call, state.stream

        def launch(grid, block, args, shared=0):
            enqueue(grid, block, stream, *args, shared_size=shared)

        def allow_shared(nbytes):
            fn.set_attribute(self.drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)

        found = state.kernels[(module, name)] = loader.Kernel(name, fmt, launch, res, state,
                                                              enqueue, allow_shared)
        return found

    def _checked_nvcc(self):
        if self._nvcc is None:
            self._nvcc = check_toolkit(self.drv.get_driver_version())
        return self._nvcc

    def empty(self, shape, dtype):
        """An uninitialised GPUArray from the current device's memory pool (no
        cudaMalloc and no synchronisation once the pool holds a block of that size).

        Made by `array_maker`: after the first array of a (shape, dtype) on a
        device, each one is a new GPUArray given that first one's attributes
        and its own pooled allocation - PyCUDA's constructor (shape and dtype
        normalisation, strides, launch geometry) and its contiguity flags run
        once per (shape, dtype), not once per array."""
        state = current()
        try:
            make = state.arrays[shape, dtype]
        except KeyError:                        # new (or spelled anew: np.float32 for its dtype)
            make = state.arrays[shape, dtype] = self.array_maker(state, tuple(shape),
                                                                 np.dtype(dtype))
        except TypeError:                       # an unhashable shape (a list)
            make = self.array_maker(state, tuple(shape), np.dtype(dtype))
        if is_entered(state):
            return make()
        with entered(state):
            return make()

    def array_maker(self, state, shape, dtype):
        """make() -> a new pooled GPUArray of `shape` and `dtype` on `state`'s device
        (call it with that device's context current), memoised per device in
        state.arrays (at most ARRAY_MAKERS entries).

        The attributes come from one GPUArray built by PyCUDA's constructor (its
        flags read once, so that their memo is among them): every attribute but
        the allocation depends only on shape, dtype, allocator and device. Empty
        shapes (no allocation) go through the constructor every time."""
        model = self._model(state, shape, dtype)
        if model is None:
            def make():
                return self.gpuarray.empty(shape, dtype, allocator=state.allocate)
        else:
            cls, attributes, nbytes = model
            new = cls.__new__

            def make():                 # state.allocate read each time: a capture swaps it
                array = new(cls)
                found = attributes.copy()
                found["gpudata"] = state.allocate(nbytes)
                array.__dict__ = found
                return array
        return self._keep(state, (shape, dtype), make)

    def empty_group(self, shapes, dtype):
        """GPUArrays of `shapes` (a tuple of shapes) and `dtype` carved from one pooled
        allocation (see loader.empty_group): the first owns it, the others are
        views into it (an address as gpudata and the first as base, as PyCUDA's
        own slices are), each starting on a GROUP_ALIGN boundary."""
        state = current()
        key = ("group", shapes, dtype)
        make = state.arrays.get(key)
        if make is None:
            make = self.group_maker(state, tuple(tuple(s) for s in shapes), np.dtype(dtype))
            state.arrays[key] = make
        if is_entered(state):
            return make()
        with entered(state):
            return make()

    def group_maker(self, state, shapes, dtype):
        """make() -> the arrays of empty_group(shapes, dtype), memoised like array_maker;
        a group with an empty shape is made array by array."""
        models = [self._model(state, s, dtype) for s in shapes]
        if any(m is None for m in models):
            makers = [self.array_maker(state, s, dtype) for s in shapes]
            return self._keep(state, ("group", shapes, dtype),
                              lambda: [make() for make in makers])
        cls, first, _ = models[0]
        new, views, total = cls.__new__, [], 0
        for _, attributes, nbytes in models:
            views.append((attributes, total))
            total += -(-nbytes // GROUP_ALIGN) * GROUP_ALIGN
        views = views[1:]

        def make():
            owner = new(cls)
            found = first.copy()
            found["gpudata"] = allocation = state.allocate(total)
            owner.__dict__ = found
            start, arrays = int(allocation), [owner]
            for attributes, offset in views:
                array = new(cls)
                found = attributes.copy()
                found["gpudata"], found["base"] = start + offset, owner
                array.__dict__ = found
                arrays.append(array)
            return arrays
        return self._keep(state, ("group", shapes, dtype), make)

    def _model(self, state, shape, dtype):
        """(class, attributes but the allocation, nbytes) of a GPUArray of `shape` and
        `dtype` on `state`'s device, from one made by PyCUDA's constructor; None for
        an empty shape. The model gives its allocation back to the pool at once: its
        flags memo (among the attributes) holds the model itself."""
        with entered(state):
            model = self.gpuarray.empty(shape, dtype, allocator=state.allocate)
            if model.gpudata is None:
                return None
            model.flags.c_contiguous              # noqa: B018 - fills the flags memo
            attributes = dict(vars(model))
            del attributes["gpudata"]
            model.gpudata = None
        return type(model), attributes, model.nbytes

    @staticmethod
    def _keep(state, key, make):
        if len(state.arrays) >= ARRAY_MAKERS:
            state.arrays.clear()
        state.arrays[key] = make
        return make

    def copy(self, array):
        """A pooled copy of device `array` (any dtype; a device-to-device memcpy
        enqueued on the current device's stream)."""
        state = current()
        with entered(state):
            out = self.empty(array.shape, array.dtype)
            if array.size:
                self.drv.memcpy_dtod_async(out.gpudata, loader.ptr(array, "copy: source"),
                                           array.nbytes, state.stream)
            return out

    def copy_into(self, dest, src):
        """Copy device array `src` into device array `dest` (same size) on the current
        device's stream."""
        state = current()
        with entered(state):
            if src.nbytes != dest.nbytes:
                raise ValueError(f"copy_into: {src.nbytes} bytes into {dest.nbytes}")
            if src.nbytes:
                self.drv.memcpy_dtod_async(loader.address(dest), loader.address(src),
                                           src.nbytes, state.stream)

    def to_device(self, array):
        """A pooled GPUArray copy of numpy `array` (C-contiguous) on the current device
        (what gpuarray.to_gpu does, with the array from `empty`)."""
        state = current()
        with entered(state):
            out = self.empty(array.shape, array.dtype)
            out.set(array)
            return out

    def release(self, ctx):
        """Forget the DeviceState of `ctx` (call with ctx current): drop its
        kernels, modules, flags and caches, then give the pool's memory back."""
        state = self._states.pop(ctx, None)
        if state is None:
            return
        from minigraph.kernels.cuda import libraries

        libraries.release(state)
        state.kernels.clear()
        state.modules.clear()
        state.flags.clear()
        state.cache.clear()
        state.tickets = None
        state.scratch.clear()
        state.arrays.clear()
        state.graphs.clear()
        state.stream = None
        if state.pool is not None:
            state.pool.stop_holding()


def _device_info(drv, dev):
    attrs = dev.get_attributes()
    a = drv.device_attribute

    def get(name, default):
        key = getattr(a, name, None)
        return attrs.get(key, default) if key is not None else default

    return DeviceInfo(
        name=dev.name(), compute_capability=tuple(dev.compute_capability()),
        sm_count=get("MULTIPROCESSOR_COUNT", 1),
        max_threads_per_block=get("MAX_THREADS_PER_BLOCK", 1024),
        max_threads_per_sm=get("MAX_THREADS_PER_MULTIPROCESSOR", 2048),
        max_blocks_per_sm=get("MAX_BLOCKS_PER_MULTIPROCESSOR", 16),
        regs_per_sm=get("MAX_REGISTERS_PER_MULTIPROCESSOR", 65536),
        shared_per_sm=get("MAX_SHARED_MEMORY_PER_MULTIPROCESSOR", 48 * 1024),
        shared_per_block_optin=get("MAX_SHARED_MEMORY_PER_BLOCK_OPTIN", 48 * 1024),
        max_grid=(get("MAX_GRID_DIM_X", 2**31 - 1), get("MAX_GRID_DIM_Y", 65535),
                  get("MAX_GRID_DIM_Z", 65535)),
        total_memory=dev.total_memory())


# ---- the toolkit against the driver -----------------------------------------------

def nvcc_version(nvcc):
    """(major, minor) of the CUDA toolkit of `nvcc` (from `nvcc --version`)."""
    done = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=120)
    found = re.search(r"release (\d+)\.(\d+)", done.stdout)
    if done.returncode or found is None:
        raise GPUError(f"could not read the CUDA toolkit version from `{nvcc} --version` "
                       f"(exit {done.returncode}): {(done.stdout + done.stderr)[-500:]}")
    return int(found.group(1)), int(found.group(2))


def check_toolkit(driver_version, nvcc="nvcc"):
    """The path of the nvcc the kernels are compiled with (the first on PATH), after
    checking that the driver can load what it builds. `driver_version` is
    pycuda.driver.get_driver_version() (1000 * major + 10 * minor, e.g. 12040).

    A toolkit of a newer major version than the driver's (CUDA 13 on a driver
    for CUDA 12) builds kernels the driver rejects at load: GPUError naming
    both versions and the fix. A newer minor version of the same major is
    fine: cubins built for the device's own architecture load under CUDA's
    minor version compatibility."""
    path = shutil.which(nvcc)
    if path is None:
        raise GPUError(f"the CUDA toolkit's `{nvcc}` is not on PATH: the GPU kernels are "
                       "compiled with it at first use; install a toolkit the driver supports "
                       f"(CUDA {_version_text(driver_version)} or older) and put its bin "
                       "directory first on PATH")
    major, minor = nvcc_version(path)
    driver_major = int(driver_version) // 1000
    if major > driver_major:
        raise GPUError(
            f"the CUDA toolkit ({path}: CUDA {major}.{minor}) is newer than the driver "
            f"supports (CUDA {_version_text(driver_version)}): kernels it builds would not "
            f"load. Put a CUDA {driver_major}.x toolkit first on PATH (and CUDA_ROOT / "
            f"CUDA_HOME at it), or update the NVIDIA driver to one for CUDA {major}.{minor}")
    return path


def _version_text(driver_version):
    v = int(driver_version)
    return f"{v // 1000}.{v % 1000 // 10}"
