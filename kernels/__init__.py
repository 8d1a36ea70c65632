"""How ops run: one folder per device.

`cpu/`: numpy engines (the blocked, threaded reductions of `blocks`, batch
norm's statistics, the im2col convolution) and native C kernels built for this
machine with the system compiler (`native`), and one module of op kernels per
op family of ops/ (kernels/cpu/activation.py for ops/activation.py, ...).

`cuda/`: the CUDA sources (*.cu, shared helpers in *.cuh), their thin PyCUDA
launchers (plain functions on device arrays, usable without the graph), the
loader that compiles them, and the op kernels that call the launchers.

An op kernel is `fn(op, ins, ctx) -> {out_slot: array}` (minigraph.schema);
the op's module in ops/ registers it for its device and float dtypes. Nothing
here imports pycuda until a GPU kernel runs.
"""


def present(**outputs):
    """{slot: array} without the outputs that were not computed (None): what a kernel
    returns when some of its optional outputs are unbound."""
    return {slot: a for slot, a in outputs.items() if a is not None}
