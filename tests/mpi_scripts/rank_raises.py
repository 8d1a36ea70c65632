"""Rank script: the last rank raises while the others wait in a collective.

Without the abort that minigraph.distributed.init installs, the other ranks
would wait in their allreduce forever; with it the whole job must end with
a non-zero status, quickly.
"""
from __future__ import annotations

import numpy as np

import minigraph as mg


def main():
    comm = mg.distributed.init()
    if comm.rank == comm.size - 1:
        raise RuntimeError(f"deliberate failure on rank {comm.rank}")
    comm.allreduce(np.ones(3), what="a collective the failed rank never reaches")
    print(f"rank {comm.rank} got past a collective a dead rank never joined", flush=True)


if __name__ == "__main__":
    main()
