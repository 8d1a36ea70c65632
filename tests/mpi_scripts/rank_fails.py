"""Rank script: rank 1 fails between two collectives; every other rank must end
with an error naming rank 1 and the collective, within the deadline.

argv[1], what rank 1 does after collective #0 (a sync_batch_norm forward):
  stall  - sleeps for an hour;
  exit   - returns from main (a normal exit, status 0);
  die    - os._exit(0) after LEAVE_AFTER_S: gone without MPI_Finalize or atexit
           handlers;
  kill   - SIGKILL to itself;
  skip   - skips nothing and makes a different collective (sync_batch_norm again).
The others then enter collective #1 (c_allreduce_avg [w@GRAD]). A rank that
gives up prints how long it waited and the CPU time it used meanwhile, then
re-raises (the excepthook ends the job) - or, with argv[2] == "catch",
returns normally (the broken communicator must still end the job non-zero at
exit). Run with a short deadline (MINIGRAPH_COLLECTIVE_TIMEOUT) under a hard
test timeout.
"""
from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np

import minigraph as mg

LEAVE_AFTER_S = 0.2     # die: how long rank 1 waits after collective #0 before it vanishes


def ops(scope):
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
    return bn, mg.Operator("c_allreduce_avg", x=[grad], out=[grad])


def main(mode, catch=False):
    comm = mg.distributed.init()
    scope = mg.Scope()
    bn, avg = ops(scope)
    ex = mg.Executor()
    ex.run([bn], scope)                                         # collective #0
    if comm.rank == 1:
        if mode == "stall":
            time.sleep(3600)
        elif mode == "exit":
            return
        elif mode == "die":
            # the others' parts of collective #0 may still wait for rank 1's last
            # message when its own part returns (three ranks relay); let them end first
            time.sleep(LEAVE_AFTER_S)
            os._exit(0)
        elif mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif mode == "skip":
            ex.run([bn], scope)
    wall, cpu = time.monotonic(), time.process_time()
    try:
        ex.run([avg], scope)                                    # collective #1
    except mg.distributed.CollectiveError:
        print(f"rank {comm.rank} gave up after {time.monotonic() - wall:.2f} s using "
              f"{time.process_time() - cpu:.2f} s of CPU", flush=True)
        if catch:
            return
        raise
    print(f"rank {comm.rank} got past a collective rank 1 never joined", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], catch=sys.argv[2:] == ["catch"])
