"""The halo layout alone: every group size simulated in one process, no MPI.

Each rank's :class:`HaloLayout` says which rows it sends and receives under
which tags; delivering every message by (source, destination, tag), as MPI
matches them, must rebuild ``np.pad`` of the global field for every rank.
"""

import itertools

import numpy as np
import pytest

from mpidomain.halo_layout import HaloLayout
from mpidomain.sharding import balanced_split


def simulate(global_shape, dim, h, periodic, size, extra=None):
    """Return (each rank's padded array after the simulated exchange, the references)."""
    field = np.arange(np.prod(global_shape), dtype=np.float64).reshape(global_shape) + 1
    counts, offsets = balanced_split(global_shape[dim], size)
    if extra is not None:  # uneven beyond balanced_split: one rank holds more rows
        counts = [c + (extra if r == 0 else 0) for r, c in enumerate(counts)]
        offsets = list(itertools.accumulate([0] + counts[:-1]))
        global_shape = global_shape[:dim] + (sum(counts),) + global_shape[dim + 1:]
        field = np.arange(np.prod(global_shape), dtype=np.float64).reshape(global_shape) + 1
    layouts, padded = [], []
    for rank in range(size):
        shard = np.take(field, range(offsets[rank], offsets[rank] + counts[rank]), axis=dim)
        layout = HaloLayout(shard.shape, dim, h, periodic, size, rank, tag=40)
        array = np.full(layout.padded_shape, np.nan)
        array[layout.interior] = shard
        layouts.append(layout)
        padded.append(array)
    inbox = {}
    for rank, layout in enumerate(layouts):
        for message in layout.sends:
            key = (rank, message.peer, message.tag)
            assert key not in inbox, f"two messages from {rank} to {message.peer} with tag {message.tag}"
            inbox[key] = padded[rank][message.rows].copy()
    for rank, layout in enumerate(layouts):
        for message in layout.receives:
            rows = inbox.pop((message.peer, rank, message.tag))
            assert rows.shape == layout.halo_shape
            padded[rank][message.rows] = rows
        for rows in layout.zeros:
            padded[rank][rows] = 0
        for source, ghost, flip in layout.copies:
            assert flip == ()
            padded[rank][ghost] = padded[rank][source]
    assert not inbox, f"messages nobody receives: {sorted(inbox)}"
    widths = [(0, 0)] * len(global_shape)
    widths[dim] = (h, h)
    whole = np.pad(field, widths, mode="wrap" if periodic else "constant")
    references = [np.take(whole, range(offsets[r], offsets[r] + counts[r] + 2 * h), axis=dim) for r in range(size)]
    return padded, references


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("periodic", [False, True])
def test_every_rank_gets_the_global_pad(size, periodic):
    for shape, dim in (((13,), 0), ((2, 11, 3), 1), ((3, 2, 9), 2), ((10, 4), 0)):
        for h in range(0, min(3, shape[dim] // size) + 1):
            for extra in (None, 2):
                padded, references = simulate(shape, dim, h, periodic, size, extra)
                for rank, (got, want) in enumerate(zip(padded, references)):
                    assert np.array_equal(got, want), (shape, dim, h, periodic, size, extra, rank)


def test_messages_and_neighbours():
    first, middle, last = (HaloLayout((2, 5, 3), 1, 2, False, 3, r, tag=10) for r in range(3))
    assert (first.neighbors, middle.neighbors, last.neighbors) == ((None, 1), (0, 2), (1, None))
    assert middle.padded_shape == (2, 9, 3) and middle.halo_shape == (2, 2, 3)
    assert [(m.peer, m.tag) for m in middle.sends] == [(0, 11), (2, 10)]
    assert [(m.peer, m.tag) for m in middle.receives] == [(0, 10), (2, 11)]
    assert first.zeros == ((slice(None), slice(0, 2)),) and last.zeros == ((slice(None), slice(7, 9)),)
    assert middle.interior == (slice(None), slice(2, 7))
    assert middle.shard_rows((slice(None), slice(5, 7))) == (slice(None), slice(3, 5))


def test_one_rank_and_empty_cases():
    alone = HaloLayout((4, 3), 0, 1, True, 1, 0)
    assert alone.local_wrap and not alone.sends and not alone.receives and len(alone.copies) == 2
    assert HaloLayout((4, 3), 0, 1, False, 1, 0).zeros == ((slice(0, 1),), (slice(5, 6),))
    for nothing in (HaloLayout((4, 3), 0, 0, True, 2, 0), HaloLayout((4, 0), 0, 1, False, 2, 1)):
        assert not (nothing.sends or nothing.receives or nothing.zeros or nothing.copies)


@pytest.mark.parametrize("arguments, message", [
    (((4, 3), 2, 1, False, 2, 0), "dim=2 must index shape"),
    (((4, 3), 0, 1, False, 2, 2), "rank=2 must be in"),
    (((4, 3), 0, -1, False, 2, 0), "halo_width=-1 must be >= 0"),
])
def test_impossible_layouts(arguments, message):
    with pytest.raises(ValueError, match=message):
        HaloLayout(*arguments)
