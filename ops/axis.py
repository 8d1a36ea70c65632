"""Axis attributes of the op modules: one normalisation and one error. Registers nothing."""
from __future__ import annotations

from minigraph.schema import OpError


def normalized_axis(op_type, axis, rank, slot="x", attr="axis"):
    """`axis` as an index in [0, rank); an OpError naming attribute `attr` and input `slot`
    when it is outside [-rank, rank)."""
    if not -rank <= axis < rank:
        raise OpError(f"{op_type}: attribute {attr!r} must be in [{-rank}, {rank}) for input "
                      f"{slot!r} of rank {rank}, got {axis}")
    return axis % rank
