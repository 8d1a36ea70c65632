"""minigraph: a small operator-graph deep-learning framework."""
from minigraph.executor import Executor
from minigraph.operator import Operator
from minigraph.place import CPUPlace, GPUPlace
from minigraph.schema import OpError
from minigraph.scope import Scope, Variable

from minigraph import ops as _ops  # noqa: F401  registers every op

__all__ = ["CPUPlace", "Executor", "GPUPlace", "OpError", "Operator", "Scope", "Variable"]
__version__ = "0.1.0"
