"""GPU devices: which one is current on each thread, their state, and GPUError.

A GPUPlace (minigraph.place) is one device; the kernels launched for it go
to the device that is *current* on the calling thread: the one a
`with activate(place):` block entered (GPUPlace.activate), else the only GPU
place of the process, else (PyCUDA with no place made) the CUDA context
current on this thread. With two GPU places in one process and none
activated, that is an error rather than a guess.

The context rule: everything that touches a device - compiling, allocating,
launching, copying - runs with that device's context current on the calling
thread. `activate` pushes it for a whole block (the executor's run, one
collective); a launch or an allocation outside such a block pushes and pops
it around itself (kernels/cuda/loader.py). So any thread may run a net, and
two GPUs in one process each run their own kernels, with their own memory
pool, compiled modules, launch plans and error flags (`DeviceState`, one per
context).

The backend is what talks to the driver: PyCUDA (kernels/cuda/backend.py),
imported when the first kernel, array or device state is asked for, so
importing minigraph on a CPU-only machine imports nothing from pycuda. Tests
install another with `use_backend` (tests/kernel_emulator).
"""
from __future__ import annotations

import threading


class GPUError(RuntimeError):
    """No usable GPU: the message says what is missing or mismatched (pycuda,
    the driver, a device, a toolkit the driver can run) and what to do."""


# ---- devices, and which one is current ----------------------------------------------

class DeviceState:
    """What the loader keeps for one device context: its DeviceInfo, the
    allocator of its memory pool, compiled modules and kernels, last-block
    tickets, device error flags, launcher caches (`cached`), per-thread
    scratch and the backend's array makers ({(shape, dtype): make()}, see
    kernels/cuda/backend.py's PyCudaBackend.empty; `empty` calls them directly inside
    `activate`). `context` is the backend's handle (a PyCUDA Context; None for
    emulated devices); `stream` the stream every launch, copy, library call and
    NCCL call of this device goes on (a PyCUDA Stream the device owns, made with
    its context; None: the legacy default stream, as on the emulator);
    `libraries` the cuBLAS / cuDNN handles made for this context
    (kernels/cuda/libraries.py: {name: handle, or None where the library is
    not used})."""

    def __init__(self, key, info, allocate, context=None):
        self.key = key
        self.info = info
        self.allocate = allocate
        self.context = context
        self.modules = {}
        self.kernels = {}
        self.flags = {}
        self.cache = {}
        self.tickets = None
        self.scratch = {}
        self.arrays = {}
        self.pool = None
        self.stream = None
        self.libraries = {}
        self.graphs = {}

    @property
    def stream_handle(self):
        """The integer handle of `stream` (0: the legacy default stream)."""
        return 0 if self.stream is None else int(self.stream.handle)


thread_state = threading.local()   # .stack: the DeviceStates entered on this thread
places = {}            # context -> the GPUPlace made on it (register_place)


def register_place(place):
    """Record a GPU place of this process (GPUPlace does, when made): with exactly
    one, work outside `activate` goes to it."""
    places.setdefault(place.context, place)


def forget_place(context):
    """Drop the place of `context` from the registry and its DeviceState from the
    backend (at teardown; call with the context current)."""
    places.pop(context, None)
    release = getattr(_backend, "release", None)
    if release is not None:
        release(context)


def _entered():
    stack = getattr(thread_state, "stack", None)
    if stack is None:
        stack = thread_state.stack = []
    return stack


class _Enter:
    """Make `state` current on this thread for a block: push its context unless
    it already is the innermost entered one (then nothing is pushed)."""

    __slots__ = ("state", "pushed", "stack", "backend")

    def __init__(self, state):
        self.state = state

    def __enter__(self):
        stack = self.stack = _entered()
        self.pushed = not stack or stack[-1] is not self.state
        if self.pushed:
            self.backend = backend()
            self.backend.push(self.state)
            stack.append(self.state)
        return self.state

    def __exit__(self, *exc):
        if self.pushed:
            self.stack.pop()
            self.backend.pop(self.state)
        return False


def activate(place):
    """Context manager: `place`'s device is current on this thread inside the
    block (its context pushed on entry, popped on exit; nested blocks of the
    same place push nothing)."""
    return _Enter(backend().state_of(place))


def entered(state):
    """Context manager making `state` (a DeviceState) current for a block."""
    return _Enter(state)


def current():
    """The DeviceState launches on this thread go to (see the module doc)."""
    stack = getattr(thread_state, "stack", None)
    if stack:
        return stack[-1]
    return backend().default_state()


def is_entered(state):
    """True when `state` is the innermost device entered on this thread."""
    stack = getattr(thread_state, "stack", None)
    return bool(stack) and stack[-1] is state


# ---- numerics -----------------------------------------------------------------------

_tf32 = False


def set_tf32(enabled):
    """Let float32 matrix products and convolutions on a GPU use TF32 tensor cores
    (cuBLAS's CUBLAS_COMPUTE_32F_FAST_TF32, cuDNN's tensor-op math) - False by
    default: float32 results then equal the CPU's within the tests' tolerances.
    TF32 rounds each operand to a 10-bit mantissa before the multiply (sums stay
    float32): expect relative errors of about 1e-3 in products and convolutions
    against float32's 1e-6. Applies to products and convolutions planned after
    the call (plans are keyed by it); float64 is never affected, nor are the
    hand-written kernels (they never use tensor cores). Returns the old setting."""
    global _tf32
    old, _tf32 = _tf32, bool(enabled)
    return old


def tf32_enabled():
    """Whether set_tf32(True) is in force."""
    return _tf32


# ---- the backend in use ----------------------------------------------------------------

_backend = None


def backend():
    """The backend in use (PyCUDA unless a test installed another)."""
    global _backend
    if _backend is None:
        from minigraph.kernels.cuda.backend import PyCudaBackend

        try:
            _backend = PyCudaBackend()
        except ImportError as e:
            raise RuntimeError(f"minigraph GPU kernels need pycuda and a CUDA driver "
                               f"(pip install 'minigraph[gpu]'): {e}") from e
    return _backend


def use_backend(new):
    """Install `new` as the backend (None: back to PyCUDA, lazily); returns the old one."""
    global _backend
    old, _backend = _backend, new
    return old


def check_flags():
    """Check every error flag (kernels/cuda/loader.error_flag) of the current
    device (one small synchronising read each) and raise the first error found,
    with the messages of any others appended; every flag is read and reset first,
    so nothing is reported twice."""
    errors = []
    for what, flag in list(current().flags.items()):
        try:
            flag.check(what)
        except Exception as e:  # each flag raises its own error type
            errors.append(e)
    if errors:
        first = errors[0]
        if len(errors) > 1 and first.args and isinstance(first.args[0], str):
            first.args = (first.args[0] + "".join(f"\nalso: {e}" for e in errors[1:]),
                          *first.args[1:])
        raise first


def to_host(array):
    """A numpy copy of device `array` (of the current device; synchronises)."""
    state = current()
    if state.context is None or is_entered(state):
        return array.get()
    with entered(state):
        return array.get()
