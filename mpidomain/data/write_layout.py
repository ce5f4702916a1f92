"""Where each rank's tile lies in the whole field, and which rank writes each chunk of a store: pure arithmetic.

:func:`place_tiles` checks that the tiles' coordinate vectors (gathered from
every rank of a domain group) cover one dim of the field exactly once, in the
manager's order, and returns the tiles' extents along it. An
:class:`AxisSplit` (those extents and the store's chunk size along the dim)
says which rows each tile holds and which it writes: the rows of the chunks
whose first row it holds, so every chunk has exactly one writer, which writes
it whole. :func:`block_moves` lists the blocks a tile sends to the writers of
its rows and receives from the holders of the rows it writes. No I/O, no MPI,
no xarray.
"""

from dataclasses import dataclass
from typing import Tuple

import numpy as np

from ..layout.tiles import balanced_split

__all__ = ["AxisSplit", "absent_axis", "block_moves", "place_tiles", "tile_coordinates"]

_HALOS = ("did a rank pass its tile with halos? pass each rank's tile without them, "
          "e.g. select_tile(ds, manager, halo=0)")


@dataclass(frozen=True)
class AxisSplit:
    """One dim of the field: the extent of each tile along it, in tile order, and the store's chunk size.

    Tile ``i`` holds the rows ``held(i)``; it writes the rows ``written(i)``:
    those of every chunk whose first row it holds. The written rows of the
    tiles partition the dim, each tile's a whole number of chunks (the last
    one cut at the field's edge).
    """

    counts: Tuple[int, ...]
    chunk: int

    @property
    def extent(self):
        """The field's rows along the dim."""
        return sum(self.counts)

    def held(self, i):
        """The rows tile ``i`` holds: a range."""
        start = sum(self.counts[:i])
        return range(start, start + self.counts[i])

    def written(self, i):
        """The rows tile ``i`` writes: a range (empty if no chunk starts in its rows)."""
        held = self.held(i)
        if not held:
            return range(0)
        first = -(-held.start // self.chunk) * self.chunk
        stop = min(self.extent, -(-held.stop // self.chunk) * self.chunk)
        return range(first, max(first, stop))


def absent_axis(parts):
    """The :class:`AxisSplit` of a dim a variable lacks: one row, held and written by the first tile."""
    return AxisSplit((1,) + (0,) * (parts - 1), 1)


def _overlap(a, b):
    return range(max(a.start, b.start), min(a.stop, b.stop))


def block_moves(axes, grid, coords):
    """Return ``(sends, receives)`` of the tile at ``coords`` of a ``grid`` of ``(D_lat, D_lon)`` tiles.

    ``axes`` are the (latitude, longitude) :class:`AxisSplit` s. Each entry is
    ``(peer, rows, columns)``: the peer's tile coordinates and the global rows
    and columns of the block, sent to the peer that writes them or received
    from the peer that holds them. The tile itself appears as a peer where it
    writes rows it holds.
    """
    (i, j), (lat, lon) = coords, axes
    sends, receives = [], []
    for a in range(grid[0]):
        for b in range(grid[1]):
            rows, columns = _overlap(lat.held(i), lat.written(a)), _overlap(lon.held(j), lon.written(b))
            if rows and columns:
                sends.append(((a, b), rows, columns))
            rows, columns = _overlap(lat.held(a), lat.written(i)), _overlap(lon.held(b), lon.written(j))
            if rows and columns:
                receives.append(((a, b), rows, columns))
    return sends, receives


def _show(values):
    values = np.asarray(values)
    if len(values) == 0:
        return "no values"
    return f"{len(values)} values from {values[0]!r} to {values[-1]!r}"


def tile_coordinates(vectors, grid, axis, name):
    """Return the coordinate vector of each tile along ``axis`` (0: latitude, 1: longitude) of ``grid``.

    ``vectors`` holds every domain rank's vector (row-major over ``grid``):
    numbers, finite (a NaN is a halo of zeros, as select_tile fills it). The
    ranks of one tile row share their latitudes, those of one tile column
    their longitudes: raise ValueError naming the ranks that differ.
    """
    for rank, values in enumerate(vectors):
        if values.dtype.kind not in "iuf":
            raise ValueError(f"write_tile: tile: the {name!r} coordinate must be numeric, got dtype {values.dtype} on "
                             f"rank {rank}; give every tile numeric {name!r} values")
        if values.dtype.kind == "f" and not np.all(np.isfinite(values)):
            raise ValueError(f"write_tile: tile: rank {rank}'s {name!r} coordinate holds NaN or infinity "
                             f"({_show(values)}); {_HALOS}")
    tiles = []
    for index in range(grid[axis]):
        ranks = [r for r in range(len(vectors)) if divmod(r, grid[1])[axis] == index]
        first = vectors[ranks[0]]
        for rank in ranks[1:]:
            if not (vectors[rank].dtype == first.dtype and np.array_equal(vectors[rank], first)):
                along = ("row", "latitude") if axis == 0 else ("column", "longitude")
                raise ValueError(
                    f"write_tile: tile: ranks {ranks[0]} and {rank} are in tile {along[0]} {index} but hold different "
                    f"{name!r} coordinates ({_show(first)} ({first.dtype}); {_show(vectors[rank])} "
                    f"({vectors[rank].dtype})); the tiles of one {along[0]} hold the same {along[1]}s: cut each "
                    "rank's tile at its manager.domain_coords, e.g. select_tile(ds, manager, halo=0)")
        tiles.append(first)
    return tiles


def place_tiles(tiles, name, what):
    """Check that the ``tiles``' coordinate vectors along one dim tile it once, in order; return their extents.

    ``what`` names the tiles along the dim (``"tile row"``, ``"tile column"``).
    Raise ValueError for coordinates that overlap or run out of
    order (not strictly monotonic across the tiles), leave a hole (on a regular
    grid: a step between two tiles other than the spacing inside them), or
    extents other than the manager's layout (:func:`mpidomain.balanced_split`).
    """
    steps = [np.diff(values.astype(np.float64)) for values in tiles]
    edges = [(k, a, b) for k, (a, b) in enumerate(zip(tiles, tiles[1:])) if len(a) and len(b)]
    every = np.concatenate(steps + [np.array([float(b[0]) - float(a[-1])]) for _, a, b in edges])
    direction = np.sign(every[every != 0][0]) if np.any(every != 0) else 1.0
    for index, inside in enumerate(steps):
        if np.any(inside * direction <= 0):
            raise ValueError(f"write_tile: tile: the {name!r} coordinate of {what} {index} is not strictly monotonic "
                             f"({_show(tiles[index])}); the tiles' {name!r} values must run strictly "
                             f"{'in' if direction > 0 else 'de'}creasing across the field; {_HALOS}")
    inside = np.concatenate(steps)
    regular = len(inside) > 0 and np.allclose(inside, inside[0], rtol=1e-6, atol=0)
    for k, a, b in edges:
        gap = float(b[0]) - float(a[-1])
        if gap * direction <= 0:
            raise ValueError(
                f"write_tile: tile: the {name!r} coordinates of {what}s {k} and {k + 1} overlap or are out of order: "
                f"{what} {k} ends at {a[-1]!r} and {what} {k + 1} starts at {b[0]!r}, but they must run strictly "
                f"{'in' if direction > 0 else 'de'}creasing across the tiles in the manager's order (domain rank = "
                f"i_lat * D_lon + i_lon); {_HALOS}")
        if regular and not np.isclose(gap, inside[0], rtol=1e-6, atol=0):
            missing = abs(gap / inside[0]) - 1
            kind = (f"a hole: about {missing:.3g} rows missing" if abs(gap) > abs(inside[0])
                    else "rows closer than the grid's spacing")
            raise ValueError(
                f"write_tile: tile: between {what}s {k} and {k + 1} the {name!r} coordinate steps by {gap!r} "
                f"({a[-1]!r} to {b[0]!r}), but by {inside[0]!r} inside the tiles: {kind}; every rank must pass "
                "its whole tile, so that the tiles cover the field without a gap, e.g. "
                "select_tile(ds, manager, halo=0)")
    counts = tuple(len(values) for values in tiles)
    expected = balanced_split(sum(counts), len(tiles))[0]
    if counts != expected:
        raise ValueError(
            f"write_tile: tile: the {what}s hold {counts} {name!r} values, but the manager's layout splits the "
            f"{sum(counts)} values of all tiles as {expected} (balanced_split, as shard_tensor and select_tile cut "
            "them); cut each rank's tile as select_tile(ds, manager, halo=0) does")
    return counts
