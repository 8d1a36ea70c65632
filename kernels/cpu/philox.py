"""Philox4x32-10 (Salmon et al. 2011, Random123) in vectorised numpy.

Bit for bit the generator of kernels/cuda/fill.cu: `philox(counter64, stream, seed64)`
maps its arguments onto the 4-word counter (c0, c1, c2, c3) = (counter low,
counter high, stream, 0) and the 2-word key (k0, k1) = (seed low, seed high).
Not an op module: it registers nothing.
"""
from __future__ import annotations

import numpy as np

M0, M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
W0, W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
LOW32 = np.uint64(0xFFFFFFFF)
SHIFT32 = np.uint64(32)
CHUNK = 1 << 20          # generator calls per block (bounds the temporaries' memory)


def philox4x32(counter, key):
    """Philox4x32-10 of counters `counter` = (c0, c1, c2, c3) under `key` = (k0, k1).

    Each counter word is an array (or scalar) of uint32 values, all broadcast
    together; the key words are scalars. Returns the four output words as
    uint32 arrays of the broadcast shape, in Random123's order.
    """
    c = [np.asarray(w, dtype=np.uint32) for w in np.broadcast_arrays(*counter)]
    k0, k1 = np.uint32(key[0]), np.uint32(key[1])
    with np.errstate(over="ignore"):
        for _ in range(10):
            p0 = c[0].astype(np.uint64) * M0
            p1 = c[2].astype(np.uint64) * M1
            c = [(p1 >> SHIFT32).astype(np.uint32) ^ c[1] ^ k0, (p1 & LOW32).astype(np.uint32),
                 (p0 >> SHIFT32).astype(np.uint32) ^ c[3] ^ k1, (p0 & LOW32).astype(np.uint32)]
            k0, k1 = k0 + W0, k1 + W1
    return c


def philox_words(n, stream, seed64, start=0):
    """`n` consecutive 32-bit words of fill.cu's stream `stream` under the 64-bit
    `seed64`, from word `start` on: word i is word (i % 4) of philox(counter = i // 4,
    stream, seed64). A uint32 array."""
    seed64 = int(seed64) & 0xFFFFFFFFFFFFFFFF
    key = (seed64 & 0xFFFFFFFF, seed64 >> 32)
    first, skip = divmod(int(start), 4)
    out = np.empty(4 * (-(-(n + skip) // 4)), dtype=np.uint32)
    calls = out.size // 4
    for begin in range(0, calls, CHUNK):
        i = np.arange(first + begin, first + min(begin + CHUNK, calls), dtype=np.uint64)
        words = philox4x32(((i & LOW32).astype(np.uint32), (i >> SHIFT32).astype(np.uint32),
                            np.uint32(stream), np.uint32(0)), key)
        out[4 * begin:4 * (begin + i.size)] = np.stack(words, axis=1).ravel()
    return out[skip:skip + n]


def uniforms24(words):
    """Uniforms in [0, 1) from 32-bit words: (word >> 8) / 2**24, exact in float64."""
    return (words >> np.uint32(8)).astype(np.float64) * (1.0 / 16777216.0)
