"""128 bits of hash of each row's key (the dedup index's unit), computed over
whole Arrow columns with numpy.

Here rather than Polars' `hash` because the flusher is a sidecar's process and
Polars costs it 28 MiB of RSS for this one call. Each string is read 8 bytes at a
time (zero-padded) and folded into two 64-bit states by splitmix64's finalizer, a
bijection, with different seeds and steps, then its length: two keys share both
hashes by chance about once in 2^128 pairs. Not a cryptographic hash: keys can be
crafted to collide, which costs the crafter only its own span (stored once, as a
duplicate of another). Keys longer than `LONG` bytes (never ids; a client's
feedback id may be anything) take blake2b in Python, so one long key does not
make every row of its batch walk its length.

Hashes are compared only within one process's life (the index is rebuilt from the
files at start), so nothing depends on them staying the same across versions.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

LONG = 256
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_STEP = np.uint64(0x9E3779B97F4A7C15)
_SEEDS = (np.uint64(0x5EED5EED5EED5EED), np.uint64(0x0B0B0B0B0B0B0B0B))


def _mix(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def _strings(col: pa.ChunkedArray | pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bytes, start of each row, length of each row) of a string column, null as
    empty (a key column is never null; if one is, it is one key, as in Polars)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    arr = arr.cast(pa.large_binary())
    if arr.null_count:
        arr = pc.fill_null(arr, b"")
    offsets = np.frombuffer(arr.buffers()[1], dtype=np.int64, count=len(arr) + 1, offset=arr.offset * 8)
    data = arr.buffers()[2]
    data = np.frombuffer(data, dtype=np.uint8) if data is not None else np.zeros(0, np.uint8)
    return data, offsets[:-1], np.diff(offsets)


def _words(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray, width: int):
    """Each row's bytes as uint64 words, 8 bytes at a time, zero-padded: one array
    per word position. Ids (every row the same length, a multiple of 8, packed) are
    viewed in place."""
    n = len(starts)
    size = int(lengths[0]) if n else 0
    if n and size % 8 == 0 and size <= LONG and (lengths == size).all() and int(starts[0]) == 0 \
            and len(data) >= n * size and (np.diff(starts) == size).all():
        table = data[: n * size].reshape(n, size).view(np.uint64)
        for k in range(size // 8):
            yield table[:, k]
        return
    padded = np.concatenate([data, np.zeros(8, np.uint8)])  # every 8-byte read stays inside
    last = len(padded) - 1
    for at in range(0, width, 8):
        pos = starts[:, None] + (at + np.arange(8))[None, :]
        inside = (at + np.arange(8))[None, :] < lengths[:, None]
        word = np.where(inside, padded[np.minimum(pos, last)], 0).astype(np.uint8)
        yield np.ascontiguousarray(word).view(np.uint64).ravel()


def row_hashes(keys: pa.Table) -> tuple[np.ndarray, np.ndarray]:
    """Two uint64 arrays: each row's key (every column of `keys`, in order) hashed
    twice, independently."""
    n = keys.num_rows
    h1, h2 = np.full(n, _SEEDS[0]), np.full(n, _SEEDS[1])
    long_rows = np.zeros(n, dtype=bool)
    with np.errstate(over="ignore"):
        for col in keys.columns:
            data, starts, lengths = _strings(col)
            long_rows |= lengths > LONG
            width = int(min(lengths.max(initial=0), LONG))
            uniform = bool(len(lengths)) and bool((lengths == width).all())
            for at, w in zip(range(0, width, 8), _words(data, starts, lengths, width)):
                m1, m2 = _mix(h1 ^ w), _mix(h2 + w * _STEP)
                if uniform:
                    h1, h2 = m1, m2
                else:  # a row is mixed only over its own words: its hash never depends on its batch's longest key
                    inside = lengths > at
                    h1, h2 = np.where(inside, m1, h1), np.where(inside, m2, h2)
            h1 = _mix(h1 ^ lengths.astype(np.uint64))
            h2 = _mix(h2 + lengths.astype(np.uint64) * _STEP)
    if long_rows.any():
        _long(keys, np.flatnonzero(long_rows), h1, h2)
    return h1, h2


def _long(keys: pa.Table, rows: np.ndarray, h1: np.ndarray, h2: np.ndarray) -> None:
    """blake2b of the rows holding a long key, in place."""
    picked = keys.take(pa.array(rows))
    values = [[(v or "").encode() if isinstance(v, str) else (v or b"") for v in c.to_pylist()]
              for c in picked.columns]
    for i, row in enumerate(zip(*values)):
        h = hashlib.blake2b(digest_size=16)
        for part in row:  # length-framed: ("ab", "c") is not ("a", "bc")
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        d = h.digest()
        h1[rows[i]] = int.from_bytes(d[:8], "little")
        h2[rows[i]] = int.from_bytes(d[8:], "little")
