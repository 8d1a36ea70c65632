"""minigraph.data.DataLoader: order by (seed, epoch), drop_last, len, prefetching in a
background thread (errors, early exit, the bounded queue), sharding across ranks, and
2 MPI ranks that train like one process with the whole batch."""
from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
from mpi_scripts.launch import check_ok

from minigraph import data
from minigraph.data import transforms as T
from minigraph.distributed import world

PREFETCH_THREAD = "minigraph-data-prefetch"


def rows_dataset(n=50, seed=0):
    rng = np.random.default_rng(seed)
    return data.ArrayDataset(image=rng.standard_normal((n, 2, 6, 6)).astype(np.float32),
                             label=np.arange(n, dtype=np.int64))


def augment():
    return T.Compose([T.RandomCrop(6, padding=2), T.RandomHorizontalFlip(0.5),
                      T.Normalize([0.1, -0.2], [2.0, 0.5])])


def prefetch_threads():
    return [t for t in threading.enumerate() if t.name == PREFETCH_THREAD]


class FakeComm:
    """Rank `rank` of `size`; in its collectives every other rank passes `others`
    (None: what this rank passes)."""

    def __init__(self, rank, size, others=None):
        self.rank, self.size, self.others, self.calls = rank, size, others, []

    def allgather(self, x, what=""):
        self.calls.append(what)
        other = x if self.others is None else self.others[0]
        return np.stack([x if r == self.rank else other for r in range(self.size)])

    def allgather_text(self, text, what=""):
        self.calls.append(what)
        other = text if self.others is None else self.others[1]
        return [text if r == self.rank else other for r in range(self.size)]


@pytest.fixture
def ranks(monkeypatch):
    """Pretend mg.distributed.init() made a world: ranks(r, k) sets rank r of k."""
    def use(rank, size):
        monkeypatch.setattr(world, "_comm", FakeComm(rank, size))
    yield use


# ---- order, len, drop_last -----------------------------------------------------------

@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize("drop_last, sizes", [(False, [16, 16, 16, 2]), (True, [16, 16, 16])])
def test_every_row_once_per_epoch_in_global_batches(prefetch, drop_last, sizes):
    loader = data.DataLoader(rows_dataset(), 16, shuffle=True, drop_last=drop_last,
                             prefetch=prefetch)
    assert len(loader) == len(sizes)
    batches = list(loader)
    assert [len(b["label"]) for b in batches] == sizes
    seen = np.concatenate([b["label"] for b in batches])
    assert len(set(seen.tolist())) == len(seen) == sum(sizes)
    assert not np.array_equal(seen, np.sort(seen))                # shuffled
    for b in batches:                                             # rows stay together
        np.testing.assert_array_equal(b["image"], rows_dataset()[b["label"]]["image"])
        assert set(b) == {"image", "label"}


def test_without_shuffle_the_dataset_order():
    loader = data.DataLoader(rows_dataset(10), 4)
    assert [b["label"].tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert len(data.DataLoader(rows_dataset(8), 4, drop_last=True)) == 2
    assert len(data.DataLoader(rows_dataset(3), 4, drop_last=True)) == 0
    assert list(data.DataLoader(rows_dataset(3), 4, drop_last=True)) == []


def labels(loader):
    return np.concatenate([b["label"] for b in loader]).tolist()


def test_the_order_is_a_function_of_seed_and_epoch():
    a = data.DataLoader(rows_dataset(), 8, shuffle=True, seed=3)
    b = data.DataLoader(rows_dataset(), 8, shuffle=True, seed=3)
    first = [labels(a) for _ in range(3)]                 # passes advance the epoch: 0, 1, 2
    assert a.epoch == 2
    assert first[0] != first[1] != first[2]
    b.set_epoch(1)
    assert labels(b) == first[1] and b.epoch == 1
    assert labels(b) == first[2]                          # then the next epoch
    b.set_epoch(0)
    assert labels(b) == first[0]
    other = data.DataLoader(rows_dataset(), 8, shuffle=True, seed=4)
    assert labels(other) != first[0]
    np.testing.assert_array_equal(a.order(5), b.order(5))


def test_transforms_repeat_exactly_with_and_without_prefetch():
    runs = []
    for prefetch in (0, 1, 3):
        loader = data.DataLoader(rows_dataset(), 16, shuffle=True, seed=9, transform=augment(),
                                 prefetch=prefetch)
        runs.append([[b["image"] for b in loader] for _ in range(2)])     # epochs 0 and 1
    for run in runs[1:]:
        for epoch in range(2):
            for x, y in zip(runs[0][epoch], run[epoch]):
                np.testing.assert_array_equal(x, y)
    assert not np.array_equal(runs[0][0][0], runs[0][1][0])    # a new draw each epoch


def test_different_batches_draw_different_transforms():
    ds = data.ArrayDataset(image=np.ones((8, 1, 4, 4), np.float32), label=np.zeros(8))
    loader = data.DataLoader(ds, 4, transform=T.RandomCrop(4, padding=2))
    first, second = list(loader)
    assert not np.array_equal(first["image"], second["image"])


# ---- prefetching --------------------------------------------------------------------

class Boom(Exception):
    pass


class Recording:
    """A dataset that counts its batches, can fail at one, and can be slow."""

    def __init__(self, n=40, fail_at=None, delay=0.0):
        self.inner, self.fail_at, self.delay = rows_dataset(n), fail_at, delay
        self.calls = 0

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, idx):
        self.calls += 1
        time.sleep(self.delay)
        if self.calls == self.fail_at:
            raise Boom(f"batch {self.calls} is broken")
        return self.inner[idx]


def test_an_error_in_the_thread_reaches_the_loop_with_its_type():
    ds = Recording(fail_at=3)
    loader = data.DataLoader(ds, 4, prefetch=2)
    got = []
    with pytest.raises(Boom, match="batch 3 is broken"):
        for b in loader:
            got.append(b)
    assert len(got) == 2
    assert not prefetch_threads()


def test_a_transform_error_reaches_the_loop_too():
    loader = data.DataLoader(rows_dataset(), 4, prefetch=2, transform=T.Normalize([1, 2, 3], 1))
    with pytest.raises(ValueError, match="Normalize: 3 mean values .* with 2 channels"):
        next(iter(loader))
    assert not prefetch_threads()


def test_leaving_the_loop_early_stops_the_thread():
    ds = Recording(n=400, delay=0.002)
    loader = data.DataLoader(ds, 4, prefetch=2)
    for k, _ in enumerate(loader):
        if k == 1:
            break
    assert not prefetch_threads()
    calls = ds.calls
    time.sleep(0.05)
    assert ds.calls == calls <= 2 + 2 + 1          # taken, queued, one in the making
    it = iter(loader)
    next(it)
    assert prefetch_threads()
    it.close()                                     # an abandoned iterator, closed
    assert not prefetch_threads()


def test_the_queue_is_bounded():
    ds = Recording(n=400)
    it = iter(data.DataLoader(ds, 4, prefetch=3))
    next(it)
    time.sleep(0.2)                                # the thread runs ahead, then waits
    assert ds.calls <= 1 + 3 + 1
    it.close()


def test_an_exception_in_the_loop_body_stops_the_thread():
    loader = data.DataLoader(Recording(n=400), 4, prefetch=2)

    def train():
        for _ in loader:
            raise KeyError("in the loop")

    with pytest.raises(KeyError, match="in the loop"):
        train()
    assert not prefetch_threads()


# ---- sharding -----------------------------------------------------------------------

@pytest.mark.parametrize("size", [2, 3, 5])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_ranks_get_array_split_parts_of_each_global_batch(ranks, size, prefetch):
    whole = data.DataLoader(rows_dataset(), 16, shuffle=True, seed=1, transform=augment(),
                            prefetch=prefetch, shard=False)
    ranks(0, size)                                    # shard=False ignores the world
    want = list(whole)
    parts = []
    for rank in range(size):
        ranks(rank, size)
        loader = data.DataLoader(rows_dataset(), 16, shuffle=True, seed=1, transform=augment(),
                                 prefetch=prefetch)
        assert len(loader) == len(whole) == 4
        parts.append(list(loader))
    for k, batch in enumerate(want):
        sizes = [len(a) for a in np.array_split(np.arange(len(batch["label"])), size)]
        assert [len(p[k]["label"]) for p in parts] == sizes       # 2 rows / 3 ranks: 1, 1, 0
        for name in ("image", "label"):
            np.testing.assert_array_equal(np.concatenate([p[k][name] for p in parts]),
                                          batch[name])
    assert parts[-1][-1]["image"].shape[1:] == (2, 6, 6)          # an empty part keeps its shape


def test_before_init_the_loader_does_not_shard(monkeypatch):
    monkeypatch.setattr(world, "_comm", None)
    loader = data.DataLoader(rows_dataset(), 16)
    assert loader.rank_and_size() == (0, 1)
    assert [len(b["label"]) for b in loader] == [16, 16, 16, 2]


# ---- bad arguments -------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    ({"batch_size": 0}, "batch_size must be an integer >= 1, got 0"),
    ({"batch_size": 2.0}, "batch_size must be an integer >= 1, got 2.0"),
    ({"batch_size": 4, "seed": -1}, "seed must be an integer >= 0, got -1"),
    ({"batch_size": 4, "prefetch": -1}, "prefetch must be an integer >= 0, got -1"),
    ({"batch_size": 4, "shuffle": "yes"}, "shuffle must be True or False"),
    ({"batch_size": 4, "drop_last": None}, "drop_last must be True or False"),
])
def test_bad_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=f"DataLoader: {message}"):
        data.DataLoader(rows_dataset(), **kwargs)


def test_bad_dataset_transform_and_epoch():
    with pytest.raises(TypeError, match="DataLoader: dataset must have len"):
        data.DataLoader(object(), 4)
    with pytest.raises(TypeError, match="DataLoader: transform must be callable"):
        data.DataLoader(rows_dataset(), 4, transform="crop")
    loader = data.DataLoader(rows_dataset(), 4)
    with pytest.raises(ValueError, match="set_epoch: epoch must be an integer >= 0, got -1"):
        loader.set_epoch(-1)


# ---- ranks that disagree ----------------------------------------------------------------

def test_a_sharded_pass_over_several_ranks_compares_the_settings_first(ranks, monkeypatch):
    comm = FakeComm(1, 3)
    monkeypatch.setattr(world, "_comm", comm)
    loader = data.DataLoader(rows_dataset(), 16, shuffle=True, transform=augment())
    for _ in range(2):
        list(loader)
    assert comm.calls == ["DataLoader: compare settings"] * 2          # once per pass
    list(data.DataLoader(rows_dataset(), 16, shard=False))            # every rank whole
    ranks(0, 1)
    list(data.DataLoader(rows_dataset(), 16))                         # a world of one
    assert len(comm.calls) == 2


def test_ranks_whose_loaders_differ_get_an_error_naming_the_setting(monkeypatch):
    import hashlib

    from minigraph.distributed import SettingsMismatchError

    theirs = data.DataLoader(rows_dataset(52), 16, shuffle=True, seed=1)
    text = "\n".join(f"{k}\t{v}" for k, v in theirs.settings(0).items())
    digest = np.frombuffer(hashlib.blake2b(text.encode(), digest_size=8).digest(), np.int64)
    comm = FakeComm(0, 2, others=(digest, text))
    monkeypatch.setattr(world, "_comm", comm)
    mine = data.DataLoader(rows_dataset(50), 16, shuffle=True, seed=0, prefetch=2)
    assert len(mine) == len(theirs) == 4                   # nothing else would notice
    with pytest.raises(SettingsMismatchError) as e:
        next(iter(mine))
    assert str(e.value).startswith("DataLoader: the ranks' settings differ: rows (rank 0: "
                                   "50, rank 1: 52); seed (rank 0: 0, rank 1: 1). Every rank "
                                   "must build the same DataLoader")
    assert not prefetch_threads()                          # refused before any thread


def test_loader_settings_are_what_decides_the_batches():
    def mine(batch, draw=None):
        return batch

    loader = data.DataLoader(rows_dataset(), 16, drop_last=True, seed=4, transform=mine)
    got = loader.settings(3)
    assert got == {"rows": 50, "batch_size": 16, "batches": 3, "shuffle": False,
                   "drop_last": True, "seed": 4, "epoch": 3,
                   "dataset": "image float32[2, 6, 6], label int64[]",
                   "transform": got["transform"]}
    assert "0x" not in got["transform"] and "mine" in got["transform"]   # no address
    again = data.DataLoader(rows_dataset(), 16, drop_last=True, seed=4, transform=mine,
                            prefetch=0)
    assert again.settings(3) == got                        # prefetch does not count


# ---- 2 MPI ranks train like one process ------------------------------------------------

@pytest.mark.mpi
@pytest.mark.parametrize("ranks_", [2, 3])
def test_sharded_loader_sync_bn_and_data_parallel_equal_one_process(ranks_):
    """50 rows, global batch 16 (a last batch of 2: with 3 ranks one rank gets none),
    2 epochs with crop and flip and prefetching: every rank's batch is its part of the
    one-process batch, the losses and the trained parameters equal one process's to 1e-5."""
    check_ok("loader_sharded_check.py", ranks_, timeout=120)


@pytest.mark.mpi
@pytest.mark.parametrize("mode, named", [
    ("seed", "seed (rank 0: 0, rank 1: 0, rank 2: 1)"),
    ("rows", "rows (rank 0: 60, rank 1: 60, rank 2: 62)"),
    ("batch", "batch_size (rank 0: 16, rank 1: 16, rank 2: 15)"),
    ("epoch", "epoch (rank 0: 0, rank 1: 0, rank 2: 1)"),
    ("transform", "transform (rank 0: Compose([RandomCrop"),
    ("same", None),
])
def test_three_ranks_whose_loaders_differ_are_refused_on_every_rank(mode, named):
    """The last rank's loader differs but gives the same 4 batches: it used to train on
    duplicated and missing rows without a word."""
    out = check_ok("loader_differs.py", 3, mode, timeout=60)
    refused = re.findall(r"REFUSED rank (\d+): (.*)", out)
    if named is None:
        assert not refused, out
        return
    assert sorted(r for r, _ in refused) == ["0", "1", "2"], out
    for _, message in refused:
        assert message.startswith("DataLoader: the ranks' settings differ: " + named), message
