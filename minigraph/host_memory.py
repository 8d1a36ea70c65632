"""Host memory of the CPU kernels: glibc's allocator told to keep what is freed.

Every CPU kernel returns new numpy arrays, so each step allocates and frees
the same sizes as the step before. By default glibc maps blocks over its
mmap threshold (128 KiB at first) straight from the system and unmaps them
when freed, and trims free memory off the top of its heap; the next step then
touches fresh pages, and each first touch of a page is a fault the kernel
must serve and zero. Measured on the demo net's training step: 161 faults and
about 0.2-0.3 ms of system time per 1.5 ms step; on a CIFAR-sized ResNet,
3,300 faults and 6-9 ms per step.

`keep_freed_memory()` sets glibc's mmap threshold to MMAP_THRESHOLD and its
trim threshold to TRIM_THRESHOLD (mallopt), so freed blocks stay in the heap
and the next step reuses them: no faults after the first steps. The cost is
that the process keeps the memory of its largest step mapped until it exits
(a caching allocator's trade, as in PyTorch's and Paddle's device
allocators). It runs once per process, when the first CPU plan is compiled,
and does nothing where the C library is not glibc, where the environment
already tunes malloc (any MALLOC_*_ variable or GLIBC_TUNABLES: the user's
choice wins), or where MINIGRAPH_KEEP_FREED_MEMORY=0.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

MMAP_THRESHOLD = 32 << 20      # glibc's largest accepted value on 64-bit systems
TRIM_THRESHOLD = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3

_lock = threading.Lock()
_state = None                   # None: not tried yet; else what keep_freed_memory returned


def keep_freed_memory():
    """Tune glibc's malloc as the module doc says, once per process. Returns True
    when the thresholds are set (now or before), False when left alone."""
    global _state
    with _lock:
        if _state is None:
            _state = _tune()
        return _state


def _tune():
    if os.environ.get("MINIGRAPH_KEEP_FREED_MEMORY", "1") == "0":
        return False
    if "GLIBC_TUNABLES" in os.environ or any(
            k.startswith("MALLOC_") and k.endswith("_") for k in os.environ):
        return False
    libc = _glibc()
    if libc is None:
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def _glibc():
    """The process's C library when it is glibc (it has gnu_get_libc_version), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    return libc
