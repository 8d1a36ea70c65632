"""Rank script: ranks that run collective ops in different orders.

argv[1]: "swap" - rank 0 runs sync_batch_norm then c_allreduce_avg, the
others the other way round; "skip" - the last rank skips the
sync_batch_norm step and ends. The order check (on by default) must end the
job with a message naming the mismatch, not hang.
"""
from __future__ import annotations

import sys

import numpy as np

import minigraph as mg


def main(mode):
    comm = mg.distributed.init()
    scope = mg.Scope()

    def var(name, value=None, persistable=False):
        v = scope.new_var(name, persistable=persistable)
        if value is not None:
            v.set(value)
        return v

    mean, vr = var("mean", np.zeros(3), True), var("var", np.ones(3), True)
    bn = mg.Operator("sync_batch_norm", x=var("x", np.random.rand(4, 3)), estimated_mean=mean,
                     estimated_var=vr, scale=var("scale", np.ones(3), True),
                     bias=var("bias", np.zeros(3), True), y=var("y"),
                     batch_mean=var("batch_mean"), batch_var=var("batch_var"),
                     saved_mean=mean, saved_var=vr, momentum=0.9)
    grad = var("w@GRAD", np.ones(3))
    avg = mg.Operator("c_allreduce_avg", x=[grad], out=[grad])
    ex = mg.Executor()
    if mode == "swap":
        ops = [bn, avg] if comm.rank == 0 else [avg, bn]
    else:
        ops = [avg] if comm.rank == comm.size - 1 else [avg, bn]
    ex.run(ops, scope)
    print(f"rank {comm.rank} finished", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "swap")
