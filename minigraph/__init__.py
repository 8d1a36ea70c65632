"""minigraph: a small operator-graph deep-learning framework.

Scopes hold Variables; Operators bind an op's schema to Variables with
frozen attributes; an Executor runs ops on a place; a Net built by `layers`
forks into train and infer branches at its first mode-dependent op
(batch_norm, dropout, attention) or its first layer with infer-only state (a KV
cache); `generation` samples tokens from the infer branch.
"""
from minigraph import distributed, generation, initializer, io, layers, optimizer, passes
from minigraph import ops as _ops  # noqa: F401  (registers every op)
from minigraph.backward import append_backward
from minigraph.device import set_tf32, tf32_enabled
from minigraph.distributed.threads import set_num_threads
from minigraph.executor import Executor
from minigraph.kernels.cpu.blocks import get_num_threads
from minigraph.net import Net
from minigraph.operator import Operator
from minigraph.param_attr import ParamAttr
from minigraph.place import CPUPlace, GPUError, GPUPlace
from minigraph.schema import OpError
from minigraph.scope import Scope, Variable

__all__ = ["CPUPlace", "Executor", "GPUError", "GPUPlace", "Net", "OpError", "Operator",
           "ParamAttr", "Scope", "Variable", "append_backward", "distributed", "generation",
           "get_num_threads", "initializer", "io", "layers", "optimizer", "passes",
           "set_num_threads", "set_tf32", "tf32_enabled"]
__version__ = "0.1.0"


def __getattr__(name):              # mg.onnx, mg.data: imported on first use
    if name in ("onnx", "data"):
        import importlib
        return importlib.import_module("minigraph.io.onnx_export" if name == "onnx" else
                                       "minigraph.data")
    raise AttributeError(f"module 'minigraph' has no attribute {name!r}")
