"""The tile layout alone: every grid of tiles simulated in one process, no MPI.

Each rank's :class:`TileLayout` says which blocks it sends (mirrored along
``flip`` while packing) and receives under which tags, which ghost blocks are
zeros and which are copies of its own tile; delivering every message by
(sender, receiver, tag), as MPI matches them, must rebuild the padded global
field cut to every rank's window, edges and corners included.
"""

import itertools

import numpy as np
import pytest

from mpidomain.sharding import balanced_split
from mpidomain.layout.tiles import TileLayout
from reference import global_pad

pytestmark = pytest.mark.one_world  # no MPI: the same in every world

TAG = 40


def window(dims, starts, stops):
    """The index of rows ``starts[k]:stops[k]`` along each of ``dims``, all of every other dim."""
    spans = {d: slice(a, b) for d, a, b in zip(dims, starts, stops)}
    return tuple(spans.get(d, slice(None)) for d in range(max(dims) + 1))


def simulate(shape, dims, widths, modes, extents):
    """Return (each rank's padded tile after the simulated exchange, its reference, its layout), by rank.

    Also checks the messages: each sent once, received once, with the sender's
    block shape, under a tag in [TAG, TAG + layout.tags).
    """
    field = np.arange(np.prod(shape), dtype=np.float64).reshape(shape) + 1
    offsets = [list(itertools.accumulate((0,) + sizes)) for sizes in extents]
    whole = global_pad(field, dims, widths, modes)
    layouts, padded, references = [], [], []
    for coords in itertools.product(*(range(len(sizes)) for sizes in extents)):
        starts = [offsets[k][c] for k, c in enumerate(coords)]
        stops = [offsets[k][c + 1] for k, c in enumerate(coords)]
        layout = TileLayout(field[window(dims, starts, stops)].shape, dims, widths, modes, extents, coords, tag=TAG)
        assert layout.rank_of(coords) == len(layouts)
        array = np.full(layout.padded_shape, np.nan)
        array[layout.interior] = field[window(dims, starts, stops)]
        layouts.append(layout)
        padded.append(array)
        references.append(whole[window(dims, starts, [b + 2 * h for b, h in zip(stops, widths)])])
    tags = {layout.tags for layout in layouts}
    assert len(tags) == 1, f"ranks disagree on how many tags: {tags}"
    inbox = {}
    for rank, layout in enumerate(layouts):
        for m in layout.sends:
            key = (rank, m.peer, m.tag)
            assert key not in inbox, f"two messages from {rank} to {m.peer} with tag {m.tag}"
            assert TAG <= m.tag < TAG + layout.tags, f"tag {m.tag} outside [{TAG}, {TAG + layout.tags})"
            assert m.peer != rank, f"rank {rank} sends to itself"
            inbox[key] = np.flip(padded[rank][m.rows], m.flip).copy()
    for rank, layout in enumerate(layouts):
        for m in layout.receives:
            block = inbox.pop((m.peer, rank, m.tag))  # KeyError: a message nobody sent
            assert block.shape == padded[rank][m.rows].shape
            padded[rank][m.rows] = block
        for rows in layout.zeros:
            padded[rank][rows] = 0
        for source, ghost, flip in layout.copies:
            padded[rank][ghost] = np.flip(padded[rank][source], flip)
    assert not inbox, f"messages nobody receives: {sorted(inbox)}"
    return padded, references, layouts


GRIDS = [(1, 1), (2, 1), (1, 2), (2, 2), (3, 2), (4, 1), (1, 4), (3, 3)]
MODES = [("zeros", "zeros"), ("zeros", "periodic"), ("periodic", "zeros"), ("periodic", "periodic"),
         ("fold", "periodic"), ("fold", "zeros")]


def cases(grid):
    """(global shape, dims, extents per dim) for ``grid``: even (with a leading dim), uneven, beyond balanced_split."""
    for shape, dims in (((2, 12, 12), (1, 2)), ((13, 17), (0, 1))):
        yield shape, dims, tuple(tuple(balanced_split(shape[d], n)[0]) for d, n in zip(dims, grid))
    extents = tuple(tuple(3 + 2 * c for c in range(n)) for n in grid)  # 3, 5, 7: the last tile the largest
    yield tuple(sum(e) for e in extents), (0, 1), extents


@pytest.mark.parametrize("modes", MODES, ids="-".join)
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def test_every_rank_gets_the_global_pad(grid, modes):
    """Every rank's assembled padded tile equals the padded global field cut to its window, corners included."""
    for shape, dims, extents in cases(grid):
        for widths in itertools.product(range(4), repeat=2):
            if any(h > min(sizes) for h, sizes in zip(widths, extents)):
                continue
            padded, references, _ = simulate(shape, dims, widths, modes, extents)
            for rank, (got, want) in enumerate(zip(padded, references)):
                assert np.array_equal(got, want), (grid, modes, shape, widths, extents, rank)


@pytest.mark.parametrize("modes", MODES, ids="-".join)
@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: f"{g[0]}x{g[1]}")
def test_global_rows_index_the_global_pad(grid, modes):
    """global_rows (what mpidomain.data reads) picks every rank's padded tile out of the global field."""
    for shape, dims, extents in cases(grid):
        if dims != (0, 1):
            continue
        field = np.arange(np.prod(shape), dtype=np.float64).reshape(shape) + 1
        offsets = [list(itertools.accumulate((0,) + sizes)) for sizes in extents]
        for widths in itertools.product(range(3), repeat=2):
            if any(h > min(sizes) for h, sizes in zip(widths, extents)):
                continue
            whole = global_pad(field, dims, widths, modes)
            for coords in itertools.product(*(range(len(sizes)) for sizes in extents)):
                tile = tuple(sizes[c] for sizes, c in zip(extents, coords))
                layout = TileLayout(tile, dims, widths, modes, extents, coords)
                rows, mirrored = layout.global_rows(0)
                columns, turned = layout.global_rows(1)[0], layout.global_rows(1, turned=True)[0]
                got = np.zeros(layout.padded_shape)
                for i, (row, beyond) in enumerate(zip(rows, mirrored)):
                    for j, column in enumerate(turned if beyond else columns):
                        got[i, j] = field[row, column] if row >= 0 and column >= 0 else 0
                starts = [offsets[k][c] for k, c in enumerate(coords)]
                want = whole[window(dims, starts, [a + n + 2 * h for a, n, h in zip(starts, tile, widths)])]
                assert np.array_equal(got, want), (grid, modes, shape, widths, coords)


@pytest.mark.parametrize("widths", [(1, 1, 1), (2, 0, 1), (0, 2, 2)])
def test_a_three_dim_grid(widths):
    """A 2 x 2 x 2 grid of 3-D tiles (periodic, zeros, fold of the last two) assembles the global pad."""
    for modes in (("periodic", "zeros", "periodic"), ("zeros", "fold", "periodic")):
        padded, references, _ = simulate((5, 6, 7), (0, 1, 2), widths, modes, ((3, 2), (3, 3), (4, 3)))
        for rank, (got, want) in enumerate(zip(padded, references)):
            assert np.array_equal(got, want), (modes, widths, rank)


def test_odd_longitude_turns_by_the_floor_of_half():
    """With W odd the fold comes from W // 2 columns away, as torch.roll(x, W // 2) turns: not from (W + 1) // 2."""
    padded, references, _ = simulate((4, 7), (0, 1), (1, 0), ("fold", "periodic"), ((4,), (4, 3)))
    assert np.array_equal(padded[0][0, :], [5, 6, 7, 1])  # row 0 = 1..7 rolled by 3 is 5 6 7 1 2 3 4; by 4: 4 5 6 7
    assert all(np.array_equal(got, want) for got, want in zip(padded, references))


def test_messages_of_a_two_by_two_grid():
    """On 2 x 2 zero-padded tiles, rank 0 sends its last row, last columns and their corner, and gets its ghosts."""
    layout = TileLayout((3, 4), (0, 1), (1, 2), ("zeros", "zeros"), ((3, 3), (4, 4)), (0, 0), tag=7)
    assert layout.padded_shape == (5, 8) and layout.interior == (slice(1, 4), slice(2, 6))
    assert layout.grid == (2, 2) and layout.rank_of((1, 0)) == 2 and layout.neighbors == (1, 2, 3)
    assert layout.tags == 1
    assert sorted((m.peer, m.tag, m.rows, m.flip) for m in layout.sends) == [
        (1, 7, (slice(1, 4), slice(4, 6)), ()),  # to the east: my last two columns
        (2, 7, (slice(3, 4), slice(2, 6)), ()),  # to the south: my last row
        (3, 7, (slice(3, 4), slice(4, 6)), ()),  # to the diagonal: the corner of both
    ]
    assert sorted((m.peer, m.rows) for m in layout.receives) == [
        (1, (slice(1, 4), slice(6, 8))), (2, (slice(4, 5), slice(2, 6))), (3, (slice(4, 5), slice(6, 8)))]
    assert len(layout.zeros) == 5 and layout.copies == ()
    assert layout.shard_rows((slice(1, 2), slice(2, 4))) == (slice(0, 1), slice(0, 2))


@pytest.mark.parametrize("shape, dims, widths", [((1, 4, 5, 6), (2,), (1,)), ((7, 5), (0, 1), (2, 1)),
                                                  ((1, 1, 9), (2,), (3,)), ((3, 2), (1,), (1,))])
@pytest.mark.parametrize("count", [1, 2, 3, 100])
def test_interior_pieces_cover_the_tile_once_in_order(shape, dims, widths, count):
    """The interior's pieces (copied one by one, polling the halos between them) are the tile, cut along the
    outermost dim longer than one: each element once, as many pieces as asked for up to that dim's extent."""
    extents = tuple((shape[d],) for d in dims)
    layout = TileLayout(shape, dims, widths, ("zeros",) * len(dims), extents, (0,) * len(dims), tag=TAG)
    tile = np.arange(np.prod(shape), dtype=np.float64).reshape(shape) + 1
    whole = np.zeros(layout.padded_shape)
    whole[layout.interior] = tile
    pieces = layout.interior_pieces(count)
    outer = next(d for d, n in enumerate(shape) if n > 1)
    assert len(pieces) == min(count, shape[outer])
    rebuilt, seen = np.zeros(layout.padded_shape), np.zeros(shape)
    for padded_index, tile_index in pieces:
        rebuilt[padded_index] += tile[tile_index]
        seen[tile_index] += 1
    assert np.array_equal(rebuilt, whole) and np.all(seen == 1)
    starts = [tile_index[outer].start for _, tile_index in pieces]
    assert starts == sorted(starts) and starts[0] == 0


def test_one_tile_of_the_earth_copies_its_own_rows_mirrored():
    """One rank, fold and periodic: every ghost block is a local copy, the fold rows flipped along latitude."""
    layout = TileLayout((3, 4), (0, 1), (1, 1), ("fold", "periodic"), ((3,), (4,)), (0, 0))
    assert not (layout.sends or layout.receives or layout.zeros) and layout.tags == 0
    assert any(flip == (0,) for _, _, flip in layout.copies)
    assert all(flip in ((), (0,)) for _, _, flip in layout.copies)


def test_nothing_moves_without_halos_or_elements():
    """No halo, or an empty tile: no messages, zeros or copies."""
    for layout in (TileLayout((4, 6), (0, 1), (0, 0), ("periodic", "periodic"), ((4, 4), (6,)), (1, 0)),
                   TileLayout((0, 6), (0, 1), (0, 1), ("zeros", "periodic"), ((0, 0), (6,)), (0, 0))):
        assert not (layout.sends or layout.receives or layout.zeros or layout.copies) and layout.tags == 0


@pytest.mark.parametrize("arguments, message", [
    (((4, 6), (0, 1), (1,), ("zeros", "zeros"), ((4,), (6,)), (0, 0)), "one entry per grid dim"),
    (((4, 6), (1, 0), (1, 1), ("zeros", "zeros"), ((6,), (4,)), (0, 0)), "distinct increasing dims"),
    (((4, 6), (0, 2), (1, 1), ("zeros", "zeros"), ((4,), (6,)), (0, 0)), "distinct increasing dims"),
    (((4, 6), (0, 1), (1, 1), ("zeros", "mirror"), ((4,), (6,)), (0, 0)), "mode 'mirror' must be one of"),
    (((4, 6), (0, 1), (1, 1), ("periodic", "fold"), ((4,), (6,)), (0, 0)), "needs a next dim"),
    (((4, 6), (0, 1), (1, 1), ("zeros", "zeros"), ((4, 4), (6,)), (2, 0)), "do not describe shape"),
    (((4, 6), (0, 1), (1, 1), ("zeros", "zeros"), ((5, 4), (6,)), (0, 0)), "do not describe shape"),
    (((4, 6), (0, 1), (1, 3), ("zeros", "zeros"), ((4,), (6, 2)), (0, 0)), "halo width 3 along dim 1 must be in"),
    (((4, 6), (0, 1), (-1, 1), ("zeros", "zeros"), ((4,), (6,)), (0, 0)), "halo width -1 along dim 0"),
])
def test_impossible_layouts(arguments, message):
    """Mismatched lengths, unordered dims, unknown or misplaced modes, wrong extents and halos beyond a tile raise."""
    with pytest.raises(ValueError, match=message):
        TileLayout(*arguments)
