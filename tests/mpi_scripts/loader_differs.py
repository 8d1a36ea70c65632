"""Rank script: sharded DataLoaders that differ between ranks are refused on every rank.

argv[1], the mode, says what the last rank changes (each keeps the number of
batches, so nothing else would notice): "seed" (1 instead of 0), "rows" (a
dataset of 62 rows instead of 60), "batch" (15 instead of 16: 4 batches
either way), "epoch" (set_epoch(1) instead of 0), "transform" (a flip added);
"same" changes only what does not decide the batches (prefetch) and must
train. Each rank iterates its loader and prints "REFUSED rank r: <message>"
when it raises SettingsMismatchError, else the rows it saw, and
"OK rank r" at the end.
"""
from __future__ import annotations

import sys

import numpy as np

import minigraph as mg
from minigraph import data
from minigraph.data import transforms as T


def make(mode, last):
    rows = 62 if mode == "rows" and last else 60
    ds = data.ArrayDataset(image=np.zeros((rows, 1, 4, 4), np.float32),
                           label=np.arange(rows))
    batch = 15 if mode == "batch" and last else 16
    seed = 1 if mode == "seed" and last else 0
    steps = [T.RandomCrop(4, padding=1)]
    if mode == "transform" and last:
        steps.append(T.RandomHorizontalFlip())
    loader = data.DataLoader(ds, batch, shuffle=True, seed=seed, transform=T.Compose(steps),
                             prefetch=0 if mode == "same" and last else 2)
    loader.set_epoch(1 if mode == "epoch" and last else 0)
    return loader


def main(mode):
    comm = mg.distributed.init()
    loader = make(mode, comm.rank == comm.size - 1)
    assert len(loader) == 4
    try:
        seen = [feed["label"] for feed in loader]
    except mg.distributed.SettingsMismatchError as e:
        sys.stdout.write(f"REFUSED rank {comm.rank}: {e}\n")      # one write: one line
        sys.stdout.flush()
    else:
        mine = np.concatenate(seen)
        every = comm.allgather_text(",".join(map(str, mine.tolist())), what="rows")
        rows = sorted(int(r) for text in every for r in text.split(",") if r)
        assert rows == list(range(60)), rows
    print(f"OK rank {comm.rank}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
