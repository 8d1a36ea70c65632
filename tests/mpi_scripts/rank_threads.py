"""Rank script: the threads each rank runs after mg.distributed.init().

argv[1]: "default" (init alone) or "explicit" (mg.set_num_threads(1) before init).
Every rank prints "threads rank r: E B C", E the CPU kernels' threads, B
numpy's BLAS threads (the largest any BLAS library reports), C the cores this
process may run on, then "OK rank r".
"""
from __future__ import annotations

import sys

import threadpoolctl

import minigraph as mg
from minigraph.distributed import threads


def main(mode):
    if mode == "explicit":
        mg.set_num_threads(1)
    comm = mg.distributed.init()
    assert comm.size > 1, "run me under mpiexec -n K (K >= 2)"
    blas = max(lib["num_threads"] for lib in threadpoolctl.threadpool_info()
               if lib["user_api"] == "blas")
    sys.stdout.write(f"threads rank {comm.rank}: {mg.get_num_threads()} {blas} "
                     f"{threads.host_cores()}\nOK rank {comm.rank}\n")    # one write: one piece
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1])
