"""Batch transforms: whole batches at once, randomness from (seed, epoch, batch index).

A transform is a callable `t(batch, draw=None) -> batch`: `batch` is a dict
{name: array} (the DataLoader's feed), the result a new dict (the input and
its arrays are never changed). The built-in ones act on one key, "image" by
default (`key=...`), an NCHW array, and work on the whole batch with numpy
(no loop over rows).

`draw` (a `Draw`) is where a random transform gets its numbers: a generator
seeded by (seed, epoch, batch index, the transform's place in a Compose), and
the rows of the GLOBAL batch that this batch holds. A random transform draws
one value per row of the global batch and keeps its own rows' values, so a
batch split across ranks is transformed exactly as the whole batch would be
in one process, and a run repeats exactly with or without prefetching. Called
without a draw, a transform uses Draw() (seed 0, epoch 0, batch 0, every row).
"""
from __future__ import annotations

import numbers
import re
from collections.abc import Mapping

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

_TRANSFORM_STREAM = 1          # the loader's shuffling uses stream 0 of the same seed


class Draw:
    """The randomness of one batch: seed, epoch, batch index, and this batch's rows
    `rows` (a slice) of a global batch of `total` rows (default: all of them).
    The same (seed, epoch, index, path) gives the same numbers on every rank."""

    def __init__(self, seed=0, epoch=0, index=0, rows=None, total=None, path=()):
        self.seed, self.epoch, self.index, self.path = int(seed), int(epoch), int(index), path
        self.total = total
        self.rows = rows

    def generator(self):
        """A numpy Generator for this batch and this transform's place (a fresh one
        each call: the same numbers each time)."""
        key = (self.epoch, _TRANSFORM_STREAM, self.index) + tuple(self.path)
        return np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=key))

    def child(self, position):
        """The draw of the transform at `position` inside a Compose."""
        return Draw(self.seed, self.epoch, self.index, self.rows, self.total,
                    self.path + (int(position),))

    def per_row(self, n, sample):
        """This batch's rows of `sample(generator, total)`, one value per row of the
        global batch. n: this batch's rows (the global batch when no rows were given)."""
        total = n if self.total is None else self.total
        rows = slice(0, n) if self.rows is None else self.rows
        values = sample(self.generator(), total)[rows]
        if len(values) != n:
            raise ValueError(f"Draw: the batch has {n} rows but its rows {rows} of a global "
                             f"batch of {total} hold {len(values)}")
        return values


class Compose:
    """Apply `transforms` in order; each gets its own draw (its place in the list)."""

    def __init__(self, transforms):
        transforms = list(transforms)
        for k, t in enumerate(transforms):
            if not callable(t):
                raise TypeError(f"Compose: transforms[{k}] is not callable: {t!r}")
        self.transforms = transforms

    def __call__(self, batch, draw=None):
        draw = draw if draw is not None else Draw()
        for k, t in enumerate(self.transforms):
            batch = check_result(f"Compose: transforms[{k}]", t, t(batch, draw.child(k)))
        return batch

    def __repr__(self):
        return f"Compose({self.transforms!r})"


def check_result(who, transform, result):
    """`result` when it is a batch (a mapping {name: array}); else a TypeError naming
    `who` and the transform (a transform returning None, say, instead of the batch)."""
    if not isinstance(result, Mapping):
        raise TypeError(f"{who} ({describe(transform)}) returned {type(result).__name__} "
                        f"{result!r:.60}, not a batch: a transform returns the new batch, a "
                        "dict {name: array}")
    return result


def describe(transform):
    """A transform's name for messages: its repr without memory addresses."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(transform))


class _KeyTransform:
    """A transform of batch[self.key]; subclasses define _apply(x, draw)."""

    name = "transform"

    def __init__(self, key):
        if not isinstance(key, str):
            raise TypeError(f"{self.name}: key must be a str (a name in the batch), got {key!r}")
        self.key = key

    def __call__(self, batch, draw=None):
        if self.key not in batch:
            raise KeyError(f"{self.name}: the batch has no {self.key!r} (it has "
                           f"{', '.join(map(repr, batch)) or 'nothing'}); pass key=...")
        x = np.asarray(batch[self.key])
        out = dict(batch)
        out[self.key] = self._apply(x, draw if draw is not None else Draw())
        return out

    def _images(self, x):
        if x.ndim != 4:
            raise ValueError(f"{self.name}: batch[{self.key!r}] must be NCHW (rank 4), got "
                             f"shape {x.shape}")


def _size_pair(name, size):
    if isinstance(size, numbers.Integral):
        pair = (size, size)
    else:
        try:
            pair = tuple(size)
        except TypeError:
            pair = ()
    if len(pair) != 2 or not all(isinstance(s, numbers.Integral) and not isinstance(s, bool)
                                 and s >= 1 for s in pair):
        raise ValueError(f"{name}: size must be an integer >= 1 or a pair (height, width) of "
                         f"them, got {size!r}")
    return int(pair[0]), int(pair[1])


class RandomCrop(_KeyTransform):
    """Crop each image to `size` (int or (height, width)) at a random place, after
    padding each side with `padding` pixels of value `fill` (torchvision's
    RandomCrop(size, padding) with a constant fill)."""

    name = "RandomCrop"

    def __init__(self, size, padding=0, fill=0, key="image"):
        super().__init__(key)
        self.size = _size_pair(self.name, size)
        if isinstance(padding, bool) or not isinstance(padding, numbers.Integral) or padding < 0:
            raise ValueError(f"RandomCrop: padding must be an integer >= 0, got {padding!r}")
        if not isinstance(fill, numbers.Real) or not _finite(fill):
            raise ValueError(f"RandomCrop: fill must be a finite number (the padding's "
                             f"value), got {fill!r:.40}")
        self.padding, self.fill = int(padding), fill

    def _apply(self, x, draw):
        self._images(x)
        p, (h, w) = self.padding, self.size
        if p:
            _check_fits(f"RandomCrop: fill={self.fill!r}", self.fill, x.dtype, self.key)
            x = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)), constant_values=self.fill)
        room_h, room_w = x.shape[2] - h, x.shape[3] - w
        if room_h < 0 or room_w < 0:
            raise ValueError(f"RandomCrop: cannot crop {h}x{w} from batch[{self.key!r}] of "
                             f"{x.shape[2] - 2 * p}x{x.shape[3] - 2 * p} with padding {p}")
        n = x.shape[0]
        at = draw.per_row(n, lambda g, k: g.integers(0, [room_h + 1, room_w + 1], (k, 2)))
        windows = sliding_window_view(x, (h, w), axis=(2, 3))    # (N, C, H', W', h, w), a view
        return np.ascontiguousarray(windows[np.arange(n), :, at[:, 0], at[:, 1]])

    def __repr__(self):
        return (f"RandomCrop(size={self.size}, padding={self.padding}, fill={self.fill!r}, "
                f"key={self.key!r})")


def _finite(number):
    try:
        return bool(np.isfinite(float(number)))
    except OverflowError:                # an int beyond float64
        return False


def _check_fits(what, value, dtype, key):
    """A ValueError naming `what` unless the number `value` is exactly a value of
    `dtype` (the dtype of batch[key])."""
    dtype = np.dtype(dtype)
    if dtype.kind == "b":
        fits, room = value in (0, 1), "0 or 1"
    elif dtype.kind in "iu":
        info = np.iinfo(dtype)
        fits = float(value).is_integer() and info.min <= value <= info.max
        room = f"integers {info.min}..{info.max}"
    elif dtype.kind == "f":
        info = np.finfo(dtype)
        fits, room = abs(float(value)) <= float(info.max), f"at most {float(info.max):g} in size"
    else:
        fits, room = False, "numbers"
    if not fits:
        raise ValueError(f"{what} does not fit batch[{key!r}] of dtype {dtype} ({room})")


class RandomHorizontalFlip(_KeyTransform):
    """Mirror each image left to right with probability `p` (in [0, 1])."""

    name = "RandomHorizontalFlip"

    def __init__(self, p=0.5, key="image"):
        super().__init__(key)
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
            raise ValueError(f"RandomHorizontalFlip: p must be a probability in [0, 1], got {p!r}")
        self.p = float(p)

    def _apply(self, x, draw):
        self._images(x)
        flip = draw.per_row(x.shape[0], lambda g, k: g.random(k)) < self.p
        out = x.copy()
        out[flip] = x[flip, :, :, ::-1]
        return out

    def __repr__(self):
        return f"RandomHorizontalFlip(p={self.p}, key={self.key!r})"


class Normalize(_KeyTransform):
    """(x - mean) / std per channel (axis 1): mean and std are numbers or one per
    channel, std > 0. Float input keeps its dtype; integer input becomes float32."""

    name = "Normalize"

    def __init__(self, mean, std, key="image"):
        super().__init__(key)
        self.mean = self._vector("mean", mean)
        self.std = self._vector("std", std)
        if np.any(self.std <= 0):
            raise ValueError(f"Normalize: std must be > 0, got {std!r}")

    def _vector(self, what, value):
        try:
            v = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            v = None
        if v is None or v.ndim > 1 or v.size == 0 or not np.all(np.isfinite(v)):
            raise ValueError(f"Normalize: {what} must be a finite number or one per channel, "
                             f"got {value!r}")
        return v.reshape(-1)

    def _apply(self, x, draw):
        if x.ndim < 2:
            raise ValueError(f"Normalize: batch[{self.key!r}] needs a channel axis (axis 1), "
                             f"got shape {x.shape}")
        channels = x.shape[1]
        for what, v in (("mean", self.mean), ("std", self.std)):
            if v.size not in (1, channels):
                raise ValueError(f"Normalize: {v.size} {what} values for batch[{self.key!r}] "
                                 f"with {channels} channels (shape {x.shape})")
        dtype = x.dtype if np.issubdtype(x.dtype, np.floating) else np.dtype(np.float32)
        shape = (1, -1) + (1,) * (x.ndim - 2)
        info = np.finfo(dtype)
        with np.errstate(over="ignore", under="ignore"):
            mean, std = self.mean.astype(dtype), self.std.astype(dtype)
        if not np.all(np.isfinite(mean)) or not np.all(np.isfinite(std)) or \
                np.any(std < info.tiny):
            raise ValueError(f"Normalize: mean {self.mean.tolist()} and std "
                             f"{self.std.tolist()} are not usable in {dtype} (batch"
                             f"[{self.key!r}]): {dtype} holds magnitudes from "
                             f"{float(info.tiny):g} to {float(info.max):g}")
        with np.errstate(over="ignore", invalid="ignore"):
            out = (x.astype(dtype, copy=False) - mean.reshape(shape)) / std.reshape(shape)
        if not np.all(np.isfinite(out)):
            made = ~np.isfinite(out) & np.isfinite(x)
            if np.any(made):
                raise ValueError(f"Normalize: (x - mean) / std overflows {dtype} for "
                                 f"batch[{self.key!r}] ({int(made.sum())} values; mean "
                                 f"{self.mean.tolist()}, std {self.std.tolist()})")
        return out

    def __repr__(self):
        return f"Normalize(mean={self.mean.tolist()}, std={self.std.tolist()}, key={self.key!r})"
