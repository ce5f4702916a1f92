"""Which rows travel where when the ranks along a sharded dim deal its rows out anew: pure arithmetic.

No MPI, no arrays. A :class:`Layout` says which global rows each rank holds,
in which local order: rank ``r`` holds ``order[offset_r : offset_r + extents[r]]``.
Shards cut by ``shard_tensor`` are :func:`contiguous_layout` (the identity
order). A :class:`RowMove` takes every row from one layout to another; rows
leave each rank for each other rank (itself included) in the target's local
order, so both ends of a message agree on it without telling each other.

The window layouts put whole attention windows on each rank, in the order the
window attention of CREDIT's CrossFormer expects:

- ``"short"`` (:func:`short_window_layout`): windows of ``window`` neighbouring
  rows; each rank takes a block of whole windows, dealt out as evenly as
  :func:`~mpidomain.layout.tiles.balanced_split` deals rows;
- ``"long"`` (:func:`long_window_layout`): with ``G = extent // window``
  groups, group ``h`` is the rows ``h, h + G, h + 2G, ...`` (spaced ``G``
  apart across the whole field); each rank takes a run of whole groups, dealt
  out evenly, and holds them ``l1``-major: local row ``l1 * len(groups) + j``
  is global row ``l1 * G + groups[j]``, so ``rearrange(x, "b d (l1 h) (l2 w)
  -> (b h w) d l1 l2")`` on the local rows finds exactly its windows.

A rank may get no window (more ranks than windows along the dim): it then holds
zero rows. tests/test_layout_moves.py checks every layout of 1-5
ranks in one process.
"""

import functools
import itertools
from dataclasses import dataclass

from .._validate import require_int
from .tiles import balanced_split

__all__ = ["Layout", "RowMove", "contiguous_layout", "short_window_layout", "long_window_layout", "window_move",
           "window_numbers", "WINDOW_KINDS"]

WINDOW_KINDS = ("short", "long")


@dataclass(frozen=True)
class Layout:
    """Every rank's rows of one dim: rank ``r`` holds ``order[offsets[r]:offsets[r] + extents[r]]``, in that order.

    ``order`` is a permutation of ``range(len(order))`` (the global rows);
    ``extents`` the number of rows of each rank, in rank order.
    """

    order: tuple
    extents: tuple

    def __post_init__(self):
        object.__setattr__(self, "order", tuple(int(g) for g in self.order))
        object.__setattr__(self, "extents", tuple(require_int("extents", n, least=0) for n in self.extents))
        if not self.extents:
            raise ValueError("extents must list at least one rank's rows, got ()")
        if sum(self.extents) != len(self.order):
            raise ValueError(f"extents {self.extents} add up to {sum(self.extents)} rows, but order has "
                             f"{len(self.order)}; give each rank's rows so that they add up to the rows of the dim")
        if sorted(self.order) != list(range(len(self.order))):
            raise ValueError(f"order must be a permutation of the {len(self.order)} global rows (each of "
                             f"0..{len(self.order) - 1} once), got {self.order}")

    @property
    def size(self):
        """The number of ranks."""
        return len(self.extents)

    @functools.cached_property
    def offsets(self):
        """Where each rank's rows start in ``order``."""
        return tuple(itertools.accumulate((0,) + self.extents[:-1]))

    def rows_of(self, rank):
        """The global rows ``rank`` holds, in its local order."""
        start = self.offsets[rank]
        return self.order[start:start + self.extents[rank]]

    @functools.cached_property
    def place(self):
        """For each global row: (the rank that holds it, its local index there)."""
        where = [None] * len(self.order)
        for rank in range(self.size):
            for local, row in enumerate(self.rows_of(rank)):
                where[row] = (rank, local)
        return tuple(where)


def contiguous_layout(extents):
    """Return the :class:`Layout` of contiguous blocks in rank order (what ``shard_tensor`` cuts)."""
    extents = tuple(extents)
    return Layout(tuple(range(sum(extents))), extents)


@dataclass(frozen=True)
class RowMove:
    """Every row of one dim from layout ``source`` to layout ``target`` (the same ranks, the same rows).

    Seen from rank ``r``: :meth:`sends` (per peer, the local source rows it
    sends) and :meth:`receives` (per peer, the local target rows they fill),
    each in the target's order. :attr:`inverse` moves them back: the adjoint.
    """

    source: Layout
    target: Layout

    def __post_init__(self):
        if self.source.size != self.target.size or len(self.source.order) != len(self.target.order):
            raise ValueError(f"source and target must deal the same rows to the same ranks, got "
                             f"{len(self.source.order)} rows over {self.source.size} ranks and "
                             f"{len(self.target.order)} over {self.target.size}")

    @property
    def size(self):
        """The number of ranks."""
        return self.source.size

    @property
    def inverse(self):
        """The move back, from ``target`` to ``source``."""
        return RowMove(self.target, self.source)

    def sends(self, rank):
        """For each peer (in rank order, ``rank`` itself included): the local rows of ``rank`` it gets, in order."""
        place = self.source.place
        out = []
        for peer in range(self.size):
            out.append(tuple(place[row][1] for row in self.target.rows_of(peer) if place[row][0] == rank))
        return tuple(out)

    def receives(self, rank):
        """For each peer (in rank order, ``rank`` itself included): the local target rows its rows fill, in order."""
        place = self.source.place
        out = [[] for _ in range(self.size)]
        for local, row in enumerate(self.target.rows_of(rank)):
            out[place[row][0]].append(local)
        return tuple(tuple(rows) for rows in out)


def _windows(extent, window, what):
    extent = require_int("extent", extent, least=0)
    window = require_int("window_size", window, least=1)
    if extent % window:
        raise ValueError(f"{what} attention needs whole windows: the dim has {extent} rows, not a multiple of "
                         f"window_size={window}; pad the field to a multiple of {window} (CREDIT's model pads it "
                         "before its attention) or use a window that divides it")
    return extent // window


def short_window_layout(extent, window, parts):
    """Return the :class:`Layout` of ``parts`` ranks each holding a block of whole ``window``-row windows.

    The windows are dealt out as evenly as possible (the first ranks one more);
    the order is the identity. ValueError if ``window`` does not divide ``extent``.
    """
    parts = require_int("parts", parts, least=1)
    counts, _ = balanced_split(_windows(extent, window, "short-range window"), parts)
    return Layout(tuple(range(extent)), tuple(n * window for n in counts))


def long_window_layout(extent, window, parts):
    """Return the :class:`Layout` of ``parts`` ranks each holding whole long-range groups, ``l1``-major.

    With ``G = extent // window``, group ``h`` is rows ``l1 * G + h`` for
    ``l1 < window``; rank ``r`` takes a run of groups (dealt out as evenly as
    possible) and holds row ``l1 * G + groups[j]`` at local index
    ``l1 * len(groups) + j``. ValueError if ``window`` does not divide ``extent``.
    """
    parts = require_int("parts", parts, least=1)
    groups = _windows(extent, window, "long-range (global) window")
    counts, offsets = balanced_split(groups, parts)
    order = []
    for count, first in zip(counts, offsets):
        order += [l1 * groups + h for l1 in range(window) for h in range(first, first + count)]
    return Layout(tuple(order), tuple(n * window for n in counts))


def window_move(kind, extents, window):
    """Return the :class:`RowMove` from contiguous shards of ``extents`` to whole ``kind`` windows of ``window`` rows.

    ``kind`` is ``"short"`` or ``"long"``; ``extents`` every rank's rows
    along the dim, in rank order (uneven allowed). Cached: the same arguments
    give the same (immutable) move.
    """
    return _window_move(kind, tuple(int(n) for n in extents), window)


@functools.lru_cache(maxsize=256)
def _window_move(kind, extents, window):
    if kind not in WINDOW_KINDS:
        raise ValueError(f"kind must be 'short' or 'long', got {kind!r}")
    make = short_window_layout if kind == "short" else long_window_layout
    return RowMove(contiguous_layout(extents), make(sum(extents), window, len(extents)))


def window_numbers(kind, rows, extent, window):
    """Return the global numbers of the windows a rank's ``rows`` hold, in the order its rearrange finds them.

    ``rows``: the global rows the rank holds along a dim of ``extent`` rows, in local order (a
    ``window_move`` target's ``rows_of``, or all of them). ``"short"``: window ``k`` is local rows
    ``[k * window, (k + 1) * window)``, global window ``row // window``; ``"long"``: window ``j`` is
    local rows ``l1 * n + j``, global group ``row % (extent // window)`` (the number CREDIT's
    ``rearrange(x, "b d (l1 h) (l2 w) -> (b h w) d l1 l2")`` gives it on one process).
    """
    count = len(rows) // window
    if kind == "short":
        return tuple(rows[k * window] // window for k in range(count))
    groups = extent // window
    return tuple(rows[j] % groups for j in range(count))
