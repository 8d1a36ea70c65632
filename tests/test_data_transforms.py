"""minigraph.data.transforms: RandomCrop, RandomHorizontalFlip, Normalize and Compose on
whole batches, their randomness from (seed, epoch, batch index), split across ranks
exactly as the whole batch, and their errors."""
from __future__ import annotations

import numpy as np
import pytest

from minigraph.data import transforms as T


def batch(n=64, c=3, h=5, w=6, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {"image": rng.standard_normal((n, c, h, w)).astype(dtype),
            "label": np.arange(n, dtype=np.int64)}


def frozen(b):
    for a in b.values():
        a.setflags(write=False)
    return b


def crop_offsets(x, out, padding):
    """Per row, the (dy, dx) at which `out` was cut from `x` padded by `padding` (each row
    of random values matches at one place only)."""
    padded = np.pad(x, ((0, 0), (0, 0), (padding,) * 2, (padding,) * 2))
    h, w = out.shape[2:]
    found = []
    for i in range(len(x)):
        where = [(dy, dx) for dy in range(padded.shape[2] - h + 1)
                 for dx in range(padded.shape[3] - w + 1)
                 if np.array_equal(padded[i, :, dy:dy + h, dx:dx + w], out[i])]
        assert len(where) == 1, f"row {i}: output is not one crop of the padded image"
        found.append(where[0])
    return np.array(found)


# ---- RandomCrop ---------------------------------------------------------------------------

def test_random_crop_cuts_each_row_at_its_own_place_in_the_padded_image():
    b = frozen(batch())
    out = T.RandomCrop(5, padding=2)(b, T.Draw(seed=1))
    assert out["image"].shape == (64, 3, 5, 5) and out["image"].dtype == np.float32
    assert out["label"] is b["label"]                         # other keys pass through
    at = crop_offsets(b["image"], out["image"], 2)
    assert set(at[:, 0]) == set(range(5)) and set(at[:, 1]) == set(range(6))   # all places
    assert out["image"].flags.c_contiguous


def test_random_crop_sizes_pairs_and_no_padding():
    b = batch(n=8, h=7, w=9)
    out = T.RandomCrop((4, 6))(b)
    assert out["image"].shape == (8, 3, 4, 6)
    crop_offsets(b["image"], out["image"], 0)
    same = T.RandomCrop((7, 9))(b)                              # the whole image: a copy
    np.testing.assert_array_equal(same["image"], b["image"])
    filled = T.RandomCrop(7, padding=3, fill=5.0)(batch(n=200, h=7, w=7))
    assert np.any(filled["image"] == 5.0)


def test_random_crop_of_an_empty_batch():
    out = T.RandomCrop(4, padding=1)(batch(n=0, h=4, w=4))
    assert out["image"].shape == (0, 3, 4, 4)


# ---- RandomHorizontalFlip -----------------------------------------------------------------

def test_flip_mirrors_about_a_fraction_p_of_the_rows():
    b = frozen(batch(n=2000, c=1, h=2, w=3))
    x = b["image"]
    out = T.RandomHorizontalFlip(0.3)(b, T.Draw(seed=4))["image"]
    flipped = np.array([np.array_equal(o, r[..., ::-1]) for o, r in zip(out, x)])
    kept = np.array([np.array_equal(o, r) for o, r in zip(out, x)])
    assert np.all(flipped ^ kept)
    assert 0.25 < flipped.mean() < 0.35
    np.testing.assert_array_equal(T.RandomHorizontalFlip(0.0)(b)["image"], x)
    np.testing.assert_array_equal(T.RandomHorizontalFlip(1.0)(b)["image"], x[..., ::-1])


# ---- Normalize ---------------------------------------------------------------------------

def test_normalize_per_channel_and_scalar():
    b = frozen(batch(c=3))
    mean, std = [0.5, -1.0, 2.0], [2.0, 0.25, 1.0]
    out = T.Normalize(mean, std)(b)["image"]
    want = (b["image"] - np.float32(mean).reshape(1, 3, 1, 1)) / np.float32(std).reshape(1, 3, 1, 1)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    assert out.dtype == np.float32
    np.testing.assert_allclose(T.Normalize(1.0, 2.0)(b)["image"], (b["image"] - 1) / 2, rtol=1e-6)
    as64 = T.Normalize(0.0, 2.0)(batch(dtype=np.float64))["image"]
    assert as64.dtype == np.float64
    ints = {"image": np.full((2, 1, 2, 2), 255, dtype=np.uint8)}
    out = T.Normalize(127.5, 127.5)(ints)["image"]
    assert out.dtype == np.float32 and np.all(out == 1.0)
    flat = {"x": np.ones((4, 2))}
    np.testing.assert_array_equal(T.Normalize([1, 0], [1, 2], key="x")(flat)["x"],
                                  [[0, 0.5]] * 4)


@pytest.mark.parametrize("mean, std, message", [
    (0.0, 0.0, "std must be > 0"),
    (0.0, [1.0, -1.0], "std must be > 0"),
    ([], 1.0, "mean must be a finite number or one per channel"),
    (float("nan"), 1.0, "mean must be a finite number"),
    ("a", 1.0, "mean must be a finite number"),
    ([[1.0]], 1.0, "mean must be a finite number or one per channel"),
])
def test_normalize_rejects_bad_statistics(mean, std, message):
    with pytest.raises(ValueError, match=f"Normalize: {message}"):
        T.Normalize(mean, std)


def test_normalize_needs_matching_channels():
    with pytest.raises(ValueError, match=r"Normalize: 2 std values for batch\['image'\] with 3 "):
        T.Normalize(0.0, [1.0, 2.0])(batch(c=3))
    with pytest.raises(ValueError, match="needs a channel axis"):
        T.Normalize(0.0, 1.0)({"image": np.ones(3)})


# ---- randomness: (seed, epoch, batch index), ranks, Compose ---------------------------------

def test_draws_repeat_and_differ_by_seed_epoch_and_batch():
    b, crop = batch(), T.RandomCrop(5, padding=2)
    first = crop(b, T.Draw(seed=1, epoch=2, index=3))["image"]
    np.testing.assert_array_equal(crop(b, T.Draw(seed=1, epoch=2, index=3))["image"], first)
    for other in (T.Draw(seed=2, epoch=2, index=3), T.Draw(seed=1, epoch=3, index=3),
                  T.Draw(seed=1, epoch=2, index=4)):
        assert not np.array_equal(crop(b, other)["image"], first)


@pytest.mark.parametrize("ranks", [2, 3, 7])
def test_a_batch_split_across_ranks_is_transformed_as_the_whole_batch(ranks):
    b = batch(n=20)
    t = T.Compose([T.RandomCrop(4, padding=1), T.RandomHorizontalFlip(),
                   T.Normalize([0, 1, 2], [1, 2, 3])])
    whole = t(b, T.Draw(seed=5, epoch=1, index=2))["image"]
    parts, lo = [], 0
    for rows in np.array_split(np.arange(20), ranks):
        hi = lo + len(rows)
        part = {k: v[lo:hi] for k, v in b.items()}
        parts.append(t(part, T.Draw(5, 1, 2, rows=slice(lo, hi), total=20))["image"])
        lo = hi
    np.testing.assert_array_equal(np.concatenate(parts), whole)


def test_compose_gives_each_transform_its_own_draw():
    b = batch(n=32, h=4, w=4)
    twice = T.Compose([T.RandomCrop(4, padding=2), T.RandomCrop(4, padding=2)])
    one = T.RandomCrop(4, padding=2)
    assert not np.array_equal(twice(b)["image"], one(one(b))["image"])
    assert "RandomCrop" in repr(twice)
    with pytest.raises(TypeError, match=r"Compose: transforms\[1\] is not callable"):
        T.Compose([one, 3])


def test_a_draw_with_rows_that_do_not_match_the_batch_is_an_error():
    with pytest.raises(ValueError, match="Draw: the batch has 4 rows but its rows"):
        T.RandomHorizontalFlip()(batch(n=4), T.Draw(rows=slice(0, 3), total=10))


# ---- errors -----------------------------------------------------------------------------

def test_errors_name_the_transform_and_the_argument():
    with pytest.raises(KeyError, match="RandomCrop: the batch has no 'image' .*'x'.*pass key="):
        T.RandomCrop(2)({"x": np.ones((1, 1, 2, 2))})
    with pytest.raises(ValueError, match=r"RandomHorizontalFlip: batch\['image'\] must be NCHW"):
        T.RandomHorizontalFlip()({"image": np.ones((2, 3, 4))})
    with pytest.raises(ValueError, match="RandomCrop: cannot crop 9x9 from batch"):
        T.RandomCrop(9, padding=1)(batch(h=6, w=6))
    for size in (0, (3,), (2, -1), 2.5, True):
        with pytest.raises(ValueError, match="RandomCrop: size must be an integer >= 1"):
            T.RandomCrop(size)
    with pytest.raises(ValueError, match="RandomCrop: padding must be an integer >= 0"):
        T.RandomCrop(2, padding=-1)
    for p in (-0.1, 1.5, "0.5", True):
        with pytest.raises(ValueError, match="RandomHorizontalFlip: p must be a probability"):
            T.RandomHorizontalFlip(p)
    with pytest.raises(TypeError, match="Normalize: key must be a str"):
        T.Normalize(0, 1, key=0)


def test_transforms_act_on_the_key_given():
    b = {"image": np.zeros((4, 1, 2, 2)), "mask": np.arange(16.0).reshape(4, 1, 2, 2)}
    out = T.RandomHorizontalFlip(1.0, key="mask")(b)
    np.testing.assert_array_equal(out["mask"], b["mask"][..., ::-1])
    assert out["image"] is b["image"]


def test_random_crop_fill_must_fit_the_images_dtype():
    """fill=300 on uint8 used to wrap around to 44 in silence."""
    images = {"image": np.full((2, 1, 3, 3), 7, np.uint8)}
    with pytest.raises(ValueError, match=r"RandomCrop: fill=300 does not fit batch\['image'\] "
                                         r"of dtype uint8 \(integers 0..255\)"):
        T.RandomCrop(3, padding=1, fill=300)(images)
    with pytest.raises(ValueError, match="RandomCrop: fill=-1 does not fit"):
        T.RandomCrop(3, padding=1, fill=-1)(images)
    with pytest.raises(ValueError, match="RandomCrop: fill=0.5 does not fit"):
        T.RandomCrop(3, padding=1, fill=0.5)(images)
    with pytest.raises(ValueError, match=r"RandomCrop: fill=1e\+39 does not fit batch\['image'\] "
                                         "of dtype float32"):
        T.RandomCrop(3, padding=1, fill=1e39)(batch(h=3, w=3))
    for fill in ("0", None, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="RandomCrop: fill must be a finite number"):
            T.RandomCrop(3, padding=1, fill=fill)
    out = T.RandomCrop(5, padding=1, fill=255)(images)["image"]       # fits: padded with it
    assert out.dtype == np.uint8 and out[:, :, 0].tolist() == [[[255] * 5]] * 2
    T.RandomCrop(3, fill=300)(images)                                # no padding: unused


def test_normalize_statistics_must_be_usable_in_the_batch_dtype():
    """std=1e-300 becomes 0 in float32 and every value inf."""
    with pytest.raises(ValueError, match=r"Normalize: mean \[0.0\] and std \[1e-300\] are not "
                                         r"usable in float32 \(batch\['image'\]\)"):
        T.Normalize(0.0, 1e-300)(batch())
    with pytest.raises(ValueError, match="Normalize: mean .1e.300. .* not usable in float32"):
        T.Normalize(1e300, 1.0)(batch())
    with pytest.raises(ValueError, match="not usable in float32"):
        T.Normalize(0.0, 1e-40)(batch())                             # subnormal in float32
    np.testing.assert_allclose(T.Normalize(0.0, 1e-300)(batch(dtype=np.float64))["image"],
                               batch(dtype=np.float64)["image"] / 1e-300)
    big = {"image": np.full((1, 1, 1, 2), 3e38, np.float32)}
    with pytest.raises(ValueError, match=r"Normalize: \(x - mean\) / std overflows float32 for "
                                         r"batch\['image'\] \(2 values"):
        T.Normalize(0.0, 0.5)(big)
    nan = {"image": np.array([[[[np.nan, 1.0]]]], np.float32)}     # NaN in, NaN out: allowed
    assert np.isnan(T.Normalize(0.0, 2.0)(nan)["image"][0, 0, 0, 0])


def test_a_transform_that_returns_no_batch_is_named():
    def forgets(batch, draw=None):
        batch = dict(batch)                                          # no return

    with pytest.raises(TypeError, match=r"Compose: transforms\[1\] \(<function .*forgets>\) "
                                        "returned NoneType None, not a batch"):
        T.Compose([T.RandomHorizontalFlip(), forgets])(batch())
    from minigraph.data import ArrayDataset, DataLoader

    ds = ArrayDataset(**batch(8))
    for prefetch in (0, 2):
        loader = DataLoader(ds, 4, transform=lambda b, d: b["image"], prefetch=prefetch)
        with pytest.raises(TypeError, match=r"DataLoader: transform \(<function .*<lambda>>\) "
                                            "returned ndarray .*not a batch"):
            list(loader)
