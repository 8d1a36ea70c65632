"""Rank script: the last rank fails before (or while) it starts the communicator;
every other rank must end, by init's deadline, with an error naming itself and
init, and the job must end non-zero (it used to hang forever in init).

argv[1], what the last rank does instead of a plain init():
  raise   - raises before init;
  exit    - sys.exit(0) before init;
  sleep   - sleeps for an hour before init;
  timeout - sets MINIGRAPH_COLLECTIVE_TIMEOUT=abc, which only it rejects;
  order   - sets MINIGRAPH_CHECK_ORDER=0 where the others have it on;
  none    - nothing: every rank prints "OK rank r".
Run with a short deadline (MINIGRAPH_COLLECTIVE_TIMEOUT) under a hard test timeout.
"""
from __future__ import annotations

import os
import sys
import time

import minigraph as mg


def main(mode):
    last = int(os.environ.get("PMI_RANK", "0")) == int(os.environ.get("PMI_SIZE", "1")) - 1
    if last:
        if mode == "raise":
            raise RuntimeError("deliberate failure before init")
        if mode == "exit":
            sys.exit(0)
        if mode == "sleep":
            time.sleep(3600)
        if mode == "timeout":
            os.environ["MINIGRAPH_COLLECTIVE_TIMEOUT"] = "abc"
        if mode == "order":
            os.environ["MINIGRAPH_CHECK_ORDER"] = "0"
    start = time.monotonic()
    try:
        comm = mg.distributed.init()
    except ValueError as e:
        print(f"rank {os.environ.get('PMI_RANK')} init raised ValueError after "
              f"{time.monotonic() - start:.2f} s: {e}", flush=True)
        raise
    comm.barrier(what="after init")
    print(f"OK rank {comm.rank}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
