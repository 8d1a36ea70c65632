"""Settings every rank must share, compared across the ranks.

`check_same_settings(comm, who, settings)` costs one allgather of an 8-byte
hash when the ranks agree; only when they differ do the settings travel, and
every rank raises the same SettingsMismatchError naming each setting that
differs and its value on each rank. The sharded DataLoader compares its
settings this way at every pass (minigraph.data.loader), as data_parallel
compares nets (minigraph.distributed.parallel.check_same_net).
"""
from __future__ import annotations

import hashlib

import numpy as np


class SettingsMismatchError(ValueError):
    """The ranks were given different values of a setting they must share."""


def check_same_settings(comm, who, settings, advice=""):
    """Raise SettingsMismatchError on every rank of `comm` unless every rank passes
    the same `settings` ({name: value}; values compared as their str()). The
    message names `who`, each differing setting with every rank's value, then
    `advice`. A world of one returns at once."""
    if comm.size == 1:
        return
    text = "\n".join(f"{name}\t{_flat(value)}" for name, value in settings.items())
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    every = comm.allgather(np.frombuffer(digest, dtype=np.int64).copy(),
                           what=f"{who}: compare settings")
    if np.all(every == every[0]):
        return
    texts = comm.allgather_text(text, what=f"{who}: describe settings")
    raise SettingsMismatchError(difference(who, texts, advice))


def difference(who, texts, advice=""):
    """The message for ranks whose settings differ: texts[r] is rank r's
    "name<TAB>value" lines."""
    tables = [dict(line.split("\t", 1) for line in t.split("\n") if line) for t in texts]
    names = list(dict.fromkeys(name for table in tables for name in table))
    parts = []
    for name in names:
        values = [table.get(name, "(not given)") for table in tables]
        if len(set(values)) > 1:
            each = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            parts.append(f"{name} ({each})")
    found = "; ".join(parts) or "they differ"
    return f"{who}: the ranks' settings differ: {found}." + (f" {advice}" if advice else "")


def _flat(value):
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace("\t", "\\t")
