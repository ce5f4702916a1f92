"""The halo layout of slabs alone: every group size simulated in one process, no MPI.

A slab is a :class:`TileLayout` grid with one sharded dim. Each rank's layout
says which rows it sends and receives under which tags; delivering every
message by (source, destination, tag), as MPI matches them, must rebuild
``np.pad`` of the global field for every rank.
"""

import itertools

import numpy as np
import pytest

from mpidomain.sharding import balanced_split
from mpidomain.layout.tiles import TileLayout
from reference import pad_along

pytestmark = pytest.mark.one_world  # no MPI: the same in every world


def slab(shape, dim, h, periodic, counts, rank, tag=0):
    """Rank ``rank``'s layout of slabs of ``counts`` rows along ``dim``."""
    return TileLayout(shape, (dim,), (h,), ("periodic" if periodic else "zeros",), (tuple(counts),), (rank,), tag=tag)


def deliver(layouts, padded):
    """Deliver every message of ``layouts`` into ``padded`` (each rank's padded array), then zeros and copies."""
    inbox = {}
    for rank, layout in enumerate(layouts):
        for message in layout.sends:
            key = (rank, message.peer, message.tag)
            assert key not in inbox, f"two messages from {rank} to {message.peer} with tag {message.tag}"
            assert message.flip == ()
            inbox[key] = padded[rank][message.rows].copy()
    for rank, layout in enumerate(layouts):
        for message in layout.receives:
            rows = inbox.pop((message.peer, rank, message.tag))
            assert rows.shape == padded[rank][message.rows].shape
            padded[rank][message.rows] = rows
        for rows in layout.zeros:
            padded[rank][rows] = 0
        for source, ghost, flip in layout.copies:
            assert flip == ()
            padded[rank][ghost] = padded[rank][source]
    assert not inbox, f"messages nobody receives: {sorted(inbox)}"


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
        layout = slab(shard.shape, dim, h, periodic, counts, rank, tag=40)
        assert 40 <= layout.tag and all(40 <= m.tag < 40 + layout.tags for m in layout.sends + layout.receives)
        array = np.full(layout.padded_shape, np.nan)
        array[layout.interior] = shard
        layouts.append(layout)
        padded.append(array)
    assert len({layout.tags for layout in layouts}) == 1, "ranks disagree on how many tags"
    deliver(layouts, padded)
    whole = pad_along(field, dim, h, periodic)
    references = [np.take(whole, range(offsets[r], offsets[r] + counts[r] + 2 * h), axis=dim) for r in range(size)]
    return padded, references


@pytest.mark.parametrize("size", range(1, 9))
@pytest.mark.parametrize("periodic", [False, True])
def test_every_rank_gets_the_global_pad(size, periodic):
    for shape, dim in (((13,), 0), ((2, 11, 3), 1), ((3, 2, 9), 2), ((10, 4), 0)):
        for h in range(0, min(3, shape[dim] // size) + 1):
            for extra in (None, 2):
                padded, references = simulate(shape, dim, h, periodic, size, extra)
                for rank, (got, want) in enumerate(zip(padded, references)):
                    assert np.array_equal(got, want), (shape, dim, h, periodic, size, extra, rank)


@pytest.mark.parametrize("periodic", [False, True])
def test_a_dim_the_group_does_not_shard_pads_locally(periodic):
    """Along longitude of latitude slabs each rank pads its own columns, however many: no messages."""
    counts, columns = (3, 2, 2), (5, 4, 6)
    layouts, padded, references = [], [], []
    for rank, (n, w) in enumerate(zip(counts, columns)):
        mine = np.arange(n * w, dtype=np.float64).reshape(n, w) + 100 * rank
        layout = TileLayout((n, w), (0, 1), (0, 2), ("zeros", "periodic" if periodic else "zeros"),
                            (counts, (w,)), (rank, 0))
        assert not (layout.sends or layout.receives) and layout.tags == 0 and layout.padded_shape == (n, w + 4)
        array = np.full(layout.padded_shape, np.nan)
        array[layout.interior] = mine
        layouts.append(layout)
        padded.append(array)
        references.append(pad_along(mine, 1, 2, periodic))
    deliver(layouts, padded)
    assert all(np.array_equal(got, want) for got, want in zip(padded, references))


def test_messages_and_neighbours():
    first, middle, last = (slab((2, 5, 3), 1, 2, False, (5, 5, 5), r, tag=10) for r in range(3))
    assert [layout.neighbors_along(0) for layout in (first, middle, last)] == [(None, 1), (0, 2), (1, None)]
    assert (first.neighbors, middle.neighbors, last.neighbors) == ((1,), (0, 2), (1,))
    assert middle.padded_shape == (2, 9, 3) and middle.tags == 1
    assert [(m.peer, m.tag, m.rows) for m in middle.sends] == [
        (0, 10, (slice(None), slice(2, 4), slice(None))), (2, 10, (slice(None), slice(5, 7), slice(None)))]
    assert [(m.peer, m.tag, m.rows) for m in middle.receives] == [
        (0, 10, (slice(None), slice(0, 2), slice(None))), (2, 10, (slice(None), slice(7, 9), slice(None)))]
    assert first.zeros == ((slice(None), slice(0, 2), slice(None)),)
    assert last.zeros == ((slice(None), slice(7, 9), slice(None)),)
    assert middle.interior == (slice(None), slice(2, 7), slice(None))
    assert middle.shard_rows((slice(None), slice(5, 7), slice(None))) == (slice(None), slice(3, 5), slice(None))
    pair = slab((4, 3), 0, 1, True, (4, 4), 0)  # two ranks, periodic: both halos from the other rank
    assert pair.neighbors_along(0) == (1, 1) and pair.tags == 2 and [m.peer for m in pair.receives] == [1, 1]


def test_one_rank_and_empty_cases():
    alone = slab((4, 3), 0, 1, True, (4,), 0)
    assert alone.neighbors_along(0) == (0, 0) and alone.neighbors == ()
    assert not alone.sends and not alone.receives and len(alone.copies) == 2 and alone.tags == 0
    assert slab((4, 3), 0, 1, False, (4,), 0).zeros == ((slice(0, 1), slice(None)), (slice(5, 6), slice(None)))
    for nothing in (slab((4, 3), 0, 0, True, (4, 4), 0), slab((4, 0), 0, 1, False, (4, 4), 1)):
        assert not (nothing.sends or nothing.receives or nothing.zeros or nothing.copies)


@pytest.mark.parametrize("arguments, message", [
    (((4, 3), 2, 1, False, (4, 4), 0), "distinct increasing dims of shape"),
    (((4, 3), 0, 1, False, (4, 4), 2), "do not describe shape"),
    (((4, 3), 0, -1, False, (4, 4), 0), "halo width -1 along dim 0 must be in"),
    (((4, 3), 0, 4, False, (4, 3), 0), "halo width 4 along dim 0 must be in"),
])
def test_impossible_layouts(arguments, message):
    with pytest.raises(ValueError, match=message):
        slab(*arguments)
