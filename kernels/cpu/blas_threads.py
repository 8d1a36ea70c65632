"""OpenBLAS's threads replaced by minigraph's own pool (blas_pool.c).

OpenBLAS's worker threads busy-wait for the next product for a while after
each threaded one (its THREAD_TIMEOUT, 2^28 TSC cycles: about 0.1 s). A native
kernel that starts its own threads in that time finds a core taken by a thread
that only spins: measured on a 2-core machine, the wide MLP's inference (all
native fused_fc products) took twice as long right after a training step (whose
products are OpenBLAS's) as alone, and the OpenBLAS worker's CPU time during
that inference equalled the inference's (per-thread CPU time from
/proc/self/task/*/schedstat; docs/performance.md has the numbers).

`install()` gives OpenBLAS a threads callback (openblas_set_threads_callback_
function, OpenBLAS 0.3.27 and later): the jobs of each parallel BLAS call then run
on the pool every native kernel runs on (native_pool.h, shared by all the native
libraries), whose workers watch for the next job for at most MINIGRAPH_SPIN_US (1000
us) and then sleep, so no thread of the process spins for long and no kernel waits
for a core held by another pool's thread. OpenBLAS still decides how a product is split (into
as many jobs as its thread count, which mg.set_num_threads sets), so results are
the same bit for bit. It is installed once per process, when the first CPU plan
is compiled, into every OpenBLAS loaded then (numpy's), and affects every BLAS
call of the process from then on, the user's own numpy products too.

It is left alone with MINIGRAPH_NATIVE=0 or MINIGRAPH_BLAS_POOL=0, where the
native kernels are not built, where the BLAS is not OpenBLAS, or where OpenBLAS
has no callback (older than 0.3.27): `reason()` says which.
"""
from __future__ import annotations

import ctypes
import itertools
import os
import threading

from minigraph.kernels.cpu import blocks, native

ENV = "MINIGRAPH_BLAS_POOL"
SETTER = "openblas_set_threads_callback_function"
_AFFIXES = tuple(itertools.product(("", "scipy_"), ("", "64_", "_64")))

_lock = threading.RLock()     # install -> native.library -> install (the first load)
_installed = {}             # OpenBLAS's path -> its setter
_thread_setters = None      # each OpenBLAS's openblas_set_num_threads (set_threads)
_reason = "not tried yet"


def enabled():
    """False when MINIGRAPH_BLAS_POOL or MINIGRAPH_NATIVE switches it off."""
    off = ("0", "off", "no")
    return native.enabled() and os.environ.get(ENV, "1").strip().lower() not in off


def install():
    """Hand the parallel work of every OpenBLAS loaded now to blas_pool.c's pool, once
    per library (see the module doc). Returns the paths of the libraries it is
    installed in (empty where it is not: reason() says why)."""
    global _reason
    with _lock:
        if not enabled():
            _reason = f"{ENV} or MINIGRAPH_NATIVE is off"
            return []
        lib = _pool()
        if lib is None:
            _reason = f"blas_pool.c is not built: {native.reason('blas_pool')}"
            return []
        address = lib.blas_pool_callback_address()
        found = False
        for path in _openblas_paths():
            if path in _installed:
                found = True
                continue
            setter = _setter(path)
            if setter is None:
                continue
            if lib.blas_pool_reserve(blocks.get_num_threads()):
                _reason = "the pool's threads could not be started"
                return sorted(_installed)
            setter(address)
            _installed[path] = setter
            found = True
        if not found and not _installed:
            _reason = ("no OpenBLAS with a threads callback (OpenBLAS 0.3.27 or later) is "
                       "loaded")
        else:
            _reason = ""
        return sorted(_installed)


def uninstall():
    """Give OpenBLAS its own threads back (tests, benchmarks)."""
    with _lock:
        for setter in _installed.values():
            setter(None)
        _installed.clear()


def set_threads(n):
    """Set the threads of every OpenBLAS loaded when first called
    (openblas_set_num_threads, about 1 us; threadpoolctl's way takes far longer): a
    training step's op by op (minigraph.op_threads)."""
    global _thread_setters
    with _lock:
        if _thread_setters is None:
            _thread_setters = [fn for fn in (_symbol(path, "openblas_set_num_threads",
                                                     [ctypes.c_int])
                                             for path in _openblas_paths()) if fn is not None]
    for setter in _thread_setters:
        setter(int(n))


def installed():
    """The paths of the OpenBLAS libraries running on the pool."""
    return sorted(_installed)


def reason():
    """Why install() left OpenBLAS alone ('' where it did not)."""
    return _reason


def calls():
    """How many parallel BLAS calls have run on the pool in this process."""
    lib = _pool()
    return 0 if lib is None else lib.blas_pool_calls()


def _pool():
    lib = native.library("blas_pool")
    if lib is not None and not getattr(lib, "_typed", False):
        lib.blas_pool_callback_address.restype = ctypes.c_void_p
        lib.blas_pool_calls.restype = ctypes.c_int64
        lib.blas_pool_reserve.argtypes, lib.blas_pool_reserve.restype = [ctypes.c_int64], \
            ctypes.c_int
        lib._typed = True
    return lib


def _openblas_paths():
    import threadpoolctl

    return [info["filepath"] for info in threadpoolctl.threadpool_info()
            if info.get("internal_api") == "openblas"]


def _setter(path):
    """OpenBLAS's callback setter in the library at `path`, or None."""
    return _symbol(path, SETTER, [ctypes.c_void_p])


def _symbol(path, name, argtypes):
    """OpenBLAS's function `name` (returning nothing) in the library at `path` (its
    symbols may carry a prefix and suffix, as numpy's scipy_openblas64_ does), or
    None."""
    try:
        dll = ctypes.CDLL(path)
    except OSError:
        return None
    for prefix, suffix in _AFFIXES:
        fn = getattr(dll, f"{prefix}{name}{suffix}", None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, None
            return fn
    return None
