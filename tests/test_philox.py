"""The numpy Philox4x32-10 against Random123's known answers and fill.cu's word layout."""
import numpy as np
from references import philox4x32 as scalar_philox

from minigraph.kernels.cpu.philox import philox4x32, philox_words, uniforms24


def words(counter, key):
    return [int(w) for w in philox4x32(counter, key)]


def test_random123_known_answers():
    assert words((0, 0, 0, 0), (0, 0)) == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert words((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2) == [0x408F276D, 0x41C83B0E, 0xA20BC7C6,
                                                           0x6D5451FD]
    assert words((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
                 (0xA4093822, 0x299F31D0)) == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_vectorised_matches_scalar_on_many_counters():
    rng = np.random.default_rng(0)
    c = rng.integers(0, 2**32, (4, 50), dtype=np.uint64).astype(np.uint32)
    key = (0x89ABCDEF, 0x01234567)
    got = np.stack(philox4x32(tuple(c), key))
    for j in range(50):
        assert got[:, j].tolist() == scalar_philox([int(w) for w in c[:, j]], key)


def test_stream_layout_is_fill_cu_philox():
    """Word i is word i % 4 of philox(counter i // 4 as (low, high), stream, 0; seed low, high)."""
    seed64 = (7 << 32) + 12345
    n = 23
    got = philox_words(n, 2, seed64).tolist()
    want = []
    for i in range(6):
        want += scalar_philox([i, 0, 2, 0], [12345, 7])
    assert got == want[:n]


def test_counter_high_word_via_philox4x32():
    """A counter past 32 bits puts its high word in c1 (too long a stream to build here)."""
    i = np.array([2**32 + 5], dtype=np.uint64)
    lo, hi = (i & 0xFFFFFFFF).astype(np.uint32), (i >> np.uint64(32)).astype(np.uint32)
    assert [int(w[0]) for w in philox4x32((lo, hi, 2, 0), (1, 2))] == \
        scalar_philox([5, 1, 2, 0], [1, 2])


def test_chunks_join_seamlessly(monkeypatch):
    from minigraph.kernels.cpu import philox

    whole = philox_words(1000, 2, 99)
    monkeypatch.setattr(philox, "CHUNK", 7)
    np.testing.assert_array_equal(philox.philox_words(1000, 2, 99), whole)
    assert philox_words(0, 2, 99).size == 0


def test_uniforms24():
    w = np.array([0, 255, 256, 0xFFFFFFFF], dtype=np.uint32)
    assert uniforms24(w).tolist() == [0.0, 0.0, 2.0**-24, 1.0 - 2.0**-24]
