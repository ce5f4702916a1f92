"""Where the halos of an exchange come from and go to: pure arithmetic, no MPI, no arrays.

The one layout of every halo exchange: a rank's array is a tile of a grid,
sharded along some dims (a latitude slab is a grid with one sharded dim) and
padded along some (a dim only padded is one the group does not shard: every
rank holds all of it, and its halo is a local pad). A rank's padded tile is
the padded *global* field cut to the tile and its halos. Along each dim of
the grid a padded global index ``p`` maps to a row of the global field, or to
nothing (zeros):

- ``"zeros"``: ``p`` itself inside the field, nothing outside;
- ``"periodic"``: ``p`` modulo the extent;
- ``"fold"`` (latitude of the Earth): beyond a pole, the rows on the near side
  of that pole, mirrored (``-1 - p`` and ``2 H - 1 - p``), taken from half a
  turn away along the next dim, as ``torch.roll(x, W // 2, dims=-1)`` does.

So ``boundary="earth"`` is ``("fold", "periodic")``, and equals CREDIT's
``TensorPadding(mode="earth")`` on the global field. Each padded tile splits
into rectangular :class:`Piece` s, each a block of one rank's tile (mirrored or
not), a block of zeros, or the tile itself. :class:`TileLayout` turns them into
the :class:`Message` s :class:`mpidomain.HaloPlan` moves, the ghost blocks of
zeros and the local copies; tests/test_layout_tiles.py (grids, the Earth) and
tests/test_halo_layout.py (slabs of every group size) check it against padded
global fields in one process.

How a sharded dim is cut into tiles in the first place is :func:`balanced_split`
here too: the one split every module uses (shards, windows, writes, estimates).
"""

import bisect
import functools
import itertools
from dataclasses import dataclass
from typing import Optional, Tuple

from .._validate import require_int

__all__ = ["Message", "Piece", "TileLayout", "MODES", "balanced_split"]

MODES = ("zeros", "periodic", "fold")


def balanced_split(extent, parts):
    """Return ``(counts, offsets)``: ``extent`` rows split over ``parts`` ranks as evenly as possible.

    The first ``extent % parts`` ranks get one row more; 721 rows over 4
    ranks give counts ``(181, 180, 180, 180)`` and offsets ``(0, 181, 361, 541)``.
    Local, pure.
    """
    extent, parts = require_int("extent", extent, least=0), require_int("parts", parts, least=1)
    base, extra = divmod(extent, parts)
    counts = tuple(base + (rank < extra) for rank in range(parts))
    offsets = tuple(itertools.accumulate((0,) + counts[:-1]))
    return counts, offsets


@dataclass(frozen=True)
class Message:
    """One halo message seen from this rank: the other rank, the tag, and the block of the padded tile.

    ``rows`` is an index of the padded tile; ``flip`` the dims along which a sent
    block is mirrored while packing (the Earth's pole fold).
    """

    peer: int
    tag: int
    rows: tuple
    flip: tuple = ()


@dataclass(frozen=True)
class Piece:
    """A block of a padded tile: its index in the padded tile, and where its values come from.

    ``owner`` is the grid coordinate of the rank whose tile holds the values
    (None: zeros), ``source`` their index in that rank's unpadded tile, and
    ``flip`` the dims along which they are mirrored.
    """

    rows: tuple
    owner: Optional[tuple]
    source: Optional[tuple]
    flip: tuple


@dataclass(frozen=True)
class _Run:
    """Consecutive padded rows ``start:stop`` of one dim that come from one owner, in one direction."""

    start: int
    stop: int
    owner: Optional[int]
    first: int  # the owner's local row for padded row ``start``
    step: int  # +1, or -1 where mirrored


@dataclass(frozen=True)
class TileLayout:
    """The pieces and messages of one rank's halo exchange along the ``dims`` of a grid of tiles.

    A slab of a latitude-sharded field padded along latitude is ``dims=(2,)``,
    ``extents=((181, 180, 180, 180),)``, ``coords=(rank,)``; padded along
    longitude instead (a local pad), ``dims=(2, 3)``, ``halo_widths=(0, h)``,
    ``extents=((181, 180, 180, 180), (1440,))``.

    :param shape: This rank's tile (the unpadded local array).
    :param dims: The grid's dims (normalised, increasing): the exchanged dims and the sharded ones.
    :param halo_widths: Ghost rows on each side, per dim (0 along a dim only sharded).
    :param modes: Per dim, one of :data:`MODES`; a ``"fold"`` dim needs a next dim to turn along.
    :param extents: Per dim, the extent of every grid coordinate's tiles (one entry: unsharded, this rank's
        own extent where no rows travel between ranks).
    :param coords: This rank's grid coordinate per dim; ranks are row-major over the grid.
    :param tag: The first tag; messages between a pair take ``tag``, ``tag + 1``, ...
    """

    shape: Tuple[int, ...]
    dims: Tuple[int, ...]
    halo_widths: Tuple[int, ...]
    modes: Tuple[str, ...]
    extents: Tuple[Tuple[int, ...], ...]
    coords: Tuple[int, ...]
    tag: int = 0

    def __post_init__(self):
        n = len(self.dims)
        if not (len(self.halo_widths) == len(self.modes) == len(self.extents) == len(self.coords) == n):
            raise ValueError("dims, halo_widths, modes, extents and coords must have one entry per grid dim")
        if list(self.dims) != sorted(set(self.dims)) or not all(0 <= d < len(self.shape) for d in self.dims):
            raise ValueError(f"dims={self.dims} must be distinct increasing dims of shape {self.shape}")
        for k, (mode, h, sizes, c) in enumerate(zip(self.modes, self.halo_widths, self.extents, self.coords)):
            if mode not in MODES:
                raise ValueError(f"mode {mode!r} must be one of {MODES}")
            if mode == "fold" and k == n - 1:
                raise ValueError("a 'fold' dim needs a next dim (longitude) to turn half a turn along")
            if not 0 <= c < len(sizes) or sizes[c] != self.shape[self.dims[k]]:
                raise ValueError(f"coords={self.coords} and extents={self.extents} do not describe shape {self.shape}")
            if h < 0 or h > min(sizes):
                raise ValueError(f"halo width {h} along dim {self.dims[k]} must be in [0, {min(sizes)}]")

    # -- shapes ---------------------------------------------------------------
    @property
    def grid(self):
        """The number of tiles along each grid dim."""
        return tuple(len(sizes) for sizes in self.extents)

    @property
    def padded_shape(self):
        """``shape`` with ``2 * halo_width`` more rows along each grid dim."""
        shape = list(self.shape)
        for d, h in zip(self.dims, self.halo_widths):
            shape[d] += 2 * h
        return tuple(shape)

    def _index(self, spans):
        """The full index of ``{dim: slice}``: all of every other dim."""
        return tuple(spans.get(d, slice(None)) for d in range(len(self.shape)))

    @property
    def interior(self):
        """The index of the tile inside a padded array."""
        return self._index({d: slice(h, h + self.shape[d]) for d, h in zip(self.dims, self.halo_widths)})

    def interior_pieces(self, count):
        """The interior cut into at most ``count`` pieces along the outermost dim longer than one:
        ``(index of the padded array, index of the tile)`` pairs, in order, together the whole tile."""
        interior = self.interior
        dim = next((d for d, n in enumerate(self.shape) if n > 1), 0)
        n, first = self.shape[dim], interior[dim].start or 0
        count = max(1, min(count, n))
        cuts = [k * n // count for k in range(count + 1)]
        return [(interior[:dim] + (slice(first + a, first + b),) + interior[dim + 1:], self._index({dim: slice(a, b)}))
                for a, b in zip(cuts, cuts[1:])]

    def shard_rows(self, rows):
        """An index of the padded array (inside the tile) as an index of the unpadded tile."""
        shifted = {d: slice(rows[d].start - h, rows[d].stop - h) for d, h in zip(self.dims, self.halo_widths)}
        return tuple(shifted.get(d, s) for d, s in enumerate(rows))

    def rank_of(self, coords):
        """The rank (in the group) of grid coordinate ``coords``: row-major."""
        rank = 0
        for c, n in zip(coords, self.grid):
            rank = rank * n + c
        return rank

    # -- pieces ---------------------------------------------------------------
    def _runs(self, k, coord, turned):
        """The runs of padded rows of grid coordinate ``coord`` along grid dim ``k``.

        ``turned``: the rows come from half a turn away (the previous dim folded them).
        """
        sizes, h, mode = self.extents[k], self.halo_widths[k], self.modes[k]
        offsets = list(itertools.accumulate((0,) + sizes))
        total, n, start = offsets[-1], sizes[coord], offsets[coord]
        turn = total // 2 if turned else 0
        runs = []
        for t in range(n + 2 * h):
            p = start + t - h
            if mode == "zeros" and not 0 <= p < total:
                owner, row, step = None, 0, 0
            else:
                g, step = p % total, 1
                if mode == "fold" and not 0 <= p < total:
                    g, step = (-1 - p if p < 0 else 2 * total - 1 - p), -1
                g = (g - turn) % total
                owner = bisect.bisect_right(offsets, g) - 1
                row = g - offsets[owner]
            last = runs[-1] if runs else None
            if (last is not None and t not in (h, h + n) and last.owner == owner and last.step == step
                    and (owner is None or last.first + step * (t - last.start) == row)):
                runs[-1] = _Run(last.start, t + 1, owner, last.first, step)
            else:
                runs.append(_Run(t, t + 1, owner, row, step))
        return runs

    def global_rows(self, k, turned=False):
        """Each padded row of this rank's tile along grid dim ``k``: its row of the global field, or -1 for zeros.

        ``turned``: the row of a block taken from half a turn away (``k`` follows a ``"fold"`` dim, and the
        rows along that dim are beyond a pole). Returns ``(rows, mirrored)``: two tuples, one entry per
        padded row; ``mirrored`` is True beyond a pole of a ``"fold"`` dim.
        """
        offsets = list(itertools.accumulate((0,) + self.extents[k]))
        rows, mirrored = [], []
        for run in self._runs(k, self.coords[k], turned):
            for t in range(run.start, run.stop):
                rows.append(-1 if run.owner is None else offsets[run.owner] + run.first + run.step * (t - run.start))
                mirrored.append(run.step == -1)
        return tuple(rows), tuple(mirrored)

    def pieces(self, coords=None):
        """Return the :class:`Piece` s of the padded tile of grid coordinate ``coords`` (default: ours), tile included."""
        coords = self.coords if coords is None else tuple(coords)
        cache = {}

        def runs(k, turned):
            if (k, turned) not in cache:
                cache[k, turned] = self._runs(k, coords[k], turned)
            return cache[k, turned]

        found = []

        def walk(k, chosen):
            if k == len(self.dims):
                found.append(self._piece(chosen))
                return
            turned = k > 0 and self.modes[k - 1] == "fold" and chosen[-1].step == -1
            for run in runs(k, turned):
                walk(k + 1, chosen + [run])

        walk(0, [])
        return found

    def _piece(self, runs):
        rows = self._index({d: slice(r.start, r.stop) for d, r in zip(self.dims, runs)})
        if any(r.owner is None for r in runs):
            return Piece(rows, None, None, ())
        source = {}
        for d, r in zip(self.dims, runs):
            low = r.first if r.step == 1 else r.first - (r.stop - r.start - 1)
            source[d] = slice(low, low + r.stop - r.start)
        flip = tuple(d for d, r in zip(self.dims, runs) if r.step == -1)
        return Piece(rows, tuple(r.owner for r in runs), self._index(source), flip)

    # -- messages ----------------------------------------------------------------
    @property
    def _moves(self):
        return any(self.halo_widths) and all(self.padded_shape)

    def _ghosts(self, coords):
        """The pieces of ``coords``' padded tile other than the tile itself."""
        return self._all_ghosts[coords]

    @functools.cached_property
    def _all_ghosts(self):
        """Every grid coordinate's ghost pieces (computed once: sends need every rank's)."""
        found = {}
        for coords in self._all_coords:
            interior = self._index({d: slice(h, h + self.extents[k][coords[k]])
                                    for k, (d, h) in enumerate(zip(self.dims, self.halo_widths))})
            found[coords] = [p for p in self.pieces(coords) if p.rows != interior] if self._moves else []
        return found

    def _padded_rows(self, source):
        """``source`` (an index of the unpadded tile) as an index of this rank's padded tile."""
        shifted = {d: slice(source[d].start + h, source[d].stop + h) for d, h in zip(self.dims, self.halo_widths)}
        return tuple(shifted.get(d, s) for d, s in enumerate(source))

    @property
    def _all_coords(self):
        return list(itertools.product(*(range(n) for n in self.grid)))

    @property
    def receives(self):
        """The messages this rank receives: one per piece another rank holds (tags count per pair)."""
        counts, messages = {}, []
        for p in self._ghosts(self.coords):
            if p.owner is not None and p.owner != self.coords:
                k = counts[p.owner] = counts.get(p.owner, -1) + 1
                messages.append(Message(self.rank_of(p.owner), self.tag + k, p.rows))
        return tuple(messages)

    @property
    def sends(self):
        """The messages this rank sends: each piece of another rank's padded tile that this rank holds.

        ``rows`` index this rank's padded tile; ``flip`` the dims to mirror while packing.
        """
        messages = []
        for coords in self._all_coords:
            if coords == self.coords:
                continue
            mine = [p for p in self._ghosts(coords) if p.owner == self.coords]
            messages += [Message(self.rank_of(coords), self.tag + k, self._padded_rows(p.source), p.flip)
                         for k, p in enumerate(mine)]
        return tuple(messages)

    @property
    def tags(self):
        """How many tags the exchange needs: the most pieces one rank takes from another. The same on every rank."""
        most = 0
        for coords in self._all_coords:
            owners = [p.owner for p in self._ghosts(coords) if p.owner is not None and p.owner != coords]
            most = max([most] + [owners.count(o) for o in set(owners)])
        return most

    @property
    def zeros(self):
        """The ghost blocks of zeros."""
        return tuple(p.rows for p in self._ghosts(self.coords) if p.owner is None)

    @property
    def copies(self):
        """(source, ghost, flip) of the ghost blocks this rank fills from its own tile (indices of the padded tile)."""
        return tuple((self._padded_rows(p.source), p.rows, p.flip)
                     for p in self._ghosts(self.coords) if p.owner == self.coords)

    @property
    def neighbors(self):
        """The ranks this rank exchanges with."""
        return tuple(sorted({m.peer for m in self.receives + self.sends}))

    def neighbors_along(self, k):
        """``(previous, next)``: the ranks of the tiles before and after this one along grid dim ``k``.

        At this rank's coordinates along the other dims; wrapped along a
        ``"periodic"`` dim (one tile: this rank itself), None at the edges of
        any other (zeros, or beyond a pole).
        """
        count, c = self.grid[k], self.coords[k]

        def at(i):
            if not 0 <= i < count:
                if self.modes[k] != "periodic":
                    return None
                i %= count
            return self.rank_of(self.coords[:k] + (i,) + self.coords[k + 1:])

        return at(c - 1), at(c + 1)
