"""DataLoader: batches of a dataset, shuffled by (seed, epoch), sharded across ranks,
transformed and prefetched.

    loader = data.DataLoader(ds, batch_size=64, shuffle=True, seed=0, transform=t, prefetch=2)
    for epoch in range(E):
        loader.set_epoch(epoch)
        for feed in loader:              # {name: batch array}
            net.train(feed=feed, fetch=[loss])

Order: with shuffle, a permutation drawn from (seed, epoch) alone; the
global batches are consecutive runs of `batch_size` rows of it (the last one
shorter unless drop_last). Sharding: after mg.distributed.init() with more
than one rank, each global batch is split with np.array_split's sizes and a
rank gets its part (a rank may get no rows; data_parallel(batch_size_from=...)
weighs each rank's gradient by its rows), so K ranks see together exactly the
batches one process would; every pass first compares the loader's settings
across the ranks (one allgather of a hash) and refuses ranks that differ
(seed, rows, batch size, ...), which would duplicate and drop rows.
Prefetching: a background thread makes the next `prefetch` batches (the
indexing and the transforms) while the loop trains.
"""
from __future__ import annotations

import math
import numbers
import queue
import threading

import numpy as np

from minigraph.data.transforms import Draw, check_result, describe

_ORDER_STREAM = 0              # transforms draw from stream 1 of the same seed
_POLL_S = 0.1                  # how often a waiting thread looks whether it should stop


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"DataLoader: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


class DataLoader:
    """Batches {name: array} of `dataset` (an ArrayDataset, or anything with len()
    and ds[int64 indices] -> {name: array}).

    batch_size: the GLOBAL batch (integer >= 1): split across the ranks after
      mg.distributed.init() when `shard` is True (the default).
    shuffle: a new order every epoch, a function of (seed, epoch); else the
      dataset's order.
    drop_last: leave out the last global batch when it is shorter.
    seed: integer >= 0; the order and the transforms' randomness come from it.
    transform: None or a callable (batch, draw) -> batch (see data.transforms).
    prefetch: batches made ahead in a background thread (0: in the loop itself).
    shard: False gives every rank whole global batches (e.g. to evaluate).

    Each pass over the loader uses the epoch given to set_epoch(), else the one
    after the previous pass's (0 for the first). len() is the number of global
    batches, the same on every rank. A sharded pass over several ranks first checks
    that every rank's loader agrees (check_ranks_agree): an error on every rank
    naming what differs.
    """

    def __init__(self, dataset, batch_size, shuffle=False, drop_last=False, seed=0,
                 transform=None, prefetch=2, shard=True):
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
            raise TypeError("DataLoader: dataset must have len() and dataset[indices] -> "
                            f"{{name: array}} (e.g. data.ArrayDataset), got {type(dataset)!r}")
        self.dataset = dataset
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.seed = _check_int("seed", seed, 0)
        self.prefetch = _check_int("prefetch", prefetch, 0)
        for name, value in (("shuffle", shuffle), ("drop_last", drop_last), ("shard", shard)):
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"DataLoader: {name} must be True or False, got {value!r}")
        self.shuffle, self.drop_last, self.shard = bool(shuffle), bool(drop_last), bool(shard)
        if transform is not None and not callable(transform):
            raise TypeError(f"DataLoader: transform must be callable (batch, draw) -> batch, "
                            f"got {transform!r}")
        self.transform = transform
        self.epoch = None              # the epoch of the latest pass
        self._next_epoch = 0

    def __len__(self):
        rows = len(self.dataset)
        return rows // self.batch_size if self.drop_last else math.ceil(rows / self.batch_size)

    def set_epoch(self, epoch):
        """Make the next pass epoch `epoch` (an integer >= 0): its order and its
        transforms' randomness are functions of (seed, epoch)."""
        self._next_epoch = _check_int("set_epoch: epoch", epoch, 0)

    def order(self, epoch):
        """The dataset's rows in epoch `epoch`'s order (int64), the same on every rank."""
        rows = len(self.dataset)
        if not self.shuffle:
            return np.arange(rows, dtype=np.int64)
        seq = np.random.SeedSequence(self.seed, spawn_key=(int(epoch), _ORDER_STREAM))
        return np.random.default_rng(seq).permutation(rows).astype(np.int64, copy=False)

    def rank_and_size(self):
        """(rank, ranks) this loader shards over: the communicator's after
        mg.distributed.init() (with shard=True), else (0, 1)."""
        if not self.shard:
            return 0, 1
        from minigraph.distributed import world

        if not world.is_initialized():
            return 0, 1
        comm = world.get_comm()
        return comm.rank, comm.size

    def batch(self, epoch, index, rank=0, ranks=1, order=None):
        """Global batch `index` of epoch `epoch`, rank `rank`'s part of it when split over
        `ranks`, transformed: what a pass yields there."""
        order = self.order(epoch) if order is None else order
        rows = order[index * self.batch_size:(index + 1) * self.batch_size]
        total = len(rows)
        base, extra = divmod(total, ranks)             # np.array_split's sizes
        lo = rank * base + min(rank, extra)
        hi = lo + base + (rank < extra)
        feed = self.dataset[rows[lo:hi]]
        if self.transform is not None:
            draw = Draw(self.seed, epoch, index, slice(lo, hi), total)
            feed = check_result("DataLoader: transform", self.transform,
                                self.transform(feed, draw))
        return feed

    def settings(self, epoch):
        """{name: value} of what decides the batches of pass `epoch` (every rank must
        agree on it): the dataset's rows and arrays, batch_size, len(), shuffle,
        drop_last, seed, the epoch and the transform."""
        return {"rows": len(self.dataset), "batch_size": self.batch_size, "batches": len(self),
                "shuffle": self.shuffle, "drop_last": self.drop_last, "seed": self.seed,
                "epoch": epoch, "dataset": _describe_dataset(self.dataset),
                "transform": describe(self.transform)}

    def check_ranks_agree(self, epoch, comm=None):
        """Raise SettingsMismatchError on every rank unless every rank's loader has the
        same settings(epoch): ranks that differ in seed, rows or batch size would
        otherwise train on duplicated and missing rows without a word. One allgather of
        a hash (the settings travel only when they differ); every pass of a sharded
        loader over several ranks makes it."""
        from minigraph.distributed import agree, world

        comm = comm or world.get_comm()
        agree.check_same_settings(
            comm, "DataLoader", self.settings(epoch),
            "Every rank must build the same DataLoader over the same dataset (the same "
            "seed, batch_size, drop_last and transform, and the same set_epoch calls): "
            "each rank computes the whole order and keeps its part of every batch.")

    def __iter__(self):
        epoch, self._next_epoch = self._next_epoch, self._next_epoch + 1
        self.epoch = epoch
        rank, ranks = self.rank_and_size()
        if ranks > 1:
            self.check_ranks_agree(epoch)
        order = self.order(epoch)

        def make(k):
            return self.batch(epoch, k, rank, ranks, order)

        if self.prefetch == 0:
            return (make(k) for k in range(len(self)))
        return _prefetched(make, len(self), self.prefetch)

    def __repr__(self):
        return (f"DataLoader({self.dataset!r}, batch_size={self.batch_size}, "
                f"shuffle={self.shuffle}, drop_last={self.drop_last}, seed={self.seed}, "
                f"prefetch={self.prefetch})")


def _describe_dataset(dataset):
    arrays = getattr(dataset, "arrays", None)
    if isinstance(arrays, dict):
        return ", ".join(f"{name} {np.asarray(a).dtype}{list(np.shape(a)[1:])}"
                         for name, a in arrays.items())
    return type(dataset).__qualname__


class _Failed:
    """What the thread hands over when making a batch raised."""

    def __init__(self, error):
        self.error = error


_DONE = object()


def _prefetched(make, count, depth):
    """Yield make(0), ..., make(count - 1), made by a background thread at most `depth`
    ahead. An error there is raised here (the same exception object); closing the
    generator (leaving the loop early) stops the thread and waits for it."""
    ready = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def hand(item):
        while not stop.is_set():
            try:
                ready.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def work():
        try:
            for k in range(count):
                if stop.is_set() or not hand(make(k)):
                    return
        except BaseException as e:          # noqa: B036 (handed to the loop, raised there)
            hand(_Failed(e))
            return
        hand(_DONE)

    thread = threading.Thread(target=work, name="minigraph-data-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            try:
                item = ready.get(timeout=_POLL_S)
            except queue.Empty:
                if not thread.is_alive() and ready.empty():
                    raise RuntimeError("DataLoader: the prefetch thread ended without "
                                       "handing over its batches") from None
                continue
            if item is _DONE:
                return
            if isinstance(item, _Failed):
                raise item.error
            yield item
    finally:
        stop.set()
        while thread.is_alive():
            try:                               # make room so a blocked put sees the stop
                ready.get_nowait()
            except queue.Empty:
                pass
            thread.join(_POLL_S)
