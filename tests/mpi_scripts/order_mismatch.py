"""Rank script: ranks that run collective ops in different orders.

argv[1]: "swap" - rank 0 runs sync_batch_norm then c_allreduce_avg, the
others the other way round; "skip" - the last rank skips the
sync_batch_norm step and ends. The order check (on by default) must end the
job with a message naming the mismatch, not hang.
"""
from __future__ import annotations

import sys

from rank_fails import ops as collective_ops  # this folder is on sys.path

import minigraph as mg


def main(mode):
    comm = mg.distributed.init()
    scope = mg.Scope()
    bn, avg = collective_ops(scope)
    ex = mg.Executor()
    if mode == "swap":
        ops = [bn, avg] if comm.rank == 0 else [avg, bn]
    else:
        ops = [avg] if comm.rank == comm.size - 1 else [avg, bn]
    ex.run(ops, scope)
    print(f"rank {comm.rank} finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "swap")
